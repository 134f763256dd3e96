"""The Controller: deploys a ``Placement`` on Ray, routes requests, migrates KV, streams outputs.

It is hosted in a Ray actor of its own by ``ControllerActor`` (``controller_actor.py``), and runs
in-process on any event loop too (tests, instrumentation).

Instances are threaded Ray actors (``InstanceServer``) in one placement group each (STRICT_PACK,
on the node the placement names). All their workers form one torch.distributed world (gloo on
CPU, NCCL on GPU): TP/PP groups inside an instance, point-to-point KV migration between them.

Per instance an asyncio task keeps calling ``step`` while it has work, so prefill and decode
instances run concurrently in their own processes. When a prefill step yields a first token,
the request waits (KV held) until a decode instance ``reserve``s room — pull-based — then both
sides post the transfer; the decode side reports it received, and only then is the prefill side
told to ``release`` its blocks. A transfer that fails or does not complete within
``kv_transfer_timeout_s`` is decided by the decode side (it cancels its reservation): the prefill
side stops sending and prefills the request again, which then migrates anew.

An instance whose actor or any of its workers dies (or whose step fails) is replaced: its
requests are re-run (prompt + tokens so far) on a surviving instance of the same phase — or,
when it was the last of its phase, parked until the replacement is up — and the controller
restarts it in its placement group (up to ``max_instance_restarts`` times). The replacement must
join the torch.distributed world, which cannot grow a member back, so the world is formed anew:
every instance pauses between steps, cancels its KV transfers in flight (those requests are
prefilled again) and rebuilds its process groups, keeping its model and KV cache; then all resume.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import socket
import time
from collections.abc import AsyncIterator, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from distserve.cluster.recovery import CrashLedger, blame, poison_message, suspects_of
from distserve.cluster.migration_queue import MigrationQueue
from distserve.cluster.routing import RouteState, decode_order, pick_entry
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.block_manager import prefix_block_hashes
from distserve.engine.model import resolve_dtype
from distserve.engine.outputs import RequestFrontend, RequestOutput
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.engine.weights import load_model
from distserve.errors import DistServeError, InvalidConfigError, QueueFullError, ServiceUnavailableError, StepFailedError
from distserve.kvtransfer.layout import KVLayout
from distserve.kvtransfer.migration import num_tags
from distserve.kvtransfer.transport import MAX_TAG
from distserve.placement import InstanceSpec as PlacedInstance
from distserve.placement import Placement
from distserve.runtime.instance_server import InstanceServer, InstanceSpec, StepResult
from distserve.runtime.worker import Worker, WorkerSpec

log = logging.getLogger(__name__)

CPUS_PER_WORKER = 0.1  # Ray bookkeeping only: on 2 cores, the OS shares the cores among workers.
DEFAULT_KV_TRANSFER_TIMEOUT_S = 30.0
# A step that did nothing but wait for KV transfers sleeps this long (or until kicked) before polling again.
IDLE_POLL_S = 0.002
DEFAULT_MAX_INSTANCE_RESTARTS = 3  # per instance; then it stays dead and its phase runs on the survivors
RESTART_TIMEOUT_S = 300.0  # a replacement that is not up (loaded and in the new world) by then stays dead


class RayWorkerFactory:
    """Creates a worker actor in its bundle of the instance's placement group (picklable)."""

    def __init__(self, placement_group: Any) -> None:
        self.placement_group = placement_group

    def __call__(self, spec: WorkerSpec) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=spec.shard.rank)
        return (
            ray.remote(Worker)
            # Threads: one per plan waiting its turn (up to pp), plus transfers, polls and control calls.
            .options(num_cpus=CPUS_PER_WORKER, max_concurrency=spec.shard.pp + 4, scheduling_strategy=strategy)
            .remote(spec)
        )


