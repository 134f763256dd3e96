"""An instance as the runtime sees it: a phase scheduler driving ``tp × pp`` workers, plus KV transfer.

Ray-free (the runtime wraps it in a threaded Ray actor). Rank 0 runs in this process; other
ranks are worker actors created by ``create_remote_worker``. ``step`` runs while ``reserve``,
``start_send`` and ``start_recv`` may arrive on other threads: scheduler state is guarded by a
lock held only around scheduling and bookkeeping, never around model execution.

Pipelining: up to ``pp`` plans (micro-batches) are in flight, so stage 0 computes the next plan
while later stages finish earlier ones. A ``step`` launches a plan if the pipeline has room and
the scheduler (``pipeline_depth=pp``: requests in flight are skipped) has work — the remote
ranks' calls first, then rank 0 (stage 0) computes its part here — and then, if the pipeline is
full or nothing was launched, waits for the oldest plan; it applies the plans of earlier steps
that are done, strictly in launch order. Every plan carries a sequence number and each worker
executes plans in that order (``Worker.execute``), so stages and TP ranks pair up; a worker
actor therefore needs more threads than ``pp``. With ``pp == 1`` a step launches, waits for and
applies one plan, as without pipelining.

Operations that free blocks (abort, release, requeue, cancel_reservation) wait until no plan in
flight computes their request (checked at each step boundary), so a plan never writes into a
block that was handed to someone else; on the decode side they also wait for the request's
receive to finish, so a transfer thread never writes into it either. Freeing the blocks of a
request outside every plan in flight is safe: those plans neither write nor read its blocks (a
shared prefix block is kept by its other holder's reference; a copy-on-write source is read by
the plan at its start, on every stage, before any later plan runs there), and the blocks can be
handed out only to a later plan, which every stage — each owning its own layers' KV — runs after
the earlier ones.

Transfer outcomes: the receiving (decode) side decides. A receive that fails or times out cancels
the reservation here and is reported in ``StepResult.failed_transfers``; a failed send is only
dropped, since its receiver fails too (by its own deadline) or got everything anyway.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distserve.config import CacheConfig, SchedulerConfig
from distserve.decode.scheduler import DecodeScheduler, Reservation
from distserve.engine.block_manager import BlockManager
from distserve.engine.parallel import ShardSpec
from distserve.engine.scheduler import SampledToken, Scheduler, StepPlan, attributed_to
from distserve.engine.sequence import Sequence
from distserve.kvtransfer.layout import KVLayout
from distserve.prefill.scheduler import PrefillScheduler
from distserve.serving.worker import TransferResult, Worker, WorkerSpec

SCHEDULERS: dict[str, type[Scheduler]] = {
    "prefill": PrefillScheduler,
    "decode": DecodeScheduler,
    "colocated": Scheduler,
}


@dataclass
class InstanceSpec:
    """What an instance is: phase, model, caches and parallelism; plain data for Ray."""

    instance_id: str
    phase: str  # prefill | decode | colocated
    model: str
    dtype: str
    cache: CacheConfig
    scheduler: SchedulerConfig
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tp: int
    pp: int
    global_ranks: list[int]  # instance-local rank -> global torch.distributed rank
    num_threads: int = 1
    kv_transfer_timeout_s: float = 30.0


@dataclass
class SeqUpdate:
    """What happened to one request in a step (tokens since its previous update)."""

    seq_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    awaiting_migration: bool = False
    error: str | None = None  # with finish_reason "error"


@dataclass
class StepResult:
    updates: list[SeqUpdate] = field(default_factory=list)
    received: list[str] = field(default_factory=list)  # decode: KV arrived, request now decoding
    failed_transfers: list[str] = field(default_factory=list)  # decode: KV did not arrive, reservation cancelled
    timed_out_transfers: list[str] = field(default_factory=list)  # those of failed_transfers that timed out
    received_bytes: int = 0  # KV payload that arrived on this instance's workers
    has_work: bool = False
    step_seconds: float = 0.0
    execute_seconds: float = 0.0  # of step_seconds: rank 0 executing the plan launched in this step
    num_batched_tokens: int = 0


@dataclass
class _PlanInFlight:
    """A launched plan whose tokens are not applied yet."""

    plan: StepPlan
    plan_seq: int  # launch order; every worker executes plans in this order
    seq_ids: frozenset[str]  # requests it computes: their blocks must not be freed
    refs: list[Any] = field(default_factory=list)  # ranks 1.. executing it (Ray object refs)
    sampled: list[SampledToken] = field(default_factory=list)  # rank 0's result


class InstanceServer:
    def __init__(self, spec: InstanceSpec, create_remote_worker: Callable[[WorkerSpec], Any] | None = None) -> None:
        if spec.phase not in SCHEDULERS:
            raise ValueError(f"unknown phase {spec.phase!r}")
        self.spec = spec
        self.block_manager = BlockManager(spec.num_blocks, spec.cache.block_size, spec.cache.enable_prefix_caching)
        self.scheduler = SCHEDULERS[spec.phase](
            spec.scheduler, self.block_manager, spec.max_model_len, spec.eos_token_ids, pipeline_depth=spec.pp
        )
        self.seqs: dict[str, Sequence] = {}
        self._reported: dict[str, int] = {}  # output tokens already reported per request
        self._lock = threading.Lock()
        self._deferred: list[tuple[str, Callable[[], None]]] = []  # (seq_id, op) waiting for its plans
        self._in_flight: deque[_PlanInFlight] = deque()  # oldest first; changed by ``step`` under the lock
        self._next_plan_seq = 0
        self.max_plans_in_flight = 0  # high-water mark, counting plans that compute tokens
        self.num_overlapped_launches = 0  # plans launched while another that computes tokens was in flight
        self._pending: dict[str, set[int]] = {}  # transfer key (``_transfer_key``) -> ranks still busy
        self._failed: set[str] = set()
        self._timed_out: set[str] = set()
        self._receiving: dict[str, str] = {}  # seq_id -> key of its receive in flight
        self._after_recv: dict[str, list[Callable[[], None]]] = {}  # block-freeing ops waiting for that receive
        self.last_step_s = 0.0
        self.num_steps = 0

        def worker_spec(rank: int) -> WorkerSpec:
            shard = ShardSpec(tp=spec.tp, pp=spec.pp, tp_rank=rank % spec.tp, pp_rank=rank // spec.tp)
            return WorkerSpec(
                spec.model, spec.dtype, spec.num_blocks, spec.cache.block_size, spec.eos_token_ids, shard,
                list(spec.global_ranks), spec.num_threads, spec.kv_transfer_timeout_s,
            )

        world = spec.tp * spec.pp
        if world > 1 and create_remote_worker is None:
            raise ValueError("an instance with tp * pp > 1 needs create_remote_worker")
        self.local = Worker(worker_spec(0))
        self.remote = [create_remote_worker(worker_spec(r)) for r in range(1, world)] if world > 1 else []

    # ---- set-up --------------------------------------------------------------------------------
    def init(self, init_method: str, world_size: int) -> str:
        """Every rank joins the world; returns the backend (gloo on CPU, nccl on GPU)."""
        refs = [w.init.remote(init_method, world_size) for w in self.remote]
        backend = self.local.init(init_method, world_size)
        _ray_get(refs)
        return backend

    def reinit(self, init_method: str, world_size: int, drain_timeout_s: float = 60.0) -> str:
        """Join a new world after another instance was restarted (``Worker.reinit`` on every rank).

        The controller has paused this instance's steps; plans still running on later pipeline
        stages are waited for (the next step applies them). Transfers in flight are cancelled (the
        decode side reports them failed at the next step and the controller prefills those
        requests again); once every rank has let go of them, the process groups are rebuilt.
        """
        with self._lock:
            computing = [ref for p in self._in_flight for ref in p.refs]
        if computing:  # plans still on the pipeline's later stages use the groups: let them finish
            import ray

            ray.wait(computing, num_returns=len(computing), timeout=drain_timeout_s)
        self._fan_out("cancel_all_transfers")
        deadline = time.monotonic() + drain_timeout_s
        while not (self.local.transfers_done() and all(_ray_get([w.transfers_done.remote() for w in self.remote]))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.instance_id}: KV transfers still running after {drain_timeout_s:.0f} s")
            time.sleep(0.01)
        refs = [w.reinit.remote(init_method, world_size) for w in self.remote]
        backend = self.local.reinit(init_method, world_size)
        _ray_get(refs)
        return backend

    def worker_pids(self) -> list[int]:
        """Process id of each rank (rank 0 runs in this actor's process)."""
        return [self.local.pid()] + _ray_get([w.pid.remote() for w in self.remote])

    def layout(self) -> KVLayout:
        assert self.local.layout is not None
        return self.local.layout

    def ranks(self) -> list[int]:
        return list(self.spec.global_ranks)

    # ---- requests ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """A new request, or one re-run here; after any op still queued for an earlier attempt of its id."""

        def run() -> None:
            self.seqs[seq.seq_id] = seq
            self._reported[seq.seq_id] = seq.num_output_tokens
            self.scheduler.add(seq)

        self._defer(seq.seq_id, run)

    def abort(self, seq_id: str, reason: str = "abort") -> None:
        """Finish a request here (abort, or a stop string the controller matched); frees its KV."""

        def run() -> None:
            seq = self.seqs.pop(seq_id, None)
            self._reported.pop(seq_id, None)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, reason)

        self._free_later(seq_id, run)

    def release(self, seq_id: str) -> None:
        """Prefill side: the decode side acknowledged the KV; free it at the next step boundary."""

        def run() -> None:
            assert isinstance(self.scheduler, PrefillScheduler)
            self.scheduler.release(seq_id)
            self.seqs.pop(seq_id, None)
            self._reported.pop(seq_id, None)

        self._defer(seq_id, run)

    def requeue(self, seq_id: str) -> None:
        """Prefill side: the transfer failed; stop sending and prefill the request again."""
        with self._lock:
            sends = [k for k in self._pending if k.startswith("send:") and k.split(":", 2)[2] == seq_id]
        for key in sends:
            self._fan_out("cancel_transfer", key)

        def run() -> None:
            assert isinstance(self.scheduler, PrefillScheduler)
            self.scheduler.requeue(seq_id)

        self._defer(seq_id, run)

    def reserve(self, seq: Sequence) -> Reservation | None:
        """Decode side: blocks for a migrating request (prompt + first token), or None if full.

        Also None while this instance still holds the request (an earlier attempt's receive or
        abort has not finished): its two reservations would collide.
        """
        with self._lock:
            assert isinstance(self.scheduler, DecodeScheduler)
            if seq.seq_id in self.seqs or seq.seq_id in self._receiving:
                return None
            reservation = self.scheduler.reserve(seq)
            if reservation is not None:
                self.seqs[seq.seq_id] = seq
                self._reported[seq.seq_id] = seq.num_output_tokens
            return reservation

    def start_send(
        self, seq_id: str, first: int, end: int, dst_layout: KVLayout, dst_ranks: list[int], tag_base: int
    ) -> None:
        """Prefill side: post the sends of blocks [first, end) of a request awaiting migration."""
        key = _transfer_key("send", tag_base, seq_id)
        with self._lock:
            assert isinstance(self.scheduler, PrefillScheduler)
            blocks = self.scheduler.awaiting_migration[seq_id].block_table[first:end]
            self._pending[key] = set(range(len(self.remote) + 1))
        self._fan_out("start_send", key, blocks, dst_layout, dst_ranks, tag_base, first)

    def start_recv(
        self, seq_id: str, reservation: Reservation, src_layout: KVLayout, src_ranks: list[int], tag_base: int
    ) -> None:
        """Decode side: post the receives into the reserved blocks."""
        first, end = reservation.num_reused_blocks, reservation.num_blocks_to_fill
        key = _transfer_key("recv", tag_base, seq_id)
        with self._lock:
            self._pending[key] = set(range(len(self.remote) + 1))
            self._receiving[seq_id] = key
        self._fan_out("start_recv", key, reservation.block_table[first:end], src_layout, src_ranks, tag_base, first)

    def cancel_reservation(self, seq_id: str) -> None:
        """Decode side: give a reservation's blocks back (after its receive, if one is in flight)."""

        def run() -> None:
            assert isinstance(self.scheduler, DecodeScheduler)
            self.scheduler.cancel(seq_id)
            self.seqs.pop(seq_id, None)
            self._reported.pop(seq_id, None)

        self._free_later(seq_id, run)

    def inject_step_fault(self, seq_id: str, kind: str = "raise") -> None:
        """Test hook: ``ModelRunner.inject_step_fault`` on rank 0 (``exit`` kills this actor's process)."""
        assert self.local.runner is not None, "init() first"
        self.local.runner.inject_step_fault(seq_id, kind)

    def inject_transfer_fault(self, kind: str, rank: int = 0) -> None:
        """Test hook: ``Worker.inject_transfer_fault`` on one of this instance's ranks."""
        if rank == 0:
            self.local.inject_transfer_fault(kind)
        else:
            _ray_get([self.remote[rank - 1].inject_transfer_fault.remote(kind)])

    def _free_later(self, seq_id: str, run: Callable[[], None]) -> None:
        """Run a block-freeing op after the request's receive in flight (if any), else like ``_defer``."""
        with self._lock:
            if seq_id in self._receiving:
                self._after_recv.setdefault(seq_id, []).append(run)
                return
        self._defer(seq_id, run)

    def _defer(self, seq_id: str, run: Callable[[], None]) -> None:
        """Run now if no plan in flight computes ``seq_id``, else once none does (a step boundary).

        Ops of one request run in call order: one arriving behind a queued op of its id queues too
        (e.g. the re-run of a request whose earlier attempt's abort is still waiting).
        """
        with self._lock:
            if self._computes(seq_id) or any(queued == seq_id for queued, _ in self._deferred):
                self._deferred.append((seq_id, run))
            else:
                run()

    def _computes(self, seq_id: str) -> bool:
        return any(seq_id in p.seq_ids for p in self._in_flight)

    def _run_deferred(self) -> None:
        """Under the lock: the deferred ops whose request no plan in flight computes any more, in order."""
        if not self._deferred:
            return
        waiting: list[tuple[str, Callable[[], None]]] = []
        for seq_id, run in self._deferred:
            if self._computes(seq_id):
                waiting.append((seq_id, run))
            else:
                run()
        self._deferred = waiting

    def _fan_out(self, method: str, *args: Any) -> None:
        refs = [getattr(w, method).remote(*args) for w in self.remote]
        getattr(self.local, method)(*args)
        _ray_get(refs)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Launch a plan if the pipeline has room; then, oldest first, apply the earlier plans that
        are done, waiting for the oldest if the pipeline is full or nothing was launched."""
        t0 = time.perf_counter()
        result = StepResult()
        launched: _PlanInFlight | None = None
        with self._lock:
            self._run_deferred()
            self._collect_transfers(result)
            if len(self._in_flight) < self.spec.pp:
                plan = self.scheduler.schedule()
                if not plan.is_empty or plan.finished_seq_ids:  # finished ids: workers drop their state
                    launched = self._launch(plan)
        if launched is not None:
            # Outside the lock, so that reserve/abort/... are not held up by the model. Rank 0 is
            # stage 0 (and the sampler when tp == pp == 1); its send to stage 1 returns once stage 1
            # has finished the plans before this one.
            launched.refs = [w.execute.remote(launched.plan, launched.plan_seq) for w in self.remote]
            t_exec = time.perf_counter()
            with attributed_to(launched.plan):
                launched.sampled = self.local.execute(launched.plan, launched.plan_seq)
            result.execute_seconds = time.perf_counter() - t_exec
            result.num_batched_tokens = launched.plan.num_batched_tokens
        must_wait = launched is None or len(self._in_flight) >= self.spec.pp
        while self._in_flight:
            oldest = self._in_flight[0]
            # The plan launched just now waits for the next step unless it is the one to wait for
            # (pp == 1): applied together with the previous one, the two micro-batches would merge
            # into one plan at the next ``schedule`` and the pipeline would stop overlapping.
            if not must_wait and (oldest is launched or not self._is_done(oldest)):
                break
            self._apply_oldest(result)
            must_wait = False
        with self._lock:
            s = self.scheduler
            if launched is not None:
                s.observe_step(launched.plan, result.execute_seconds)
            result.has_work = bool(s.has_work() or self._pending or self._deferred or self._in_flight)
        self.last_step_s = result.step_seconds = time.perf_counter() - t0
        self.num_steps += 1
        return result

    def _launch(self, plan: StepPlan) -> _PlanInFlight:
        """Under the lock: number ``plan`` and queue it in the pipeline (``step`` then hands it to the ranks)."""
        computing = sum(1 for p in self._in_flight if not p.plan.is_empty)
        if not plan.is_empty:
            if computing:
                self.num_overlapped_launches += 1
            self.max_plans_in_flight = max(self.max_plans_in_flight, computing + 1)
        plan_seq = self._next_plan_seq
        self._next_plan_seq += 1
        launched = _PlanInFlight(plan, plan_seq, frozenset(c.seq_id for c in plan.chunks))
        self._in_flight.append(launched)
        return launched

    def _is_done(self, p: _PlanInFlight) -> bool:
        if not p.refs:
            return True
        import ray

        _, not_ready = ray.wait(p.refs, num_returns=len(p.refs), timeout=0)
        return not not_ready

    def _apply_oldest(self, result: StepResult) -> None:
        """Wait for the oldest plan in flight on every rank, then apply its sampled tokens."""
        p = self._in_flight[0]
        sampled = p.sampled
        with attributed_to(p.plan):  # a rank that raised or died fails the plan it was computing
            for other in _ray_get(p.refs):
                sampled = sampled or other
        with self._lock, attributed_to(p.plan):
            self._in_flight.popleft()
            self._run_deferred()  # first: an aborted request gets no token from its last plan
            updated = self.scheduler.update_from_output(p.plan, sampled, self.seqs, time.monotonic())
            for seq in updated:
                result.updates.append(self._update(seq))

    def _collect_transfers(self, result: StepResult) -> None:
        if not self._pending:
            return
        done: list[TransferResult] = list(self.local.poll())
        done_ranks: list[tuple[int, TransferResult]] = [(0, d) for d in done]
        if self.remote:
            for rank, polled in enumerate(_ray_get([w.poll.remote() for w in self.remote]), start=1):
                done_ranks.extend((rank, d) for d in polled)
        for rank, d in done_ranks:
            busy = self._pending.get(d.key)
            if busy is None:
                continue
            if d.ok and d.stats is not None and d.key.startswith("recv:"):
                result.received_bytes += d.stats.num_bytes
            busy.discard(rank)
            if not d.ok:
                self._failed.add(d.key)
            if d.timed_out:
                self._timed_out.add(d.key)
            if busy:
                continue
            del self._pending[d.key]
            kind, _, seq_id = d.key.split(":", 2)
            failed, timed_out = d.key in self._failed, d.key in self._timed_out
            self._failed.discard(d.key)
            self._timed_out.discard(d.key)
            if kind != "recv":
                continue
            assert isinstance(self.scheduler, DecodeScheduler)
            if self._receiving.get(seq_id) == d.key:
                del self._receiving[seq_id]
            for run in self._after_recv.pop(seq_id, []):
                run()  # an abort that arrived mid-transfer
            if failed:
                self.scheduler.cancel(seq_id)
                self.seqs.pop(seq_id, None)
                self._reported.pop(seq_id, None)
                result.failed_transfers.append(seq_id)
                if timed_out:
                    result.timed_out_transfers.append(seq_id)
            elif self.scheduler.complete(seq_id) is not None:
                result.received.append(seq_id)

    def _update(self, seq: Sequence) -> SeqUpdate:
        seen = self._reported.get(seq.seq_id, 0)
        n = seq.num_output_tokens
        new = seq.output_token_ids[seen:]
        self._reported[seq.seq_id] = n
        awaiting = isinstance(self.scheduler, PrefillScheduler) and seq.seq_id in self.scheduler.awaiting_migration
        if seq.is_finished:
            self.seqs.pop(seq.seq_id, None)
            self._reported.pop(seq.seq_id, None)
        return SeqUpdate(
            seq.seq_id, new, seq.logprobs[seen:] if seq.logprobs else [], seq.is_finished,
            seq.finish_reason, seq.num_cached_tokens, awaiting, seq.error,
        )

    def load(self) -> int:
        with self._lock:
            s = self.scheduler
            return sum(q.num_uncomputed_tokens for q in s.waiting + s.running)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self.scheduler
            out: dict[str, Any] = {
                "instance": self.spec.instance_id,
                "phase": self.spec.phase,
                "num_requests_waiting": s.num_waiting,
                "num_requests_running": s.num_running,
                "kv_cache_usage_perc": self.block_manager.usage,
                "num_free_blocks": self.block_manager.num_free_blocks,
                "step_seconds": self.last_step_s,
                "num_steps": self.num_steps,
                "tp": self.spec.tp,
                "pp": self.spec.pp,
            }
            if isinstance(s, PrefillScheduler):
                out["num_requests_awaiting_migration"] = s.num_awaiting_migration
            if isinstance(s, DecodeScheduler):
                out["num_requests_migrating"] = len(s.migrating)
            out["num_kv_transfers_in_flight"] = len(self._pending)
            out["num_plans_in_flight"] = len(self._in_flight)
            out["max_plans_in_flight"] = self.max_plans_in_flight
            out["num_overlapped_launches"] = self.num_overlapped_launches
            return out

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def worker_node_ids(self) -> list[str]:
        return [self.node_id()] + _ray_get([w.node_id.remote() for w in self.remote])

    def shutdown(self) -> None:
        _ray_get([w.shutdown.remote() for w in self.remote])
        self.local.shutdown()


def _transfer_key(kind: str, tag_base: int, seq_id: str) -> str:
    """``send``/``recv`` + the attempt's tag base + request id: unique per migration attempt."""
    return f"{kind}:{tag_base}:{seq_id}"


def _ray_get(refs: list[Any]) -> list[Any]:
    if not refs:
        return []
    import ray

    return list(ray.get(refs))
