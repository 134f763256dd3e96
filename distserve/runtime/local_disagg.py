"""Disaggregated serving inside one process: xPyD instances, routing and pull-based KV migration.

The Ray runtime runs the same instances as actors; this executor keeps them in-process, which
makes it the reference for correctness tests and the fastest way to try a placement on one core.
New requests wait in the cluster core's admission queue (``distserve.cluster.admission``: fair
queueing across tenants by default, bounds, token rates, deadlines); each ``step`` first drops the
requests past their deadline, dispatches what the prefill instances accept under backpressure (to
the one ``pick_entry`` chooses among them), then runs a prefill step on every prefill instance with
work, migrates every request whose KV a decode instance has room for, then runs a decode step on
every busy decode instance. Decode instances of a class pool (``Placement`` given) run with their
own batch cap and take their objective's requests first (``cluster.routing.decode_order``).
A failed migration (only ever injected here: the copy is synchronous and cannot time out) takes
the Ray runtime's path: the decode side cancels its reservation and the request is prefilled again.

Each instance executes its plans on a ``StepRunner``: the torch ``ModelRunner`` by default, or
whatever ``runner_factory`` builds (a fake runner makes this engine a CPU-cheap reference for the
scheduling and migration policies, as ``tests/cluster/test_equivalence.py`` uses it). ``on_plan``
and ``on_migration`` observe every launched plan and every completed migration.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from distserve.cluster.admission import AdmissionConfig, AdmissionItem, AdmissionQueue, EntryLoad, entry_load, expired_error, measured_tpot_s
from distserve.cluster.backpressure import decode_headroom, decode_room_tokens, held_prompt_tokens, held_requests
from distserve.cluster.counters import ClusterCounters
from distserve.cluster.migration_queue import MigrationQueue
from distserve.cluster.routing import DEFAULT_ROUTER, RouteState, check_router, decode_lane, decode_order, entry_hashes, pick_entry
from distserve.config import CacheConfig, SchedulerConfig
from distserve.engine.instance_core import InstanceCore
from distserve.dtypes import resolve_dtype
from distserve.engine.model_runner import LayerPass, ModelRunner
from distserve.engine.preemptible import PreemptibleSteps
from distserve.engine.frontend import EngineBase
from distserve.engine.outputs import RequestOutput
from distserve.engine.request_metrics import stamp_prefill_starts
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import DistServeError, InvalidConfigError
from distserve.kvtransfer.migration import pack_blocks, unpack_blocks
from distserve.placement import InstanceSpec, Placement
from distserve.runtime.stats import prefill_totals


class StepRunner(Protocol):
    """What an in-process instance needs of the executor of its plans (``ModelRunner`` is the real one)."""

    kv_cache: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]; migration copies its blocks

    def execute(self, plan: StepPlan) -> list[SampledToken]: ...


# (model, num_blocks, cache config, eos_token_ids) -> the runner of one instance
RunnerFactory = Callable[[LoadedModel, int, CacheConfig, tuple[int, ...]], StepRunner]
PlanListener = Callable[[str, StepPlan], None]  # (instance id, plan), as each plan is launched
MigrationListener = Callable[[str, str, str], None]  # (request id, source id, destination id), once the KV arrived
OutputListener = Callable[[list[RequestOutput]], None]  # outputs ready before the step ends


def model_runner(loaded: LoadedModel, num_blocks: int, cache: CacheConfig, eos_token_ids: tuple[int, ...]) -> StepRunner:
    """The default ``RunnerFactory``: a torch ``ModelRunner`` over the loaded weights."""
    return ModelRunner(loaded.config, loaded.state_dict, num_blocks, cache.block_size, eos_token_ids,
                       decode_attention=cache.decode_attention)


@dataclass
class LocalInstance:
    """An instance in this process (tp = pp = 1): its core and the runner that executes its plans.

    On a ``ModelRunner`` with ``SchedulerConfig.layer_preemption`` (``engine.preemptible``), plans
    run a layer at a time: a prefill instance's plan of a backlogged rank yields whenever
    ``should_yield`` says a command waits, and a waiting prompt of a lower rank runs first; a decode
    instance's plan yields whatever its rank (the prefill instances, on this same thread, then take
    the new request) and resumes at its next step.
    """

    instance_id: str
    core: InstanceCore
    runner: StepRunner
    route: RouteState = field(default_factory=RouteState)  # what routing knows (``cluster.routing``)
    should_yield: Callable[[], bool] | None = None
    clock: Callable[[], float] = time.monotonic
    preemptible: PreemptibleSteps | None = field(init=False, default=None)
    _on_plan: PlanListener | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        runner = self.runner
        if self.core.phase in ("prefill", "decode") and self.core.config.layer_preemption and isinstance(runner, ModelRunner):
            self.preemptible = PreemptibleSteps(self.core, self._begin, runner.run, self.clock,
                                                within_instance=self.core.phase == "prefill")

    def _begin(self, plan: StepPlan) -> LayerPass:
        if self._on_plan is not None:
            self._on_plan(self.instance_id, plan)
        assert isinstance(self.runner, ModelRunner)
        return self.runner.begin(plan)

    def step(self, on_plan: PlanListener | None = None) -> list[Sequence]:
        if self.preemptible is not None:
            self._on_plan = on_plan
            return self.preemptible.step(self.should_yield)
        if on_plan is None:
            return self.core.step(self.runner.execute, self.clock)

        def execute(plan: StepPlan) -> list[SampledToken]:
            on_plan(self.instance_id, plan)
            return self.runner.execute(plan)

        return self.core.step(execute, self.clock)

    @property
    def suspended(self) -> bool:
        """A plan stopped between layers and waits to resume."""
        return self.preemptible is not None and self.preemptible.suspended

    def stats(self) -> dict[str, float]:
        out = self.core.stats()
        if self.preemptible is not None:
            out.update(self.preemptible.stats())
        return out


def _route(inst: LocalInstance) -> RouteState:
    return inst.route


def _decode_specs(placement: Placement | None, num_decode: int) -> tuple[InstanceSpec, ...]:
    """The decode instances to build: the placement's (in-process: tp = pp = 1), else ``num_decode`` plain ones."""
    if placement is None:
        return tuple(InstanceSpec() for _ in range(max(0, num_decode)))
    if not placement.is_disaggregated:
        raise InvalidConfigError("LocalDisaggEngine needs a disaggregated placement (prefill and decode instances)", "placement")
    if any(s.tp * s.pp != 1 for s in placement.prefill + placement.decode):
        raise InvalidConfigError("in-process instances have no TP/PP: the placement asks for tp or pp > 1", "placement")
    return placement.decode


