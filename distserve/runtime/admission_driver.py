"""The controller's admission: driving the cluster core's admission queue in front of the entry instances.

A new request is pushed into the controller's ``AdmissionQueue`` (``distserve.cluster.admission``,
built from ``DeploymentConfig.admission``), where it may be refused at once with ``QueueFullError``
(its tenant's bound or tokens per minute: HTTP 429 with ``Retry-After``). It leaves the queue in the
policy's order (``fair`` by default) when an entry instance — prefill, or colocated — accepts it
under backpressure: that instance's scheduler waiting queue, counted as its latest ``StepResult``
reported it plus the requests sent to it that the step had not received yet, and, with a TPOT SLO,
the last step of the instances where requests decode. ``_admit`` runs whenever its answer can
change: on arrival, after each step result, after an abort, at a queued request's deadline (it then
fails with ``error_kind`` "timeout", HTTP 408) and once a restarted instance is up. The queue and its
rules are the ones ``LocalDisaggEngine`` and the simulator drive, so all three queue alike.

A request re-run after its instance died (``runtime.recovery``) was admitted already: it goes
straight to an entry instance, or is parked while every entry instance is being restarted; it never
queues as a new request again (``_dispatched``).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from distserve.cluster.backpressure import add_pending, decode_headroom, decode_room_tokens, step_capacity
from distserve.cluster.admission import AdmissionItem, AdmissionQueue, EntryLoad, expired_error, measured_tpot_s
from distserve.cluster.routing import entry_hashes, pick_entry
from distserve.config import CacheConfig
from distserve.engine.outputs import RequestOutput
from distserve.engine.sequence import Sequence
from distserve.errors import ServiceUnavailableError
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.ray_deployment import DeployedInstance, route_of

# A deadline timer fires this much after the deadline: ``expire`` drops items whose deadline is
# <= now, and the loop's clock may wake a hair early.
DEADLINE_SLACK_S = 1e-3


def _unseen(inst: DeployedInstance) -> list[tuple[int, int, int]]:
    """The requests sent to ``inst`` that its latest step had not received yet: (add number, rank, prompt tokens)."""
    seen = inst.last_step.num_added if inst.last_step is not None else 0
    inst.unseen = [u for u in inst.unseen if u[0] > seen]
    return inst.unseen


def instance_load(inst: DeployedInstance, tpot: float | None, decode_room: int | None = None, headroom: int | None = None) -> EntryLoad:
    """What backpressure reads of an entry instance: the waiting requests and pending prompt tokens
    (by admission rank) its latest step reported, plus those sent to it that the step had not
    received yet, and what a step of its scheduler takes."""
    last = inst.last_step
    unseen = _unseen(inst)
    pending = last.pending_prompt_tokens if last is not None else ()
    for _, rank, tokens in unseen:
        pending = add_pending(pending, rank, tokens)
    waiting = (last.num_waiting if last is not None else 0) + len(unseen)
    return EntryLoad(waiting, tpot, pending, *step_capacity(inst.spec.scheduler, inst.spec.phase, inst.spec.pp), decode_room, headroom)


class AdmissionDriver:
    """The ``Controller``'s admission half (a mixin: it works on the controller's request state)."""

    config: DeploymentConfig
    cache_config: CacheConfig
    instances: list[DeployedInstance]
    admission: AdmissionQueue[DeployedInstance]
    _closed: bool
    _seqs: dict[str, Sequence]
    _queues: dict[str, asyncio.Queue[RequestOutput | BaseException]]
    _owner: dict[str, DeployedInstance]
    _pins: dict[str, tuple[str | None, str | None]]
    _parked: list[Sequence]  # re-runs waiting for an entry instance being restarted
    _dispatched: set[str]  # requests that left the admission queue and are not finished
    _deadline_timers: dict[str, asyncio.TimerHandle]  # queued request -> its expiry wake-up

    if TYPE_CHECKING:  # the Controller's, which this half calls
        def _spawn(self, coro: object, name: str | None = None) -> None: ...
        async def _call_then_kick(self, inst: DeployedInstance, ref: object) -> None: ...
        def _outage(self) -> str | None: ...
        def _forget(self, request_id: str) -> Sequence | None: ...
        def _fail(self, seq: Sequence, error: str, now: float, finish: object = None, kind: str | None = None) -> RequestOutput: ...

    # ---- arrival ---------------------------------------------------------------------------------
    def _submit(self, seq: Sequence) -> None:
        """A new request joins the admission queue (or is refused: ``QueueFullError``,
        ``ServiceUnavailableError``); a re-run of an admitted one goes straight to an entry instance."""
        if seq.seq_id in self._dispatched:
            self._rerun(seq)
            return
        try:
            reason = self._outage()
            if reason is not None:
                raise ServiceUnavailableError(reason)
            item = AdmissionItem(seq.seq_id, seq.request_class, seq.num_prompt_tokens + seq.sampling.max_tokens * seq.num_completions,
                                 seq.arrival_time, seq.priority, seq.timeout_s, seq, num_prompt_tokens=seq.num_prompt_tokens)
            waiting = 0 if self.admission.max_queue_delay_s is None else \
                sum(instance_load(i, None).num_waiting for i in self._entry_instances())
            self.admission.push(item, time.monotonic(), waiting)
        except BaseException:  # it never entered
            self._forget(seq.seq_id)
            raise
        if seq.timeout_s is not None:
            loop = asyncio.get_running_loop()
            self._deadline_timers[seq.seq_id] = loop.call_later(seq.timeout_s + DEADLINE_SLACK_S, self._admit)
        self._admit()

    def _rerun(self, seq: Sequence) -> None:
        """An admitted request run again (its instance died): to a live entry instance, or parked."""
        reason = self._outage()
        if reason is not None:
            raise ServiceUnavailableError(reason)
        entry = self._entry_instances()
        if entry:
            self._place(seq, entry, entry)
        else:
            self._parked.append(seq)  # an entry instance is restarting: placed when it is up (``_admit``)

    def _entry_instances(self) -> list[DeployedInstance]:
        """The live instances a request may enter: prefill ones only while a decode instance is up."""
        decode_up = any((i.alive or i.restarting) and i.phase == "decode" for i in self.instances)
        phases = ("prefill", "colocated") if decode_up else ("colocated",)
        return [i for i in self.instances if i.alive and i.phase in phases]

    def _place(self, seq: Sequence, candidates: list[DeployedInstance], entry: list[DeployedInstance]) -> DeployedInstance:
        """Send ``seq`` to the entry instance routing picks among ``candidates`` — or to its pinned
        instance among the live ``entry`` ones (a pin, a debugging aid, wins over backpressure)."""
        pinned = self._pins.get(seq.seq_id, (None, None))[0]
        candidates = [i for i in entry if i.spec.instance_id == pinned] or candidates
        cc = self.cache_config
        hashes = entry_hashes(seq, cc.block_size, cc.enable_prefix_caching)
        inst = pick_entry(candidates, route_of, hashes, self.config.router, seq.seq_id, seq.request_class)
        for s in (seq, *seq.forks):  # n > 1: its completions ride with it; each is the instance's from now on
            self._owner[s.seq_id] = inst
            self._dispatched.add(s.seq_id)
        inst.num_added += 1
        inst.unseen.append((inst.num_added, seq.admission_rank, seq.num_prompt_tokens))
        if seq.isolate:  # a crash suspect: its instance's loop sends it between steps (``_send_suspects``)
            inst.solo_queue.append(seq.detached_copy())
            inst.kick()
        else:
            self._spawn(self._call_then_kick(inst, inst.actor.add.remote(seq.detached_copy())))
        seq.forks = []  # a later re-run (its instance died) runs each completion on its own
        return inst

    # ---- dispatch --------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Fail the queued requests past their deadline, place parked re-runs, then dispatch what
        the entry instances accept."""
        if self._closed:
            return
        now = time.monotonic()
        for item in self.admission.expire(now):
            self._cancel_deadline(item.request_id)
            seq = self._seqs.get(item.request_id)
            if seq is None:
                continue
            out = self._fail(seq, str(expired_error(item, now)), now, kind=item.expired_kind)
            queue = self._queues.get(item.request_id)
            if queue is not None:
                queue.put_nowait(out)
        entry = self._entry_instances()
        if not entry:
            return  # every entry instance is restarting: requests wait (an outage fails them, ``_fail_stranded``)
        parked, self._parked = self._parked, []
        for seq in parked:
            self._place(seq, entry, entry)
        if not self.admission:
            return
        tpot = self._measured_tpot()
        room, headroom = self._decode_limits()

        def load(inst: DeployedInstance) -> EntryLoad:
            return instance_load(inst, tpot, room, headroom)

        def place(item: AdmissionItem, accepting: list[DeployedInstance]) -> DeployedInstance:
            self._cancel_deadline(item.request_id)
            # Before the copy is sent: the instance scheduler keeps the admission order and rank.
            item.payload.dispatch_time, item.payload.admission_rank = now, item.rank
            return self._place(item.payload, accepting, entry)

        self.admission.dispatch(now, entry, load, place)

    def _measured_tpot(self) -> float | None:
        """The TPOT backpressure reads, from the latest step of the live instances where requests decode: the
        time between a request's tokens (``StepResult.token_interval_s``: the step and the round trip through
        this controller and its work between steps; a pipelined instance's step launches one micro-batch and
        ends when the oldest finishes, so a request advances once per ``pp`` steps, over which it is measured)."""
        if self.admission.backpressure.tpot_slo_s is None:
            return None
        return measured_tpot_s(
            (i.last_step.num_running, i.last_step.token_interval_s)
            for i in self.instances if i.alive and i.phase != "prefill" and i.last_step is not None
        )

    def _decode_limits(self) -> tuple[int | None, int | None]:
        """``EntryLoad.decode_room_tokens`` and ``decode_headroom`` under the TPOT rule on a disaggregated
        deployment (else None): the live decode instances' free KV as their latest steps reported it (all
        of it before their first), less the prompt tokens the prefill instances hold; and the requests
        their time per token leaves room for, less those the prefill instances hold (each: their latest
        steps' count plus what was sent to them since)."""
        slo = self.admission.backpressure.tpot_slo_s
        if slo is None:
            return None, None
        decodes = [i for i in self.instances if i.alive and i.phase == "decode"]
        if not decodes:
            return None, None
        block_size = self.cache_config.block_size
        free = ((i.last_step.num_free_blocks if i.last_step is not None else i.spec.num_blocks) * block_size for i in decodes)
        held, held_requests = [], 0
        for inst in self.instances:
            if inst.alive and inst.phase == "prefill":
                unseen, last = _unseen(inst), inst.last_step
                held.append((last.held_prompt_tokens if last is not None else 0) + sum(u[2] for u in unseen))
                held_requests += (last.num_held if last is not None else 0) + len(unseen)
        headroom = decode_headroom(((i.last_step.num_running, i.last_step.token_interval_s) if i.last_step is not None else (0, 0.0)
                                    for i in decodes), slo, held_requests)
        return decode_room_tokens(free, held), headroom

    # ---- leaving -------------------------------------------------------------------------------
    def _unqueue(self, request_id: str) -> None:
        """The request ended: take it out of the admission queue, the parked re-runs and the dispatched set."""
        self.admission.remove(request_id)
        self._cancel_deadline(request_id)
        self._dispatched.discard(request_id)
        if self._parked:
            self._parked = [s for s in self._parked if s.seq_id != request_id]

    def _cancel_deadline(self, request_id: str) -> None:
        timer = self._deadline_timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()

    def _close_admission(self) -> None:
        """Shutdown: empty the queue (the streams of its requests end with ``ServiceUnavailableError``)."""
        for request_id in list(self._seqs):
            self.admission.remove(request_id)
        for timer in self._deadline_timers.values():
            timer.cancel()
        self._deadline_timers.clear()
        self._parked = []
