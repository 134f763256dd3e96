"""The controller's recovery: re-running the requests of a dead instance and restarting it.

An instance whose actor or any of its workers dies (or whose step fails) is replaced: its requests
are re-run (prompt + tokens so far) on a surviving entry instance — or, when none is alive, parked
until the replacement is up (``admission_driver``: a re-run never queues for admission again) —
and the controller restarts it in its placement group (up to ``max_instance_restarts`` times). A
death is blamed on the requests it was computing (``cluster.recovery``, the policy): one blamed
twice is poison and fails instead (at most once per fault episode: deaths noticed before the world
is formed anew). The replacement must join the torch.distributed world, which
cannot grow a member back, so the world is formed anew: every instance pauses between steps,
cancels its KV transfers in flight (those requests are prefilled again) and rebuilds its process
groups, keeping its model and KV cache; then all resume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from distserve.cluster.counters import ClusterCounters
from distserve.cluster.migration_queue import MigrationQueue
from distserve.cluster.recovery import CrashLedger, blame, poison_message, suspects_of
from distserve.cluster.routing import RouteState
from distserve.engine.outputs import RequestOutput
from distserve.engine.sequence import Sequence
from distserve.errors import DistServeError, ServiceUnavailableError
from distserve.placement import Placement
from distserve.runtime.ray_deployment import DeployedInstance, create_instance_actor, open_rendezvous

log = logging.getLogger(__name__)

RESTART_TIMEOUT_S = 300.0  # a replacement that is not up (loaded and in the new world) by then stays dead
LIVENESS_TIMEOUT_S = 10.0  # before a restart, every live instance's ranks must answer within it to count as alive


class InstanceRecovery:
    """The ``Controller``'s recovery half (a mixin: it works on the controller's request state)."""

    placement: Placement
    instances: list[DeployedInstance]
    max_instance_restarts: int
    counters: ClusterCounters
    _seqs: dict[str, Sequence]
    _owner: dict[str, DeployedInstance]
    _source: dict[str, DeployedInstance]
    _queues: dict[str, asyncio.Queue[RequestOutput | BaseException]]
    _pending: MigrationQueue[tuple[DeployedInstance, str]]
    _crashes: CrashLedger
    _blamed_in_episode: set[str]
    _closed: bool
    _running: asyncio.Event
    _steps_in_flight: int
    _world_size: int
    _world_lock: asyncio.Lock
    _migration_lock: asyncio.Lock
    _migration_started: dict[str, float]
    _step_faults: dict[str, tuple[str, str | None]]
    _tasks: list[asyncio.Task[None]]

    if TYPE_CHECKING:  # the Controller's, which this half calls
        def _spawn(self, coro: object, name: str | None = None) -> None: ...
        async def _call_then_kick(self, inst: DeployedInstance, ref: object) -> None: ...
        def _outage(self) -> str | None: ...
        def _submit(self, seq: Sequence) -> None: ...
        def _admit(self) -> None: ...
        def _drop(self, request_id: str, reason: str) -> None: ...
        def _forget(self, request_id: str) -> None: ...
        def _fail(self, seq: Sequence, error: str, now: float) -> RequestOutput: ...
        async def _loop(self, inst: DeployedInstance) -> None: ...
        async def _migrate_pending(self) -> None: ...

    def _on_death(self, inst: DeployedInstance, exc: BaseException | None = None) -> None:
        """Re-run the dead instance's requests from prompt + tokens so far on survivors; restart it.

        The death is blamed on the requests it was computing (``distserve.cluster.recovery``): one
        blamed a second time is poison and fails instead of being re-run, and the restarts its
        deaths caused are not charged to ``max_instance_restarts``.
        """
        if not any(i.restarting and not i.alive for i in self.instances):
            self._blamed_in_episode.clear()  # the first death of a fault episode
        inst.alive = False
        lost = [sid for sid, owner in self._owner.items() if owner is inst]
        lost += [sid for sid, src in self._source.items() if src is inst and sid not in lost]
        failure = getattr(exc, "cause", None) or exc  # a RayTaskError carries what the step raised
        blamed = suspects_of(failure, lost, inst.solo_pending)
        inst.solo_pending.clear()
        inst.solo_queue.clear()  # not sent yet: re-run below with the rest of ``lost``
        # One fault, one blame: the deaths noticed until the world is formed anew (steps are paused from
        # the first one's restart until then) are one episode, so a request held by both ends of its
        # migration, or computing on an instance whose peer was killed, is not blamed twice for it.
        suspects = [seq for sid in blamed if (seq := self._seqs.get(sid)) is not None and not seq.is_finished
                    and sid not in self._blamed_in_episode]
        self._blamed_in_episode.update(seq.seq_id for seq in suspects)
        convicted = blame(suspects)
        for instance_id in self._crashes.record(inst.spec.instance_id, suspects, convicted, set(self._seqs)):
            refunded = next(i for i in self.instances if i.spec.instance_id == instance_id)
            refunded.charged_restarts = max(0, refunded.charged_restarts - 1)
        charged = not convicted
        inst.restarting = not self._closed and (not charged or inst.charged_restarts < self.max_instance_restarts)
        if inst.restarting and charged:
            inst.charged_restarts += 1
        if exc is not None:
            log.warning("instance %s failed (%s: %s); %s", inst.spec.instance_id, type(exc).__name__, failure,
                        "restarting it" if inst.restarting else "not restarting it")
        poison = {seq.seq_id for seq in convicted}
        self._pending.drop(lambda e: e[0] is inst)
        for seq_id in lost:
            seq = self._seqs.get(seq_id)
            if seq_id in poison and seq is not None:
                self.counters.record_request_failed_poison()
                self._fail_request(seq, poison_message(seq))  # also frees its KV on survivors
                continue
            owner = self._owner.pop(seq_id, None)
            holder = self._source.pop(seq_id, None)
            if owner is inst and holder is not None and holder.alive and seq is not None and not seq.is_finished:
                # Its decode instance died mid-migration; the prefill side still holds the KV, so
                # the request is prefilled again there (prefix cached) and migrates anew — as after
                # a failed transfer. (An abort and a re-add of the same id could cross on the way.)
                self._migration_started.pop(seq_id, None)
                self._owner[seq_id] = holder
                self._pending.drop(lambda e, seq_id=seq_id: e[1] == seq_id)
                self.counters.record_request_rerun()
                self._spawn(self._call_then_kick(holder, holder.actor.requeue.remote(seq_id)))
                continue
            for survivor in (owner, holder):
                if survivor is not None and survivor is not inst and survivor.alive:
                    survivor.actor.abort.remote(seq_id, "abort")  # e.g. a decode instance mid-receive
                    survivor.route.release(seq_id)
                    survivor.kick()
            if seq is None or seq.is_finished:
                continue
            self.counters.record_request_rerun()
            self._reroute(seq)
        if inst.restarting:
            self._spawn(self._restart(inst), name=f"restart-{inst.spec.instance_id}")
        else:
            self._fail_stranded()
        self._admit()  # what the dead instance would have taken goes to the survivors

    def _fail_request(self, seq: Sequence, error: str) -> None:
        """End one request with ``error`` (finish_reason "error") and free its KV wherever it is."""
        out = self._fail(seq, error, time.monotonic())
        self._forget(seq.seq_id)
        self._drop(seq.seq_id, "abort")
        queue = self._queues.get(seq.request_id)
        if queue is not None:
            queue.put_nowait(out)

    def _fail_stranded(self) -> None:
        """In an outage (a phase has no live or restarting instance), fail the requests that can no
        longer finish — all but those on live colocated instances — with ``ServiceUnavailableError``."""
        reason = self._outage()
        if reason is None:
            return
        for seq_id in list(self._seqs):
            owner = self._owner.get(seq_id)
            if owner is not None and owner.alive and owner.phase == "colocated":
                continue
            seq = self._forget(seq_id)
            self._drop(seq_id, "abort")
            queue = self._queues.get(seq.request_id if seq is not None else seq_id)
            if queue is not None:
                queue.put_nowait(ServiceUnavailableError(reason))

    def _reroute(self, seq: Sequence) -> None:
        try:
            self._submit(seq)  # admitted already: straight to an entry instance, or parked
        except (DistServeError, ServiceUnavailableError) as exc:
            queue = self._queues.get(seq.request_id)
            if queue is not None:
                queue.put_nowait(exc)

    async def _restart(self, inst: DeployedInstance) -> None:
        """Replace a dead instance in its placement group and form the world anew with it.

        Every other instance dead by then (noticed or not) is replaced in the same world: the world
        needs all its ranks, so replacing one while another is dead would wait for that one's ranks
        until ``RESTART_TIMEOUT_S``, or fail (two instances killed at once).
        """
        import ray

        async with self._world_lock, self._migration_lock:
            if inst.alive or not inst.restarting:
                return  # replaced along with another dead instance
            self._running.clear()
            group = [inst]
            try:
                while self._steps_in_flight and not self._closed:
                    await asyncio.sleep(0.005)  # let every step in flight return (a dead instance's is noticed then)
                if self._closed:
                    return
                await self._notice_deaths()
                group = [i for i in self.instances if i.restarting and not i.alive]
                names = ", ".join(i.spec.instance_id for i in group)
                log.info("restart %s: steps paused", names)
                for dead in group:
                    try:
                        ray.kill(dead.actor, no_restart=True)  # what is left of it (its workers die with it)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
                    dead.actor = create_instance_actor(dead)
                survivors = [i for i in self.instances if i.alive]
                method = await asyncio.wait_for(open_rendezvous(self.instances, self.placement, self._world_size), RESTART_TIMEOUT_S)
                await asyncio.wait_for(
                    asyncio.gather(
                        *(dead.actor.init.remote(method, self._world_size) for dead in group),
                        *(i.actor.reinit.remote(method, self._world_size) for i in survivors),
                    ),
                    RESTART_TIMEOUT_S,
                )
                for dead in group:
                    dead.layout = await dead.actor.layout.remote()
                    for request_id, (kind, phase) in self._step_faults.items():
                        if phase in (None, dead.phase):
                            await dead.actor.inject_step_fault.remote(request_id, kind)
                log.info("restart %s: the new world of %d ranks is formed", names, self._world_size)
            except Exception as exc:  # noqa: BLE001 - the instances stay dead; survivors that broke fail their next step
                log.error("restarting instance(s) %s failed: %r", ", ".join(i.spec.instance_id for i in group), exc)
                for dead in group:
                    dead.restarting = False
                self._admit()  # parked re-runs go to a survivor, if any
                self._fail_stranded()
                return
            finally:
                self._running.set()
            for dead in group:
                dead.restarts += 1
                self.counters.record_instance_restart()
                dead.route = RouteState(pool=dead.route.pool)
                dead.last_step, dead.num_added, dead.unseen = None, 0, []  # the new actor has seen no request
                dead.has_work = dead.kicked = False
                dead.restarting = False
                dead.alive = True
                self._tasks.append(asyncio.create_task(self._loop(dead)))
            for i in self.instances:
                if i.alive:
                    i.kick()  # cancelled transfers are reported at their next step
        self._admit()  # parked re-runs first, then the admission queue
        if self._pending:
            await self._migrate_pending()

    async def _send_suspects(self, inst: DeployedInstance) -> None:
        """Send the crash suspects placed on ``inst`` (its loop calls this between steps) and wait until
        its actor has them all. The actor is threaded: a suspect's ``add`` racing a step could land after
        the step ran another suspect alone, and a death of that step would be blamed on the wrong one
        (``suspects_of`` blames the oldest suspect the controller sent). Sent between steps, and a step
        issued only once they arrived, the suspects the instance's scheduler picks from are exactly the
        ones counted in ``solo_pending``."""
        queued, inst.solo_queue = inst.solo_queue, []
        sent = [s for s in queued if self._owner.get(s.seq_id) is inst and s.seq_id in self._seqs]  # not aborted since
        for seq in sent:
            inst.solo_pending[seq.seq_id] = seq.arrival_time
        # A dead actor fails these calls; its next step notices the death.
        await asyncio.gather(*(inst.actor.add.remote(seq) for seq in sent), return_exceptions=True)

    async def _notice_deaths(self) -> None:
        """Handle the death of every instance that died unnoticed (idle: no step of it failed yet), so that
        the world is formed without waiting for its ranks: each rank must answer (its pid)."""
        async def death(inst: DeployedInstance) -> Exception | None:
            try:
                await asyncio.wait_for(inst.actor.worker_pids.remote(), LIVENESS_TIMEOUT_S)
            except asyncio.TimeoutError:
                return None  # alive but busy (or stopped): its next step tells
            except Exception as exc:  # noqa: BLE001 - a dead rank
                return exc
            return None

        alive = [i for i in self.instances if i.alive]
        for inst, exc in zip(alive, await asyncio.gather(*(death(i) for i in alive))):
            if exc is not None:
                self._on_death(inst, exc)
                inst.kick()  # its idle step loop wakes and ends

    async def inject_step_fault(self, request_id: str, kind: str = "raise", phase: str | None = None) -> None:
        """Test hook: every step computing ``request_id`` fails on every instance of ``phase`` (None: every
        instance), replacements included (``ModelRunner.inject_step_fault``): a poison request."""
        self._step_faults[request_id] = (kind, phase)
        await asyncio.gather(*(i.actor.inject_step_fault.remote(request_id, kind) for i in self.instances
                               if i.alive and phase in (None, i.phase)))