class LocalDisaggEngine(EngineBase):
    """``num_prefill`` prefill and ``num_decode`` decode instances of one model, all in this process."""

    def __init__(
        self,
        model: str | LoadedModel = "tiny",
        *,
        num_prefill: int = 1,
        num_decode: int = 1,
        dtype: str = "auto",
        cache_config: CacheConfig | None = None,
        prefill_scheduler_config: SchedulerConfig | None = None,
        decode_scheduler_config: SchedulerConfig | None = None,
        kv_transfer_timeout_s: float = 30.0,
        runner_factory: RunnerFactory = model_runner,
        router: str = DEFAULT_ROUTER,
        admission: AdmissionConfig = AdmissionConfig(),
        placement: Placement | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``admission`` configures the admission queue in front of the prefill instances (the
        product's default: fair queueing, TNG's backpressure); the rest the instances.
        ``placement`` (tp = pp = 1 everywhere), if given, replaces ``num_prefill``/``num_decode``:
        its decode instances keep their class pools and batch caps (``InstanceSpec.pool``/``max_num_seqs``).
        ``clock``: every time this engine stamps or decides by (a test may drive it step by step)."""
        if not (kv_transfer_timeout_s > 0 and math.isfinite(kv_transfer_timeout_s)):
            raise InvalidConfigError(f"kv_transfer_timeout_s must be a positive number of seconds, got {kv_transfer_timeout_s}")
        self.router = check_router(router)
        self.clock = clock
        decode_specs = _decode_specs(placement, num_decode)
        num_prefill = num_prefill if placement is None else len(placement.prefill)
        num_decode = len(decode_specs)
        if num_prefill < 1 or num_decode < 1:
            raise InvalidConfigError(f"need at least one prefill and one decode instance, got {num_prefill}P{num_decode}D")
        loaded = load_model(model, resolve_dtype(dtype)) if isinstance(model, str) else model
        super().__init__(loaded, cache_config, decode_scheduler_config)
        prefill_cfg = prefill_scheduler_config or self.scheduler_config
        cc = self.cache_config

        def instance(phase: str, i: int, config: SchedulerConfig, spec: InstanceSpec = InstanceSpec()) -> LocalInstance:
            core = InstanceCore(phase, spec.scheduler_config(config), self.num_blocks, cc.block_size, self.max_model_len,
                                self.eos_token_ids, enable_prefix_caching=cc.enable_prefix_caching,
                                grammar_compiler=self.grammar_compiler)
            return LocalInstance(f"{phase}-{i}", core, runner_factory(loaded, self.num_blocks, cc, self.eos_token_ids),
                                 RouteState(pool=spec.pool), clock=clock)

        self.prefill = [instance("prefill", i, prefill_cfg) for i in range(num_prefill)]
        self.decode = [instance("decode", i, self.scheduler_config, spec) for i, spec in enumerate(decode_specs)]
        pools = {spec.pool for spec in decode_specs}
        # Class pools: each pool's requests queue for migration in a lane of their own (``decode_lane``).
        self._lane: Callable[[tuple[LocalInstance, Sequence]], object] | None = (
            (lambda entry: decode_lane(entry[1].request_class, pools)) if pools != {None} else None
        )
        self.counters = ClusterCounters()
        self.kv_transfer_timeout_s = kv_transfer_timeout_s  # for parity with the Controller: copies here are synchronous
        self._fault: str | None = None
        self._pending: MigrationQueue[tuple[LocalInstance, Sequence]] = MigrationQueue()  # prompts done, KV not yet pulled
        self._owner: dict[str, LocalInstance] = {}
        self.admission: AdmissionQueue[LocalInstance] = admission.queue()
        self._dispatched: set[str] = set()  # requests that left the admission queue and are not finished
        self.on_plan: PlanListener | None = None
        self.on_migration: MigrationListener | None = None
        # Set: the prefill instances' outputs (first tokens) go here as soon as their plans end,
        # instead of with the step's return after the KV copies and decode steps of the round.
        self.on_prefill_outputs: OutputListener | None = None
        self._skipped_decode = False

    # ---- requests ----------------------------------------------------------------------------
    def _submit(self, seq: Sequence) -> None:
        if seq.seq_id in self.admission:  # re-run after a failed step while still queued: it keeps its place
            return
        if seq.seq_id in self._dispatched:  # re-run after a failed step: it was admitted already
            self._place(seq, self.prefill)
            return
        item = AdmissionItem(seq.seq_id, seq.request_class, seq.num_prompt_tokens + seq.sampling.max_tokens * seq.num_completions,
                             seq.arrival_time, seq.priority, seq.timeout_s, seq, num_prompt_tokens=seq.num_prompt_tokens)
        try:
            waiting = 0 if self.admission.max_queue_delay_s is None else sum(i.core.scheduler.num_waiting for i in self.prefill)
            self.admission.push(item, self.clock(), waiting)
        except DistServeError:  # refused (QueueFullError) or malformed: it never entered
            self._forget(seq.seq_id)
            raise

    def _place(self, seq: Sequence, candidates: list[LocalInstance]) -> LocalInstance:
        cc = self.cache_config
        hashes = entry_hashes(seq, cc.block_size, cc.enable_prefix_caching)
        inst = pick_entry(candidates, _route, hashes, self.router, seq.seq_id, seq.request_class)
        inst.core.add(seq)
        for s in (seq, *seq.forks):  # n > 1: its completions are prefilled there with it
            self._owner[s.seq_id] = inst
            self._dispatched.add(s.seq_id)
        return inst

    def _admit(self) -> list[RequestOutput]:
        """Fail the requests past their deadline, then dispatch what the prefill instances accept."""
        now = self.clock()
        outputs = []
        for item in self.admission.expire(now):
            seq = self._seqs.get(item.request_id)
            if seq is not None:
                outputs.append(self._fail(seq, str(expired_error(item, now)), now, kind=item.expired_kind))
        if not self.admission:
            return outputs
        tpot = room = headroom = None
        slo = self.admission.backpressure.tpot_slo_s
        if slo is not None:
            decoding = [(i.core.scheduler.num_running, i.core.token_interval_s) for i in self.decode]
            tpot = measured_tpot_s(decoding)
            room = decode_room_tokens((i.core.num_free_blocks * self.cache_config.block_size for i in self.decode),
                                      (held_prompt_tokens(i.core.scheduler) for i in self.prefill))
            headroom = decode_headroom(decoding, slo, sum(held_requests(i.core.scheduler) for i in self.prefill))

        def load(inst: LocalInstance) -> EntryLoad:
            return entry_load(inst.core.scheduler, tpot, room, headroom)

        def place(item: AdmissionItem, accepting: list[LocalInstance]) -> LocalInstance:
            item.payload.dispatch_time, item.payload.admission_rank = now, item.rank  # the prefill scheduler keeps the admission order
            return self._place(item.payload, accepting)

        self.admission.dispatch(now, self.prefill, load, place)
        return outputs

    def abort_request(self, request_id: str) -> None:
        """Abort wherever the request is (each of its completions): queued, prefilling, awaiting
        migration or decoding."""
        self.admission.remove(request_id)
        for seq in self._forget_request(request_id) or [None]:
            seq_id = request_id if seq is None else seq.seq_id
            self._dispatched.discard(seq_id)
            owner = self._owner.pop(seq_id, None)
            self._pending.drop(lambda e: e[1].seq_id == seq_id)
            if owner is not None:
                owner.route.release(seq_id)
            if seq is not None and owner is not None and not seq.is_finished:
                seq.finish_time = self.clock()
                owner.core.abort(seq_id)

    def has_unfinished_requests(self) -> bool:
        # A plan suspended between layers still holds its requests' ops (an abort waits for it).
        return bool(self._seqs) or any(inst.suspended for inst in (*self.prefill, *self.decode))

    def _reset(self) -> None:
        for inst in (*self.prefill, *self.decode):
            inst.core.reset()
            inst.route = RouteState(pool=inst.route.pool)
        self._pending = MigrationQueue()
        self._owner = {}
        self._dispatched &= self._seqs.keys()

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Finish on the side that holds the request (a stop string matched)."""
        owner = self._owner.pop(seq.seq_id, None)
        self._dispatched.discard(seq.seq_id)
        self._pending.drop(lambda e: e[1] is seq)
        if owner is not None:
            owner.route.release(seq.seq_id)
            owner.core.finish(seq, reason)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._admit()
        yielded = False
        for inst in self.prefill:
            if not inst.core.has_work():
                continue
            for seq in inst.step(self._prefill_launched):
                if seq.status is not SequenceStatus.FINISHED:
                    self._pending.push((inst, seq))
                outputs.append(self._emit(seq))
            yielded |= inst.suspended
        if self.on_prefill_outputs is not None and outputs:
            self.on_prefill_outputs(outputs)
            outputs = []
        self._migrate_pending()
        # A prefill plan that yielded did so for a waiting command: the caller handles it before the
        # decode steps (at most one step in a row, so decodes are never starved by a stream of them).
        if yielded and not self._skipped_decode:
            self._skipped_decode = True
            return outputs
        self._skipped_decode = False
        for inst in self.decode:
            if inst.core.has_work():
                outputs.extend(self._emit(seq) for seq in inst.step(self.on_plan))
        return outputs

    def _prefill_launched(self, instance_id: str, plan: StepPlan) -> None:
        stamp_prefill_starts(plan, self._seqs, self.clock())
        if self.on_plan is not None:
            self.on_plan(instance_id, plan)

    def set_should_yield(self, should_yield: Callable[[], bool] | None) -> None:
        """What the instances ask between layers of a plan that may yield: whether something waits to
        be handled first (``ThreadedEngineClient``: a command for its thread)."""
        for inst in (*self.prefill, *self.decode):
            inst.should_yield = should_yield

    def _emit(self, seq: Sequence) -> RequestOutput:
        out = self._output(seq, self.clock(), self._finish)
        if seq.is_finished:
            self._dispatched.discard(seq.seq_id)
            owner = self._owner.pop(seq.seq_id, None)
            if owner is not None:
                owner.route.release(seq.seq_id)
        return out

    def _migrate_pending(self) -> None:
        """Pull KV for waiting requests, oldest first, while some decode instance has room."""

        def move(entry: tuple[LocalInstance, Sequence]) -> bool:
            src, seq = entry
            return seq.is_finished or seq.seq_id not in self._seqs or self._migrate(src, seq)

        self._pending.drain(move, self._lane)

    def inject_transfer_fault(self, kind: str) -> None:
        """Test hook: the next migration fails (one-shot). ``drop_send`` counts as a timeout, ``fail_recv`` as an error."""
        if kind not in ("drop_send", "fail_recv"):
            raise ValueError(f"unknown transfer fault {kind!r}; choose drop_send or fail_recv")
        self._fault = kind

    def _migrate(self, src: LocalInstance, seq: Sequence) -> bool:
        moved = seq.detached_copy()
        for dst in decode_order(self.decode, _route, seq.request_class, self.scheduler_config.latency_max_num_seqs):
            reservation = dst.core.reserve(moved)
            if reservation is not None:
                break
        else:
            return False
        started = self.clock()
        if self._fault is not None:
            fault, self._fault = self._fault, None
            dst.core.cancel(seq.seq_id)
            src.core.requeue(seq.seq_id)  # prefilled again; it keeps its first token
            self.counters.record_failed_migration(timed_out=fault == "drop_send")
            return True  # no longer waiting: the prefill step reports it again
        t0 = time.perf_counter()
        first, end = reservation.num_reused_blocks, reservation.num_blocks_to_fill
        src_blocks = src.core.kv_source(seq.seq_id)[first:end]
        dst_blocks = reservation.block_table[first:end]
        num_bytes = 0
        if src_blocks:
            cache = src.runner.kv_cache  # [L, 2, NB, BS, KVH, D]
            whole = ((0, cache.shape[0]), (0, cache.shape[4]))
            data = pack_blocks(cache, src_blocks, *whole)
            unpack_blocks(dst.runner.kv_cache, dst_blocks, *whole, data)
            num_bytes = data.numel() * data.element_size()
        dst.core.complete(seq.seq_id)
        src.core.release(seq.seq_id)  # after the receiver holds the KV
        src.route.release(seq.seq_id)
        dst.route.assign(seq.seq_id, seq.request_class)
        self.counters.record_migration_duration(time.perf_counter() - t0)
        self.counters.record_migration(num_blocks_skipped=first, num_blocks=len(src_blocks), num_bytes=num_bytes)
        moved.migration_start_time, moved.migration_end_time = started, self.clock()
        self._seqs[seq.seq_id] = moved
        self._owner[seq.seq_id] = dst
        if self.on_migration is not None:
            self.on_migration(seq.seq_id, src.instance_id, dst.instance_id)
        return True

    @property
    def num_requests_awaiting_migration(self) -> int:
        """Requests prefilled whose KV waits for a decode instance with room (the migration queue)."""
        return len(self._pending)

    def stats(self) -> dict[str, object]:
        prefill = {i.instance_id: i.stats() for i in self.prefill}
        decode = {i.instance_id: i.stats() for i in self.decode}
        return {
            "prefill": prefill,
            "decode": decode,
            "kv_migration_blocks_total": self.counters.num_blocks_migrated,
            "kv_migration_seconds_total": self.counters.migration_s,
            **self.counters.migration_stats(),
            "num_requests_awaiting_migration": self.num_requests_awaiting_migration,
            **prefill_totals([*prefill.values(), *decode.values()]),
        }