@dataclass
class _Instance:
    spec: InstanceSpec
    actor: Any
    placement_group: Any
    layout: KVLayout | None = None
    has_work: bool = False
    kicked: bool = False  # work arrived while a step was in flight: step again
    alive: bool = True
    restarting: bool = False  # dead, and a replacement is being started
    restarts: int = 0
    charged_restarts: int = 0  # of its deaths, those counted against max_instance_restarts (poison's are not)
    solo_pending: dict[str, float] = field(default_factory=dict)  # suspects here before their step alone -> arrival
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    route: RouteState = field(default_factory=RouteState)  # what routing knows (``cluster.routing``)

    @property
    def phase(self) -> str:
        return self.spec.phase

    def kick(self) -> None:
        self.has_work = True
        self.kicked = True
        self.wake.set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_resources(node_index: int | None) -> dict[str, float]:
    """Bundle resources pinning a worker to the placement's node ``node_index``.

    A cluster may label its nodes with ``distserve_node_<i>`` custom resources; otherwise node i
    is the i-th alive Ray node by node id, addressed through Ray's built-in ``node:<ip>`` resource.
    """
    if node_index is None:
        return {}
    import ray

    label = f"distserve_node_{node_index}"
    if label in ray.cluster_resources():
        return {label: 0.001}
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"])
    if node_index >= len(nodes):
        raise InvalidConfigError(f"placement names node {node_index} but the Ray cluster has {len(nodes)} node(s)")
    return {f"node:{nodes[node_index]['NodeManagerAddress']}": 0.001}


