"""An instance as the runtime sees it: an ``InstanceCore`` driving ``tp × pp`` workers, plus KV transfer.

The core (``distserve.engine.instance_core``, the same class the in-process engines and the
simulator drive) owns the scheduler, blocks, sequences, plans in flight, deferred frees and token
deltas; this class adds the workers and the transfers. Ray-free (the runtime wraps it in a
threaded Ray actor). Rank 0 runs in this process; other ranks are worker actors created by
``create_remote_worker``. ``step`` runs while ``reserve``, ``start_send`` and ``start_recv`` may
arrive on other threads: the core is guarded by a lock held only around scheduling and
bookkeeping, never around model execution.

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distserve.cluster.backpressure import held_prompt_tokens, held_requests
from distserve.decode.scheduler import Reservation
from distserve.engine.instance_core import SCHEDULERS, InstanceCore, PlanInFlight
from distserve.engine.shard import ShardSpec
from distserve.engine.preemptible import PreemptibleSteps
from distserve.engine.step_plan import attributed_to
from distserve.engine.structured_output import shared_compiler
from distserve.engine.weights import load_model
from distserve.engine.sequence import Sequence
from distserve.kvtransfer.layout import KVLayout
from distserve.runtime.instance_protocol import InstanceServerSpec, StepResult

if TYPE_CHECKING:  # (torch: loaded in this instance's own process only, when its workers are made)
    from distserve.runtime.worker import TransferResult, Worker, WorkerSpec

LATE_ADD_S = 1.0  # a ``late-add`` test fault's delay of ``add``


class InstanceServer:
    def __repr__(self) -> str:
        """Ray names the actor's process by it in its logs (``:actor_name:``): e.g. ``InstanceServer(prefill-0)``."""
        return f"InstanceServer({self.spec.instance_id})"

    def __init__(self, spec: InstanceServerSpec, create_remote_worker: Callable[[WorkerSpec], Any] | None = None) -> None:
        from distserve.runtime.worker import Worker, WorkerSpec  # (this module is imported by the controller: no torch there)

        if spec.phase not in SCHEDULERS:
            raise ValueError(f"unknown phase {spec.phase!r}")
        self.spec = spec
        # Structured output: this process compiles the grammars itself (requests carry the spec, not a matcher).
        tokenizer = load_model(spec.model, spec.dtype, weights=False).tokenizer
        self.core = InstanceCore(
            spec.phase, spec.scheduler, spec.num_blocks, spec.cache.block_size, spec.max_model_len, spec.eos_token_ids,
            enable_prefix_caching=spec.cache.enable_prefix_caching, pipeline_depth=spec.pp,
            grammar_compiler=shared_compiler(spec.scheduler.structured_output_backend, tokenizer, spec.eos_token_ids),
        )
        self._lock = threading.Lock()  # guards the core: requests arrive on other threads than ``step``
        self._late_adds: set[str] = set()  # test hook (``inject_step_fault(..., "late-add")``)
        self._pending: dict[str, set[int]] = {}  # transfer key (``_transfer_key``) -> ranks still busy
        self._failed: set[str] = set()
        self._timed_out: set[str] = set()
        self._receiving: dict[str, str] = {}  # seq_id -> key of its receive in flight
        # Crash suspects whose KV arrived in the last step: reported received then, decoding from the next step on
        # (``_collect_transfers``), so that the controller knows of a suspect before its step alone.
        self._arrived_suspects: list[str] = []
        self._after_recv: dict[str, list[Callable[[], None]]] = {}  # block-freeing ops waiting for that receive
        self._num_added = 0  # ``add`` calls applied (``StepResult.num_added``)

        def worker_spec(rank: int) -> WorkerSpec:
            shard = ShardSpec(tp=spec.tp, pp=spec.pp, tp_rank=rank % spec.tp, pp_rank=rank // spec.tp)
            return WorkerSpec(
                spec.model, spec.dtype, spec.num_blocks, spec.cache.block_size, spec.eos_token_ids, shard,
                list(spec.global_ranks), spec.num_threads, spec.kv_transfer_timeout_s, spec.cache.decode_attention,
                spec.instance_id,
            )

        world = spec.tp * spec.pp
        if world > 1 and create_remote_worker is None:
            raise ValueError("an instance with tp * pp > 1 needs create_remote_worker")
        self.local = Worker(worker_spec(0))
        self.remote = [create_remote_worker(worker_spec(r)) for r in range(1, world)] if world > 1 else []
        # One worker's prefill plans run a layer at a time; ``add`` of a request that ranks below the
        # running plan sets ``_yield`` and the plan stops at the next layer (``engine.preemptible``).
        self._yield = threading.Event()
        self.preemptible: PreemptibleSteps | None = None
        if spec.phase == "prefill" and spec.scheduler.layer_preemption and world == 1:
            self.preemptible = PreemptibleSteps(self.core, self.local.begin, self.local.run_layers, time.monotonic, self._lock)

    # ---- set-up --------------------------------------------------------------------------------
    def open_rendezvous(self, world_size: int, loopback: bool) -> str:
        """This instance holds global rank 0 (its first rank, in this process): the address of a fresh
        rendezvous for the world about to form (``Worker.open_rendezvous``)."""
        return self.local.open_rendezvous(world_size, loopback)

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
            computing = [ref for p in self.core.in_flight for ref in p.refs]
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
        if seq.seq_id in self._late_adds:
            time.sleep(LATE_ADD_S)  # as a call that lost the race to a step on another thread would
        with self._lock:
            self.core.add(seq)
            self._num_added += 1
            running = self.preemptible.running_rank if self.preemptible is not None else None
            if running is not None and seq.admission_rank < running:
                self._yield.set()

    def abort(self, seq_id: str, reason: str = "abort") -> None:
        """Finish a request here (abort, or a stop string the controller matched); frees its KV."""
        self._free_later(seq_id, lambda: self.core.abort(seq_id, reason))

    def release(self, seq_id: str) -> None:
        """Prefill side: the decode side acknowledged the KV; free it at the next step boundary."""
        with self._lock:
            self.core.release(seq_id)

    def requeue(self, seq_id: str) -> None:
        """Prefill side: the transfer failed; stop sending and prefill the request again."""
        with self._lock:
            sends = [k for k in self._pending if k.startswith("send:") and k.split(":", 2)[2] == seq_id]
        for key in sends:
            self._fan_out("cancel_transfer", key)
        with self._lock:
            self.core.requeue(seq_id)

    def reserve(self, seq: Sequence) -> Reservation | None:
        """Decode side: blocks for a migrating request (prompt + first token), or None if full.

        Also None while this instance still holds the request (an earlier attempt's receive or
        abort has not finished): its two reservations would collide.
        """
        with self._lock:
            if seq.seq_id in self._receiving:
                return None
            return self.core.reserve(seq)

    def start_send(
        self, seq_id: str, first: int, end: int, dst_layout: KVLayout, dst_ranks: list[int], tag_base: int
    ) -> None:
        """Prefill side: post the sends of blocks [first, end) of a request awaiting migration."""
        key = _transfer_key("send", tag_base, seq_id)
        with self._lock:
            blocks = self.core.kv_source(seq_id)[first:end]
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
        self._free_later(seq_id, lambda: self.core.cancel(seq_id))

    def inject_step_fault(self, seq_id: str, kind: str = "raise") -> None:
        """Test hook: ``ModelRunner.inject_step_fault`` on rank 0 (``exit`` kills this actor's process);
        or ``late-add``: this instance's ``add`` of ``seq_id`` takes ``LATE_ADD_S`` before it applies."""
        if kind == "late-add":
            self._late_adds.add(seq_id)
            return
        assert self.local.runner is not None, "init() first"
        self.local.runner.inject_step_fault(seq_id, kind)

    def inject_transfer_fault(self, kind: str, rank: int = 0) -> None:
        """Test hook: ``Worker.inject_transfer_fault`` on one of this instance's ranks."""
        if rank == 0:
            self.local.inject_transfer_fault(kind)
        else:
            _ray_get([self.remote[rank - 1].inject_transfer_fault.remote(kind)])

    def _free_later(self, seq_id: str, run: Callable[[], None]) -> None:
        """Run a block-freeing core op after the request's receive in flight (if any), else at once
        (the core itself defers it while a plan in flight computes the request)."""
        with self._lock:
            if seq_id in self._receiving:
                self._after_recv.setdefault(seq_id, []).append(run)
                return
            run()

    def _fan_out(self, method: str, *args: Any) -> None:
        refs = [getattr(w, method).remote(*args) for w in self.remote]
        getattr(self.local, method)(*args)
        _ray_get(refs)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Launch a plan if the pipeline has room; then, oldest first, apply the earlier plans that
        are done, waiting for the oldest if the pipeline is full or nothing was launched."""
        if self.preemptible is not None:
            return self._step_preemptible()
        t0 = time.perf_counter()
        result = StepResult()
        core = self.core
        with self._lock:
            core.run_deferred()
            self._collect_transfers(result)
            launched = core.launch()
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
        must_wait = launched is None or len(core.in_flight) >= self.spec.pp
        while core.in_flight:
            oldest = core.in_flight[0]
            # The plan launched just now waits for the next step unless it is the one to wait for
            # (pp == 1): applied together with the previous one, the two micro-batches would merge
            # into one plan at the next ``schedule`` and the pipeline would stop overlapping.
            if not must_wait and (oldest is launched or not self._is_done(oldest)):
                break
            self._apply_oldest(result)
            must_wait = False
        with self._lock:
            if launched is not None:
                core.observe(launched.plan, result.execute_seconds)
            self._report(result)
        end = time.perf_counter()
        core.step_ended(end - t0, end)
        result.step_seconds, result.token_interval_s = core.last_step_s, core.token_interval_s
        return result

    def _step_preemptible(self) -> StepResult:
        """``step`` for one worker's prefill: (part of) one plan, which may stop between layers for
        a request of a lower rank (``add`` sets ``_yield``; the next step runs that request first)."""
        t0 = time.perf_counter()
        result = StepResult()
        core = self.core
        assert self.preemptible is not None
        with self._lock:
            core.run_deferred()
            self._collect_transfers(result)
            self._yield.clear()  # what arrived before now is in the scheduler's queue already
        updated = self.preemptible.step(self._yield.is_set)
        result.execute_seconds = time.perf_counter() - t0
        result.num_batched_tokens = self.preemptible.last_num_batched_tokens
        with self._lock:
            result.updates.extend(core.delta(seq) for seq in updated)
            self._report(result)
        result.step_seconds = time.perf_counter() - t0
        result.token_interval_s = core.token_interval_s  # (``settle`` ended the step when its plan was applied)
        return result

    def _report(self, result: StepResult) -> None:
        """The scheduler's state after a step (the caller holds the lock)."""
        core = self.core
        # An arrived suspect joins the scheduler at the next step, which must come even if nothing else is left.
        result.has_work = bool(core.has_work() or self._pending or self._arrived_suspects)
        result.num_waiting, result.num_running = core.scheduler.num_waiting, core.scheduler.num_running
        result.num_added = self._num_added
        result.pending_prompt_tokens = core.scheduler.pending_prompt_tokens()
        result.num_free_blocks = core.num_free_blocks
        if core.scheduler.phase == "prefill":
            result.held_prompt_tokens, result.num_held = held_prompt_tokens(core.scheduler), held_requests(core.scheduler)

    def _is_done(self, p: PlanInFlight) -> bool:
        if not p.refs:
            return True
        import ray

        _, not_ready = ray.wait(p.refs, num_returns=len(p.refs), timeout=0)
        return not not_ready

    def _apply_oldest(self, result: StepResult) -> None:
        """Wait for the oldest plan in flight on every rank, then apply its sampled tokens."""
        p = self.core.in_flight[0]
        sampled = p.sampled
        with attributed_to(p.plan):  # a rank that raised or died fails the plan it was computing
            for other in _ray_get(p.refs):
                sampled = sampled or other
        with self._lock, attributed_to(p.plan):
            for seq in self.core.apply_oldest(sampled, time.monotonic()):
                result.updates.append(self.core.delta(seq))

    def _collect_transfers(self, result: StepResult) -> None:
        for seq_id in self._arrived_suspects:
            self.core.complete(seq_id)  # None if aborted since (its reservation is freed then)
        self._arrived_suspects.clear()
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
            if self._receiving.get(seq_id) == d.key:
                del self._receiving[seq_id]
            for run in self._after_recv.pop(seq_id, []):
                run()  # an abort that arrived mid-transfer
            if failed:
                self.core.cancel(seq_id)
                result.failed_transfers.append(seq_id)
                if timed_out:
                    result.timed_out_transfers.append(seq_id)
            elif (seq := self.core.seqs.get(seq_id)) is not None and seq.isolate:
                # A crash suspect runs its first decode step alone. Not in this step: a death of that step is blamed
                # on the suspect only if the controller knows it arrived (``suspects_of``), which it learns from this
                # step's result; else it would blame every request this instance holds.
                self._arrived_suspects.append(seq_id)
                result.received.append(seq_id)
            elif self.core.complete(seq_id) is not None:
                result.received.append(seq_id)

    def load(self) -> int:
        with self._lock:
            return self.core.load()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            core = self.core
            return {
                "instance": self.spec.instance_id,
                "phase": self.spec.phase,
                **core.stats(),
                "tp": self.spec.tp,
                "pp": self.spec.pp,
                "num_kv_transfers_in_flight": len(self._pending),
                "num_plans_in_flight": len(core.in_flight),
                "max_plans_in_flight": core.max_plans_in_flight,
                "num_overlapped_launches": core.num_overlapped_launches,
                **(self.preemptible.stats() if self.preemptible is not None else {}),
            }

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
