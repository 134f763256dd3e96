"""The Controller: runs a deployed ``Placement`` — admits requests, steps instances, streams outputs.

It is hosted in a Ray actor of its own by ``ControllerActor`` (``controller_actor.py``), and runs
in-process on any event loop too (tests, instrumentation). Its parts, each in its own module:
deploying on Ray (``ray_deployment``: placement groups, instance actors, the torch.distributed
world), the admission queue in front of the entry instances (``admission_driver``), KV migration
from prefill to decode instances (``migrations``) and recovery from dead instances
(``recovery``); the policies they apply — admission, routing, the migration queue, blame — live
in ``distserve.cluster`` and are shared with the in-process engine and the simulator.

What this module keeps is the request side and the step loops. Per instance an asyncio task keeps
calling ``step`` while it has work, so prefill and decode instances run concurrently in their own
processes; each ``StepResult`` is applied here (tokens to streams, finished migrations acknowledged
so the prefill side may ``release`` its KV, prefilled requests queued for migration), then the
admission queue dispatches what the entry instances now accept. Step listeners
(``add_step_listener``) see every result before it is applied.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Any

from distserve.cluster.counters import ClusterCounters
from distserve.cluster.migration_queue import MigrationQueue
from distserve.cluster.recovery import CrashLedger
from distserve.cluster.classes import RequestClass
from distserve.config import SamplingParams
from distserve.dtypes import resolve_dtype
from distserve.engine.frontend import RequestFrontend
from distserve.engine.outputs import RequestOutput
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.engine.weights import load_model
from distserve.errors import DistServeError, InvalidConfigError, QueueFullError, ServiceUnavailableError, StepFailedError
from distserve.runtime.admission_driver import AdmissionDriver
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.instance_protocol import StepResult
from distserve.runtime.migrations import KVMigrations
from distserve.runtime.ray_deployment import DeployedInstance, deploy, open_rendezvous, undeploy
from distserve.runtime.recovery import InstanceRecovery
from distserve.runtime.stats import prefill_totals

log = logging.getLogger(__name__)

# A step that did nothing but wait for KV transfers sleeps this long (or until kicked) before polling again.
IDLE_POLL_S = 0.002


@dataclass(frozen=True)
class StepEvent:
    """One ``StepResult`` as the controller received it, before applying it (``add_step_listener``)."""

    instance_id: str  # e.g. "prefill-0"
    phase: str  # prefill | decode | colocated
    result: StepResult
    time: float  # time.monotonic() when the controller received it
    prefill_lens: tuple[int, ...]  # uncached prompt tokens of each request whose first token this step produced
    decode_ctx: tuple[int, ...]  # context (prompt + tokens so far, before this step's) of each other request given a token


class Controller(AdmissionDriver, RequestFrontend, KVMigrations, InstanceRecovery):
    """Owns the instances of one placement: an asyncio object, hosted by ``ControllerActor`` (its own
    Ray actor) in serving, or run on an event loop of the caller's process (tests, experiments)."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.model_name = config.model
        self.dtype = resolve_dtype(config.dtype)
        super().__init__(load_model(config.model, self.dtype, weights=False), config.cache_config, config.scheduler_config)
        self.placement = config.placement
        self.max_queued_requests = config.max_queued_requests
        self.max_instance_restarts = config.max_instance_restarts
        self.instances: list[DeployedInstance] = []
        self._world_size = 0
        self._running = asyncio.Event()  # cleared while the world is formed anew: loops wait between steps
        self._running.set()
        self._steps_in_flight = 0
        self._world_lock = asyncio.Lock()  # one restart at a time
        self.admission = config.admission.queue()  # new requests wait here for an entry instance (``admission_driver``)
        self._dispatched: set[str] = set()
        self._deadline_timers: dict[str, asyncio.TimerHandle] = {}
        self._parked: list[Sequence] = []  # re-runs waiting for an entry instance being restarted
        self._pins: dict[str, tuple[str | None, str | None]] = {}  # request id -> (prefill, decode) instance ids
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._owner: dict[str, DeployedInstance] = {}
        self._source: dict[str, DeployedInstance] = {}  # decode-bound request -> prefill instance holding its KV
        self._pending: MigrationQueue[tuple[DeployedInstance, str]] = MigrationQueue()  # prefilled, waiting for a decode instance
        self._migration_lock = asyncio.Lock()
        self._tags = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self._crashes = CrashLedger()
        self._blamed_in_episode: set[str] = set()  # requests blamed for a death since the last world was formed
        self._step_faults: dict[str, tuple[str, str | None]] = {}  # test hook: request id -> (fault kind, phase or None: all)
        self.counters = ClusterCounters()  # migrations and recovery events (``stats()`` reports them)
        self._migration_started: dict[str, float] = {}
        self._step_listeners: list[Callable[[StepEvent], None]] = []

    # ---- deployment --------------------------------------------------------------------------
    async def start(self) -> None:
        """Create placement groups and instance actors, form the torch.distributed world, start loops."""
        self.instances, self._world_size = await deploy(self.config, self, self.dtype)
        method = await open_rendezvous(self.instances, self.placement, self._world_size)
        await asyncio.gather(*(inst.actor.init.remote(method, self._world_size) for inst in self.instances))
        layouts = await asyncio.gather(*(inst.actor.layout.remote() for inst in self.instances))
        for inst, layout in zip(self.instances, layouts):
            inst.layout = layout
            self._tasks.append(asyncio.create_task(self._loop(inst)))

    async def shutdown(self) -> None:
        self._closed = True
        self._running.set()
        for inst in self.instances:
            inst.wake.set()
        restarts = [t for t in self._background if t.get_name().startswith("restart-")]
        for task in self._tasks + restarts:
            task.cancel()
        await asyncio.gather(*self._tasks, *restarts, return_exceptions=True)
        await undeploy(self.instances)
        self._close_admission()
        for q in self._queues.values():
            q.put_nowait(ServiceUnavailableError("the server is shutting down"))

    def pin(self, request_id: str, prefill: str | None = None, decode: str | None = None) -> None:
        """Route the request ``request_id`` (call before submitting it) to the named instances.

        A debugging and testing aid, e.g. to exercise one prefill/decode pair of a placement:
        ``prefill`` names the entry instance (``prefill-0``, or ``colocated-1``), ``decode`` the
        decode instance. A pinned instance that is dead is ignored (normal routing applies).
        """
        known = {i.spec.instance_id: i.phase for i in self.instances}
        for name, phases in ((prefill, ("prefill", "colocated")), (decode, ("decode",))):
            if name is not None and known.get(name) not in phases:
                raise InvalidConfigError(f"no {'/'.join(phases)} instance named {name!r}; have {sorted(known)}")
        self._pins[request_id] = (prefill, decode)

    # ---- requests ----------------------------------------------------------------------------
    def _outage(self) -> str | None:
        """Why requests cannot be served now (no live or restarting instance of a phase they need), or None."""
        if self._closed:
            return "the server is shutting down"

        def up(phase: str) -> bool:
            return any((i.alive or i.restarting) and i.phase == phase for i in self.instances)

        if up("colocated"):
            return None
        if not up("prefill"):
            return "no prefill or colocated instance is alive"
        if not up("decode"):
            return "no decode instance is alive"
        return None

    async def check_health(self) -> None:
        reason = self._outage()
        if reason is not None:
            raise ServiceUnavailableError(reason)

    def _spawn(self, coro: Any, name: str | None = None) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _call_then_kick(self, inst: DeployedInstance, ref: Any) -> None:
        """Instance actors are threaded, so a call is only known to be applied once it returns:
        kick the step loop after that, or a step racing ahead would report no work and sleep."""
        try:
            await ref
        except Exception:  # noqa: BLE001 - a dead actor is handled by its step loop
            pass
        inst.kick()

    async def generate(
        self, prompt: str | Seq[int], sampling: SamplingParams, request_id: str, priority: int = 0,
        request_class: RequestClass | None = None, timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; closing the iterator early aborts the request."""
        if len(self._queues) >= self.max_queued_requests:
            raise QueueFullError(f"{len(self._queues)} requests in flight (max {self.max_queued_requests})", shared=True)
        if request_id in self._queues or request_id in self._seqs:
            raise DistServeError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self.add_request(prompt, sampling, request_id=request_id, priority=priority, request_class=request_class,
                             timeout_s=timeout_s)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            self._pins.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request (each of its completions) and free its KV everywhere; its stream, if open,
        ends with finish_reason "abort"."""
        group = self._groups.get(request_id)
        seqs = [s for sid in (sorted(group) if group else [request_id]) if (s := self._seqs.get(sid)) is not None]
        if not seqs:
            return
        queue = self._queues.get(request_id)
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            seq.finish_time = time.monotonic()
            out = self._output(seq, seq.finish_time, self._finish)
            if queue is not None:
                queue.put_nowait(out)
            self._forget(seq.seq_id)
            self._drop(seq.seq_id, "abort")
        self._admit()

    def _drop(self, request_id: str, reason: str) -> None:
        """Tell every instance holding this request's KV to free it."""
        self._pending.drop(lambda e: e[1] == request_id)
        self._unqueue(request_id)
        for holder in (self._owner.pop(request_id, None), self._source.pop(request_id, None)):
            if holder is not None and holder.alive:
                holder.route.release(request_id)
                holder.actor.abort.remote(request_id, reason)
                holder.kick()

    def _finish(self, seq: Sequence, reason: str) -> None:
        """A stop string matched: the request is done here and on whichever instance runs it."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self._drop(seq.seq_id, reason)

    # ---- instance loops ----------------------------------------------------------------------
    async def _loop(self, inst: DeployedInstance) -> None:
        import ray

        actor = inst.actor  # a replacement gets a loop of its own
        while not self._closed:
            if not inst.alive or inst.actor is not actor:
                return  # its death was noticed elsewhere (``_notice_deaths``), not by a step of this loop
            if not inst.has_work:
                inst.wake.clear()
                await inst.wake.wait()
                continue
            if not self._running.is_set():
                await self._running.wait()  # the world is being formed anew
                continue
            if inst.solo_queue:
                await self._send_suspects(inst)
                continue  # (the instance may have died, or the world paused, meanwhile)
            inst.kicked = False
            self._steps_in_flight += 1
            issued = time.monotonic()
            try:
                result: StepResult = await inst.actor.step.remote()
            except (ray.exceptions.RayError, StepFailedError) as exc:  # the actor or a worker died, or the step failed
                self._steps_in_flight -= 1
                self._on_death(inst, exc)
                return
            self._steps_in_flight -= 1
            inst.has_work = result.has_work or inst.kicked
            inst.last_step = result
            if self._step_listeners:
                self._notify(inst, result)
            self._apply(inst, result, issued)
            self._admit()
            if self._pending:
                await self._migrate_pending()
            if inst.has_work and not inst.kicked and _only_waited(result):
                # Nothing to compute, transfers in flight: poll gently rather than spin the actor.
                inst.wake.clear()
                try:
                    await asyncio.wait_for(inst.wake.wait(), IDLE_POLL_S)
                except asyncio.TimeoutError:
                    pass

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> Callable[[], None]:
        """Call ``listener`` with every step result before it is applied (instrumentation, e.g. a
        step trace); returns a function that removes it. Listeners run on the controller's loop."""
        self._step_listeners.append(listener)
        return lambda: self._step_listeners.remove(listener)

    def _notify(self, inst: DeployedInstance, result: StepResult) -> None:
        prefill_lens: list[int] = []
        decode_ctx: list[int] = []
        for up in result.updates:
            seq = self._seqs.get(up.seq_id)
            if seq is None or not up.new_token_ids:
                continue
            if seq.first_token_time is None:
                prefill_lens.append(seq.num_prompt_tokens - up.num_cached_tokens)
            else:
                decode_ctx.append(len(seq.token_ids))
        event = StepEvent(inst.instance_id, inst.phase, result, time.monotonic(), tuple(prefill_lens), tuple(decode_ctx))
        for listener in list(self._step_listeners):
            listener(event)

    def _apply(self, inst: DeployedInstance, result: StepResult, issued: float | None = None) -> None:
        """``issued``: when the step call that returned ``result`` was made; with one pipeline stage, the
        launch of the plan whose tokens it carries: a request's prefill start when this is its first token
        (the start of its last prompt chunk, if split over steps or resumed after yielding)."""
        now = time.monotonic()
        self.counters.record_bytes_migrated(result.received_bytes)
        for seq_id in result.received:
            if self._owner.get(seq_id) is not inst:
                continue  # an attempt the runtime gave up on (its source died); that instance was told to abort
            source = self._source.pop(seq_id, None)
            if source is not None and source.alive:
                source.actor.release.remote(seq_id)  # acknowledged: the prefill KV may go
                source.route.release(seq_id)
                source.kick()
            started = self._migration_started.pop(seq_id, None)
            seq = self._seqs.get(seq_id)
            if started is not None:
                self.counters.record_migration_duration(now - started)
                if seq is not None:
                    seq.migration_start_time, seq.migration_end_time = started, now
            if seq is not None and seq.isolate:
                inst.solo_pending[seq_id] = seq.arrival_time  # its first decode step runs alone
        for seq_id in result.failed_transfers:
            if self._owner.get(seq_id) is inst and seq_id in self._source:
                self._on_failed_transfer(seq_id, timed_out=seq_id in result.timed_out_transfers)
        for up in result.updates:
            seq = self._seqs.get(up.seq_id)
            if seq is None or seq.is_finished or self._owner.get(up.seq_id) is not inst:
                continue
            seq.token_ids.extend(up.new_token_ids)
            seq.logprobs.extend(up.new_logprobs)
            seq.top_logprobs.extend(up.new_top_logprobs)
            if up.prompt_logprobs is not None:
                seq.prompt_logprobs = up.prompt_logprobs
            seq.error = up.error
            if inst.solo_pending.pop(seq.seq_id, None) is not None and inst.phase != "prefill":
                seq.isolate = False  # as the instance's scheduler did (clears_isolation)
            if up.new_token_ids and seq.first_token_time is None:
                if issued is not None and inst.spec.pp == 1 and seq.prefill_start_time is None:
                    # A step call made just before the dispatch may still have computed it (the actor is threaded).
                    seq.prefill_start_time = max(issued, seq.dispatch_time or seq.arrival_time)
                seq.first_token_time = now
                seq.num_cached_tokens = up.num_cached_tokens
            if up.finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = up.finish_reason
                seq.finish_time = now
                self._dispatched.discard(seq.seq_id)
                owner = self._owner.pop(seq.seq_id, None)
                if owner is not None:
                    owner.route.release(seq.seq_id)
            elif up.awaiting_migration:
                self._pending.push((inst, seq.seq_id))
            out = self._output(seq, now, self._finish)
            queue = self._queues.get(seq.request_id)
            if queue is not None:
                queue.put_nowait(out)

    # ---- observability -----------------------------------------------------------------------
    async def stats(self) -> dict[str, object]:
        alive = [i for i in self.instances if i.alive]
        per = await asyncio.gather(*(i.actor.stats.remote() for i in alive), return_exceptions=True)
        instances = [s for s in per if isinstance(s, dict)]
        return {
            "instances": instances,
            "kv_migration_seconds": self.counters.drain_migration_durations(),
            "num_requests_awaiting_migration": len(self._pending),
            **self.counters.as_stats(),
            **prefill_totals(instances),  # of the live instances: a restarted one counts from 0 again
            "admission": self.admission.stats(),  # per-tenant queued/admitted/dispatched/rejected/expired
        }

    async def worker_pids(self) -> dict[str, list[int]]:
        """Process ids of each live instance's ranks (rank 0 first), e.g. to crash one in a test."""
        alive = [i for i in self.instances if i.alive]
        pids = await asyncio.gather(*(i.actor.worker_pids.remote() for i in alive))
        return {i.spec.instance_id: p for i, p in zip(alive, pids)}

    async def placement_report(self) -> list[dict[str, Any]]:
        """Where each instance's workers run (Ray node ids), for checks and /debug."""
        nodes = await asyncio.gather(*(i.actor.worker_node_ids.remote() for i in self.instances))
        return [
            {"instance": i.spec.instance_id, "tp": i.spec.tp, "pp": i.spec.pp, "node_ids": n}
            for i, n in zip(self.instances, nodes)
        ]


def _only_waited(result: StepResult) -> bool:
    """The step computed nothing and no transfer finished: the instance is only waiting on KV."""
    return not (result.num_batched_tokens or result.updates or result.received or result.failed_transfers or result.received_bytes)