class Controller(RequestFrontend):
    """Owns the instances of one placement: an asyncio object, hosted by ``ControllerActor`` (its own
    Ray actor) in serving, or run on an event loop of the caller's process (tests, experiments)."""

    def __init__(
        self,
        model: str,
        placement: Placement,
        *,
        dtype: str = "auto",
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        prefill_scheduler_config: SchedulerConfig | None = None,
        max_queued_requests: int = 1024,
        num_threads_per_worker: int = 1,
        kv_transfer_timeout_s: float = DEFAULT_KV_TRANSFER_TIMEOUT_S,
        max_instance_restarts: int = DEFAULT_MAX_INSTANCE_RESTARTS,
    ) -> None:
        if not (kv_transfer_timeout_s > 0 and math.isfinite(kv_transfer_timeout_s)):
            raise InvalidConfigError(f"kv_transfer_timeout_s must be a positive number of seconds, got {kv_transfer_timeout_s}")
        if not (isinstance(max_instance_restarts, int) and max_instance_restarts >= 0):
            raise InvalidConfigError(f"max_instance_restarts must be an integer >= 0, got {max_instance_restarts!r}")
        self.model_name = model
        self.dtype = resolve_dtype(dtype)
        super().__init__(load_model(model, self.dtype, weights=False), cache_config, scheduler_config)
        self.placement = placement
        self.prefill_scheduler_config = prefill_scheduler_config or self.scheduler_config
        self.max_queued_requests = max_queued_requests
        self.num_threads_per_worker = num_threads_per_worker
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.max_instance_restarts = max_instance_restarts
        self.instances: list[_Instance] = []
        self._world_size = 0
        self._running = asyncio.Event()  # cleared while the world is formed anew: loops wait between steps
        self._running.set()
        self._steps_in_flight = 0
        self._world_lock = asyncio.Lock()  # one restart at a time
        self._parked: list[Sequence] = []  # requests waiting for an entry instance being restarted
        self._pins: dict[str, tuple[str | None, str | None]] = {}  # request id -> (prefill, decode) instance ids
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._owner: dict[str, _Instance] = {}
        self._source: dict[str, _Instance] = {}  # decode-bound request -> prefill instance holding its KV
        self._pending: MigrationQueue[tuple[_Instance, str]] = MigrationQueue()  # prefilled, waiting for a decode instance
        self._migration_lock = asyncio.Lock()
        self._tags = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self._crashes = CrashLedger()
        self._step_faults: dict[str, str] = {}  # test hook: request id -> fault kind, armed on every instance
        self.migration_counters = {
            "num_migrations": 0,  # attempts started, failed ones included
            "kv_migration_blocks_skipped_total": 0,
            "kv_migration_bytes_total": 0,
            "kv_migration_failures_total": 0,  # attempts that failed or timed out (the request was re-prefilled)
            "kv_migration_timeouts_total": 0,  # of those, the ones that timed out
            "instance_restarts_total": 0,  # instances replaced after a death
            "requests_rerun_total": 0,  # requests re-run from prompt + tokens so far after their instance died
            "requests_failed_poison_total": 0,  # requests failed for a second death of the instance computing them
        }
        self.migration_durations: list[float] = []
        self._migration_started: dict[str, float] = {}

    # ---- deployment --------------------------------------------------------------------------
    async def start(self) -> None:
        """Create placement groups and instance actors, form the torch.distributed world, start loops."""
        from ray.util.placement_group import placement_group

        groups: list[tuple[str, tuple[PlacedInstance, ...]]] = [
            ("prefill", self.placement.prefill), ("decode", self.placement.decode), ("colocated", self.placement.colocated)
        ]
        next_rank = 0
        for phase, specs in groups:
            sched = self.prefill_scheduler_config if phase == "prefill" else self.scheduler_config
            for i, placed in enumerate(specs):
                world = placed.num_workers
                bundle = {"CPU": CPUS_PER_WORKER, **_node_resources(placed.node)}
                pg = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_PACK")
                spec = InstanceSpec(
                    instance_id=f"{phase}-{i}", phase=phase, model=self.model_name, dtype=self.dtype,
                    cache=self.cache_config, scheduler=sched, num_blocks=self.num_blocks,
                    max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids, tp=placed.tp, pp=placed.pp,
                    global_ranks=list(range(next_rank, next_rank + world)), num_threads=placed.threads or self.num_threads_per_worker,
                    kv_transfer_timeout_s=self.kv_transfer_timeout_s,
                )
                next_rank += world
                self.instances.append(_Instance(spec, None, pg))
        self._world_size = next_rank
        await asyncio.gather(*(asyncio.wrap_future(_ready_future(inst.placement_group)) for inst in self.instances))
        for inst in self.instances:
            inst.actor = _create_instance_actor(inst)
        init_method = self._init_method()
        await asyncio.gather(*(inst.actor.init.remote(init_method, next_rank) for inst in self.instances))
        layouts = await asyncio.gather(*(inst.actor.layout.remote() for inst in self.instances))
        for inst, layout in zip(self.instances, layouts):
            inst.layout = layout
            self._tasks.append(asyncio.create_task(self._loop(inst)))

    def _init_method(self) -> str:
        """A fresh rendezvous address for the world (global rank 0 hosts the store there)."""
        import ray

        placed = self.placement.prefill + self.placement.decode + self.placement.colocated
        host = "127.0.0.1" if all(p.node in (None, 0) for p in placed) else ray.util.get_node_ip_address()
        return f"tcp://{host}:{_free_port()}"

    async def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._closed = True
        self._running.set()
        for inst in self.instances:
            inst.wake.set()
        restarts = [t for t in self._background if t.get_name().startswith("restart-")]
        for task in self._tasks + restarts:
            task.cancel()
        await asyncio.gather(*self._tasks, *restarts, return_exceptions=True)
        for inst in self.instances:
            if inst.actor is not None:
                if inst.alive:
                    try:
                        await asyncio.wait_for(inst.actor.shutdown.remote(), timeout=10)
                    except Exception:  # noqa: BLE001 - best effort: the actor is killed below anyway
                        pass
                ray.kill(inst.actor, no_restart=True)
            remove_placement_group(inst.placement_group)  # also one whose actor never started
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
    def _submit(self, seq: Sequence) -> None:
        self._route_new(seq)

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

    def _route_new(self, seq: Sequence) -> None:
        reason = self._outage()
        if reason is not None:
            raise ServiceUnavailableError(reason)
        decode_up = any((i.alive or i.restarting) and i.phase == "decode" for i in self.instances)
        entry_phases = ("prefill", "colocated") if decode_up else ("colocated",)
        entry = [i for i in self.instances if i.alive and i.phase in entry_phases]
        if not entry:
            self._parked.append(seq)  # an entry instance is restarting: routed when it is up
            return
        pinned = self._pins.get(seq.seq_id, (None, None))[0]
        entry = [i for i in entry if i.spec.instance_id == pinned] or entry
        inst = pick_entry(entry, _route, prefix_block_hashes(seq.token_ids, self.cache_config.block_size))
        if seq.isolate:
            inst.solo_pending[seq.seq_id] = seq.arrival_time
        self._owner[seq.seq_id] = inst
        self._spawn(self._call_then_kick(inst, inst.actor.add.remote(seq.detached_copy())))

    def _spawn(self, coro: Any, name: str | None = None) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _call_then_kick(self, inst: _Instance, ref: Any) -> None:
        """Instance actors are threaded, so a call is only known to be applied once it returns:
        kick the step loop after that, or a step racing ahead would report no work and sleep."""
        try:
            await ref
        except Exception:  # noqa: BLE001 - a dead actor is handled by its step loop
            pass
        inst.kick()

    async def generate(
        self, prompt: str | Seq[int], sampling: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; closing the iterator early aborts the request."""
        if len(self._queues) >= self.max_queued_requests:
            raise QueueFullError(f"{len(self._queues)} requests in flight (max {self.max_queued_requests})")
        if request_id in self._queues or request_id in self._seqs:
            raise DistServeError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self.add_request(prompt, sampling, request_id=request_id, priority=priority)
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
        """Stop a request and free its KV everywhere; its stream, if open, ends with finish_reason "abort"."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        seq.finish_time = time.monotonic()
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(self._output(seq, seq.finish_time, self._finish))
        self._forget(request_id)
        self._drop(request_id, "abort")

    def _drop(self, request_id: str, reason: str) -> None:
        """Tell every instance holding this request's KV to free it."""
        self._pending.drop(lambda e: e[1] == request_id)
        self._parked = [s for s in self._parked if s.seq_id != request_id]
        for holder in (self._owner.pop(request_id, None), self._source.pop(request_id, None)):
            if holder is not None and holder.alive:
                holder.route.release()
                holder.actor.abort.remote(request_id, reason)
                holder.kick()

    def _finish(self, seq: Sequence, reason: str) -> None:
        """A stop string matched: the request is done here and on whichever instance runs it."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self._drop(seq.seq_id, reason)

    # ---- instance loops ----------------------------------------------------------------------
    async def _loop(self, inst: _Instance) -> None:
        import ray

        while not self._closed:
            if not inst.has_work:
                inst.wake.clear()
                await inst.wake.wait()
                continue
            if not self._running.is_set():
                await self._running.wait()  # the world is being formed anew
                continue
            inst.kicked = False
            self._steps_in_flight += 1
            try:
                result: StepResult = await inst.actor.step.remote()
            except (ray.exceptions.RayError, StepFailedError) as exc:  # the actor or a worker died, or the step failed
                self._steps_in_flight -= 1
                self._on_death(inst, exc)
                return
            self._steps_in_flight -= 1
            inst.has_work = result.has_work or inst.kicked
            self._apply(inst, result)
            if self._pending:
                await self._migrate_pending()
            if inst.has_work and not inst.kicked and _only_waited(result):
                # Nothing to compute, transfers in flight: poll gently rather than spin the actor.
                inst.wake.clear()
                try:
                    await asyncio.wait_for(inst.wake.wait(), IDLE_POLL_S)
                except asyncio.TimeoutError:
                    pass

    def _apply(self, inst: _Instance, result: StepResult) -> None:
        now = time.monotonic()
        self.migration_counters["kv_migration_bytes_total"] += result.received_bytes
        for seq_id in result.received:
            if self._owner.get(seq_id) is not inst:
                continue  # an attempt the runtime gave up on (its source died); that instance was told to abort
            source = self._source.pop(seq_id, None)
            if source is not None and source.alive:
                source.actor.release.remote(seq_id)  # acknowledged: the prefill KV may go
                source.route.release()
                source.kick()
            started = self._migration_started.pop(seq_id, None)
            if started is not None:
                self.migration_durations.append(now - started)
            seq = self._seqs.get(seq_id)
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
            seq.error = up.error
            if inst.solo_pending.pop(seq.seq_id, None) is not None and inst.phase != "prefill":
                seq.isolate = False  # as the instance's scheduler did (clears_isolation)
            if up.new_token_ids and seq.first_token_time is None:
                seq.first_token_time = now
                seq.num_cached_tokens = up.num_cached_tokens
            if up.finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = up.finish_reason
                seq.finish_time = now
                owner = self._owner.pop(seq.seq_id, None)
                if owner is not None:
                    owner.route.release()
            elif up.awaiting_migration:
                self._pending.push((inst, seq.seq_id))
            out = self._output(seq, now, self._finish)
            queue = self._queues.get(seq.seq_id)
            if queue is not None:
                queue.put_nowait(out)

    async def _migrate_pending(self) -> None:
        """Move waiting requests to decode instances with room, oldest first (pull-based)."""
        async def move(entry: tuple[_Instance, str]) -> bool:
            src, seq_id = entry
            seq = self._seqs.get(seq_id)
            if seq is None or seq.is_finished or not src.alive:
                return True  # finished, or its instance died: no longer waiting
            return await self._migrate(src, seq)

        async with self._migration_lock:
            await self._pending.drain_async(move)

    async def _migrate(self, src: _Instance, seq: Sequence) -> bool:
        decodes = [i for i in self.instances if i.alive and i.phase == "decode"]
        pinned = self._pins.get(seq.seq_id, (None, None))[1]
        decodes = [i for i in decodes if i.spec.instance_id == pinned] or decodes
        if not decodes:
            return False
        import ray

        for dst in decode_order(decodes, _route):
            try:
                reservation = await dst.actor.reserve.remote(seq.detached_copy())
            except ray.exceptions.RayError:
                dst.kick()  # died: its step loop finds out at its next step and handles that
                continue
            if reservation is not None:
                break
        else:
            return False
        if not (dst.alive and src.alive and self._owner.get(seq.seq_id) is src and not seq.is_finished):
            # An instance died (and its requests were re-run) or the request ended while we waited.
            if dst.alive:
                dst.actor.cancel_reservation.remote(seq.seq_id)
                dst.kick()
            return not (src.alive and self._owner.get(seq.seq_id) is src and not seq.is_finished)
        assert src.layout is not None and dst.layout is not None
        span = num_tags(src.layout, dst.layout)
        tag = 1 + (next(self._tags) * span) % (MAX_TAG - span - 1)
        self._migration_started[seq.seq_id] = time.monotonic()
        self._owner[seq.seq_id] = dst
        self._source[seq.seq_id] = src
        dst.route.num_assigned += 1
        first, end = reservation.num_reused_blocks, reservation.num_blocks_to_fill
        self.migration_counters["num_migrations"] += 1
        self.migration_counters["kv_migration_blocks_skipped_total"] += first
        try:
            await asyncio.gather(
                src.actor.start_send.remote(seq.seq_id, first, end, dst.layout, dst.spec.global_ranks, tag),
                dst.actor.start_recv.remote(seq.seq_id, reservation, src.layout, src.spec.global_ranks, tag),
            )
        except ray.exceptions.RayError as exc:
            # One side died: the attempt is handed over (``_on_death`` re-runs the request); or a
            # side refused, e.g. the request was requeued meanwhile: the other side gives up on its
            # deadline and the attempt fails like any other.
            log.warning("starting the migration of %s failed: %s", seq.seq_id, type(exc).__name__)
        dst.kick()
        src.kick()
        return True

    def _on_failed_transfer(self, seq_id: str, timed_out: bool) -> None:
        """The decode side gave up (and freed its reservation): re-prefill where the KV still is.

        The prefill instance keeps the request's first token, so the client sees no duplicate, and
        its prefix is cached, so the re-prefill is cheap; the request then migrates anew.
        """
        self.migration_counters["kv_migration_failures_total"] += 1
        self.migration_counters["kv_migration_timeouts_total"] += int(timed_out)
        src = self._source.pop(seq_id, None)
        dst = self._owner.pop(seq_id, None)
        if dst is not None:
            dst.route.release()
        self._migration_started.pop(seq_id, None)
        if src is not None and src.alive:
            self._owner[seq_id] = src
            self._spawn(self._call_then_kick(src, src.actor.requeue.remote(seq_id)))

    def _on_death(self, inst: _Instance, exc: BaseException | None = None) -> None:
        """Re-run the dead instance's requests from prompt + tokens so far on survivors; restart it.

        The death is blamed on the requests it was computing (``distserve.cluster.recovery``): one
        blamed a second time is poison and fails instead of being re-run, and the restarts its
        deaths caused are not charged to ``max_instance_restarts``.
        """
        inst.alive = False
        lost = [sid for sid, owner in self._owner.items() if owner is inst]
        lost += [sid for sid, src in self._source.items() if src is inst and sid not in lost]
        failure = getattr(exc, "cause", None) or exc  # a RayTaskError carries what the step raised
        blamed = suspects_of(failure, lost, inst.solo_pending)
        inst.solo_pending.clear()
        suspects = [seq for sid in blamed if (seq := self._seqs.get(sid)) is not None and not seq.is_finished]
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
                self.migration_counters["requests_failed_poison_total"] += 1
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
                self.migration_counters["requests_rerun_total"] += 1
                self._spawn(self._call_then_kick(holder, holder.actor.requeue.remote(seq_id)))
                continue
            for survivor in (owner, holder):
                if survivor is not None and survivor is not inst and survivor.alive:
                    survivor.actor.abort.remote(seq_id, "abort")  # e.g. a decode instance mid-receive
                    survivor.route.release()
                    survivor.kick()
            if seq is None or seq.is_finished:
                continue
            self.migration_counters["requests_rerun_total"] += 1
            self._reroute(seq)
        if inst.restarting:
            self._spawn(self._restart(inst), name=f"restart-{inst.spec.instance_id}")
        else:
            self._fail_stranded()

    def _fail_request(self, seq: Sequence, error: str) -> None:
        """End one request with ``error`` (finish_reason "error") and free its KV wherever it is."""
        out = self._fail(seq, error, time.monotonic())
        self._forget(seq.seq_id)
        self._drop(seq.seq_id, "abort")
        queue = self._queues.get(seq.seq_id)
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
            self._forget(seq_id)
            self._drop(seq_id, "abort")
            queue = self._queues.get(seq_id)
            if queue is not None:
                queue.put_nowait(ServiceUnavailableError(reason))

    def _reroute(self, seq: Sequence) -> None:
        try:
            self._route_new(seq)
        except (DistServeError, ServiceUnavailableError) as exc:
            queue = self._queues.get(seq.seq_id)
            if queue is not None:
                queue.put_nowait(exc)

    async def _restart(self, inst: _Instance) -> None:
        """Replace a dead instance in its placement group and form the world anew with it."""
        import ray

        async with self._world_lock, self._migration_lock:
            self._running.clear()
            try:
                while self._steps_in_flight and not self._closed:
                    await asyncio.sleep(0.005)  # let every step in flight return
                if self._closed:
                    return
                log.info("restart %s: steps paused", inst.spec.instance_id)
                try:
                    ray.kill(inst.actor, no_restart=True)  # what is left of it (its workers die with it)
                except Exception:  # noqa: BLE001 - already gone
                    pass
                inst.actor = _create_instance_actor(inst)
                survivors = [i for i in self.instances if i.alive]
                init_method = self._init_method()
                await asyncio.wait_for(
                    asyncio.gather(
                        inst.actor.init.remote(init_method, self._world_size),
                        *(i.actor.reinit.remote(init_method, self._world_size) for i in survivors),
                    ),
                    RESTART_TIMEOUT_S,
                )
                inst.layout = await inst.actor.layout.remote()
                for request_id, kind in self._step_faults.items():
                    await inst.actor.inject_step_fault.remote(request_id, kind)
                log.info("restart %s: the new world of %d ranks is formed", inst.spec.instance_id, self._world_size)
            except Exception as exc:  # noqa: BLE001 - the instance stays dead; survivors that broke fail their next step
                log.error("restarting instance %s failed: %r", inst.spec.instance_id, exc)
                inst.restarting = False
                self._fail_parked()
                self._fail_stranded()
                return
            finally:
                self._running.set()
            inst.restarts += 1
            self.migration_counters["instance_restarts_total"] += 1
            inst.route = RouteState()
            inst.has_work = inst.kicked = False
            inst.restarting = False
            inst.alive = True
            self._tasks.append(asyncio.create_task(self._loop(inst)))
            for i in self.instances:
                if i.alive:
                    i.kick()  # cancelled transfers are reported at their next step
        parked, self._parked = self._parked, []
        for seq in parked:
            self._reroute(seq)
        if self._pending:
            await self._migrate_pending()

    def _fail_parked(self) -> None:
        parked, self._parked = self._parked, []
        for seq in parked:
            self._reroute(seq)  # to a survivor, or the error goes to its stream

    async def inject_step_fault(self, request_id: str, kind: str = "raise") -> None:
        """Test hook: every step computing ``request_id`` fails on every instance, replacements
        included (``ModelRunner.inject_step_fault``): a poison request."""
        self._step_faults[request_id] = kind
        await asyncio.gather(*(i.actor.inject_step_fault.remote(request_id, kind) for i in self.instances if i.alive))

    # ---- observability -----------------------------------------------------------------------
    async def stats(self) -> dict[str, object]:
        alive = [i for i in self.instances if i.alive]
        per = await asyncio.gather(*(i.actor.stats.remote() for i in alive), return_exceptions=True)
        instances = [s for s in per if isinstance(s, dict)]
        durations, self.migration_durations = self.migration_durations, []
        return {
            "instances": instances,
            "kv_migration_seconds": durations,
            "num_requests_awaiting_migration": len(self._pending),
            **self.migration_counters,
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


def _route(inst: _Instance) -> RouteState:
    return inst.route


def _create_instance_actor(inst: _Instance) -> Any:
    """The instance's actor, in bundle 0 of its placement group; it creates its other ranks."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(inst.placement_group, placement_group_bundle_index=0)
    return (
        ray.remote(InstanceServer)
        .options(num_cpus=CPUS_PER_WORKER, max_concurrency=8, max_restarts=0, scheduling_strategy=strategy)
        .remote(inst.spec, RayWorkerFactory(inst.placement_group))
    )


def _only_waited(result: StepResult) -> bool:
    """The step computed nothing and no transfer finished: the instance is only waiting on KV."""
    return not (result.num_batched_tokens or result.updates or result.received or result.failed_transfers or result.received_bytes)


def _ready_future(pg: Any) -> Any:
    import concurrent.futures

    import ray

    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def wait() -> None:
        try:
            fut.set_result(ray.get(pg.ready(), timeout=120))
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller through the future
            fut.set_exception(
                InvalidConfigError(f"the cluster cannot host this placement (placement group not ready: {exc})")
            )

    import threading

    threading.Thread(target=wait, daemon=True).start()
    return fut
