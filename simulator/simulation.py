"""Event-driven simulation of a deployment: our real schedulers, step times from a ``LatencyModel``.

Each simulated instance is the runtime's own ``InstanceCore`` (the real ``BlockManager`` and the
real ``Scheduler`` of its phase: ``Scheduler`` colocated, ``PrefillScheduler``, ``DecodeScheduler``)
and executes the ``StepPlan``s it launches by advancing a clock by the latency model's step time
instead of running a model. Admission is the runtime's (``distserve.cluster.admission``): new
requests wait in the admission queue (``SimConfig.admission``, fair queueing across tenants
by default, bounds, token rates, deadlines) until an entry instance accepts them under
backpressure. Routing is the runtime's too (``distserve.cluster.routing``): an admitted request
goes to the least assigned accepting prefill (or colocated) instance, by prefix affinity where prompts
carry their tokens and ``enable_prefix_caching`` is set (synthetic prompts share no prefixes);
finished prefills wait, KV held, in one FCFS queue until a decode instance (fewest assigned first)
can ``reserve`` room for them (pull-based); the KV then moves over the link (one transfer at a time
per sender and per receiver, as each worker has one transfer thread), the decode instance decodes
the request from its next step on and the prefill instance frees its copy. Decode instances of a
class pool (``InstanceSpec.pool``) run with their own batch cap (``InstanceSpec.max_num_seqs``)
and take their objective's requests first, as in the runtime (``decode_order``). A request's scheduling
class (``Request.objective``, ``Request.group``) goes with it into the same policy keys and the
same class- and group-aware routing (``distserve.cluster.classes``).

Events at one instant are handled in phases: steps ending then are applied, finished prefills
migrate, migrations completing then are delivered, arrivals are queued, the admission queue drops
what is past its deadline and dispatches what the entry instances accept, and only then do instances
launch — a step sees everything that happened before it starts, as the runtime's step collects
finished transfers and new requests before it schedules. ``tests/cluster/test_equivalence.py``
checks that this makes the plans and migrations of ``LocalDisaggEngine``'s rounds.

Fast-forward (``SimConfig.fast_forward``, on by default): an instance's decoding sequences are
kept in a compact form from step to step (``simulator.lazy_decodes``, pp > 1: ``simulator.lazy_lanes``),
the real scheduler planning only what else a step computes, and a stretch of steps where nothing
can change but the contexts (no prompt, preemption or arrival, no migration into the instance, no
event that reads it) is applied in one jump (``simulator.fast_forward``), with the results of
running it step by step.

Layer preemption (``SchedulerConfig.layer_preemption``): a prefill instance of one worker runs its
plans through the runtime's ``PreemptibleSteps`` (``simulator.layer_preemption``): a backlogged
rank's plan yields between layers to a lower rank's prompt dispatched to it, then resumes.

Pipeline parallelism: an instance with ``pp`` stages keeps up to ``pp`` micro-batches in flight
(the scheduler skips sequences that are in flight); each micro-batch spends the latency model's
per-stage time in each stage, in order.

Shared compute (``SimConfig.concurrent_slowdown``): instances are independent devices by default,
as GPUs are. Where they are not — one-thread workers on a CPU machine whose cores share vector
units — instances on the same node share it: while ``k`` of them compute, each step progresses
``1 + (k - 1)(f - 1)`` times slower than alone (processor sharing), and the completion times of the
steps in flight move whenever an instance starts or ends a step. Pipelined (pp > 1) instances are
not modelled: they neither slow down nor slow others.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from operator import attrgetter
from typing import TYPE_CHECKING, Any, cast

from mypy_extensions import mypyc_attr

from distserve.cluster.counters import ClusterCounters
from distserve.cluster.migration_queue import MigrationQueue
from distserve.cluster.routing import decode_lane
from distserve.engine.instance_core import InstanceCore
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.errors import InvalidConfigError
from distserve.placement import InstanceSpec, Placement
from simulator.fast_forward import undo_after
from simulator.layer_preemption import layered_prefill
from simulator.lazy_decodes import LazyDecodes
from simulator.lazy_lanes import LazyLanes
from simulator.latency import LatencyModel
from simulator.metrics import RequestRecord, SimResult
from simulator.sim_config import SimConfig
from simulator.sim_admission import SAMPLED_TOKEN, SimAdmission, filler_hashes
from simulator.sim_events import LAUNCH, MIGRATE, MIGRATED, STEP_DONE
from simulator.sim_migration import SimMigrations
from simulator.sim_records import SimRecords
from simulator.sim_instance import SharedCompute, SimInstance, cascade_rule_of, check_fits, hold_every_prompt, instance_step_times
from simulator.workload import Request, check_positive

if TYPE_CHECKING:
    from collections.abc import Sequence as Seq

@mypyc_attr(allow_interpreted_subclasses=True)
class Simulation(SimAdmission):  # (mypyc: SimAdmission(SimMigrations(SimRecords)), the same MRO)
    """Run a list of requests through a placement; ``run()`` returns a ``SimResult``."""

    def __init__(self, placement: Placement, latency: LatencyModel, config: SimConfig | None = None) -> None:
        self.placement = placement
        self.latency = latency
        self.config = config or SimConfig()
        cfg = self.config
        model = latency.model
        self.max_model_len = placement.max_model_len or cfg.max_model_len or model.max_position_embeddings
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.instances: list[SimInstance] = []
        groups = (
            [("colocated", s, cfg.scheduler) for s in placement.colocated]
            + [("prefill", s, cfg.prefill_scheduler) for s in placement.prefill]
            + [("decode", s, cfg.decode_scheduler) for s in placement.decode]
        )
        counters: dict[str, int] = {}
        cascade = cascade_rule_of(latency)  # the modelled decode attention reads shared prefixes once
        for kind, spec, sched_cfg in groups:
            # The placement's caps, then the instance's, as ``distserve serve`` deploys them.
            core = InstanceCore(kind, spec.scheduler_config(placement.scheduler_config(sched_cfg)), self._num_blocks(spec), cfg.block_size, self.max_model_len,
                                enable_prefix_caching=cfg.enable_prefix_caching, pipeline_depth=spec.pp,
                                step_histograms=False)  # (the runtime's /metrics: a simulation reports no histograms)
            idx = counters.get(kind, 0)
            counters[kind] = idx + 1
            fn, decode_fn = instance_step_times(latency, spec.tp, spec.pp, cfg, instant=cfg.instant_prefill and kind == "prefill")
            inst = SimInstance(kind, idx, spec, core, fn, len(self.instances), cascade=cascade)
            if decode_fn is not None:
                inst.decode_time = decode_fn
            inst.layered = layered_prefill(inst, model.num_layers, not cfg.instant_prefill)
            inst.pad_prefill = cfg.prefill_padding
            self.instances.append(inst)
        self.entry = [i for i in self.instances if i.kind in ("colocated", "prefill")]
        self.decodes = [i for i in self.instances if i.kind == "decode"]
        pools = {i.spec.pool for i in self.decodes}
        # Class pools: each pool's requests queue for migration in a lane of their own (``decode_lane``).
        self.lane_of: Callable[[tuple[SimInstance, Sequence, Sequence]], object] | None = (
            (lambda entry: decode_lane(entry[1].request_class, pools)) if pools != {None} else None
        )
        self.shared = SharedCompute(cfg.concurrent_slowdown) if cfg.concurrent_slowdown != 1.0 else None
        # Observers, as ``LocalDisaggEngine``'s: every plan launched (instance id, plan) and every
        # migration completed (request id, source id, destination id).
        self.on_plan: Callable[[str, StepPlan], None] | None = None
        self.on_migration: Callable[[str, str, str], None] | None = None

    def _num_blocks(self, spec: InstanceSpec) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        if not self.latency.supports(spec.tp, spec.pp):
            raise InvalidConfigError(
                f"the latency model cannot time tp={spec.tp} pp={spec.pp} for {self.latency.model.name}"
            )
        tokens = self.latency.max_kv_tokens(spec.tp, spec.pp, self.config.mem_utilization)
        return max(1, tokens // self.config.block_size)

    @property
    def num_gpus(self) -> int:
        return sum(i.num_gpus for i in self.instances)

    def next_arrival_s(self) -> float:
        """When the next request arrives (inf: all have)."""
        times, n = self._arrival_times, self._num_arrived
        return times[n] if n < len(times) else float("inf")

    # ---- the event loop ------------------------------------------------------------------------
    def run(self, requests: Seq[Request], stop_when: Callable[[RequestRecord], bool] | None = None, rate: Any = 1.0) -> SimResult:
        """Simulate ``requests`` (their arrival times divided by ``rate``: ``with_rate(requests, rate)``'s
        workload, without copying it) until all finish, or until ``stop_when(record)``, called with each
        request as it finishes, returns True (then ``SimResult.stopped_early`` is set and the
        unfinished requests' records stay open). A ``stop_when`` with a ``finishes_to_decide()``
        method (the fewest more finished requests after which it could return True) keeps
        fast-forward jumps from running past that point; one with a ``first_token(record)`` method
        is also called as each request that goes on decoding gets its first token (its record's
        ``first_token_s`` then set), and ends the run the same way if it returns True."""
        if not requests:
            raise InvalidConfigError("the workload has no requests")
        check_positive("rate", rate)  # (``rate: Any``: compiled, a ``float`` parameter would take True as 1.0)
        try:
            with gc_paused():
                return self._run(requests, stop_when, float(rate))
        finally:
            # A lazy driver still attached (a run stopped early) and its instance refer to each other:
            # drop it, so that the simulation is freed by reference counting, not left to the cyclic
            # collector (the planner keeps it off over its whole search).
            for inst in self.instances:
                inst.lazy = None

    def _run(self, requests: Seq[Request], stop_when: Callable[[RequestRecord], bool] | None, rate: float) -> SimResult:
        if self.config.instant_prefill:
            hold_every_prompt(self.instances, requests, self.config.block_size)
        check_fits(self.instances, requests, self.max_model_len, self.config.block_size)
        wall0 = time.perf_counter()
        events: list[tuple[float, int, int, object]] = []
        seq_no = itertools.count()
        self._events, self._seq_no = events, seq_no
        records: dict[str, RequestRecord] = {}
        for r in requests:
            records[str(r.req_id)] = RequestRecord(r.req_id, r.arrival_s / rate, r.prompt_len, r.output_len, r.slo_class,
                                                   objective=r.objective, tenant=r.tenant)
        self.records = records
        # Arrivals are not on the heap: they come in time order, ties in list order (``ARRIVE``'s
        # place among an instant's events, last), merged with the heap's events as they are due.
        arrivals = sorted(requests, key=_arrival_time)  # (stable: ties keep the list's order)
        self._arrival_times = arrival_times = [r.arrival_s / rate for r in arrivals]
        self._num_arrived = 0
        num_requests = len(arrivals)
        next_arrival = arrival_times[0]
        self._stop_when = stop_when
        self.stop_when_set = stop_when is not None
        self._finishes_to_decide = getattr(stop_when, "finishes_to_decide", None)
        self._on_first_token = getattr(stop_when, "first_token", None)
        self._finishes_ahead = 0  # requests jumps finished whose records are still to come (events)
        # Steady decode stretches are skipped in one jump (``simulator.fast_forward``), unless an
        # observer wants every plan or steps share compute.
        self._fast_forward = self.config.fast_forward and self.on_plan is None and self.shared is None
        self.num_fast_forward_steps = 0  # steps whose decodes the scheduler did not plan one by one (lazy)
        self._stop = False
        # Finished prefills waiting for room, FCFS: (source, its sequence, the copy the decode side gets).
        # The copy is made once; a failed ``reserve`` leaves it untouched, so retries reuse it.
        self.pending: MigrationQueue[tuple[SimInstance, Sequence, Sequence]] = MigrationQueue()
        self._migrate_at = -1.0  # the instant a MIGRATE event is queued for
        self._no_room: set[str] = set()
        self._due: list[SimInstance] = []  # instances to launch at the end of this instant
        # One SampledToken per live request, reused every step: update_from_output only reads it.
        self._sampled: dict[str, SampledToken] = {}
        self.counters = ClusterCounters()
        self.admission = self.config.admission.queue()
        self._admit_due = False  # something arrived or a step ended: try to dispatch at the end of the instant
        # Whether the admission queue or an entry instance changed since the last dispatch attempt, which
        # stopped at a head no entry accepted: until then a retry does nothing (as ``horizon`` relies on).
        self._admission_stale = True
        tpot_backpressure = self.config.admission.tpot_slo_s is not None  # (it reads every step's time)
        unfinished = len(requests)
        now = 0.0
        prompts: dict[int, list[int]] = {}
        # A synthetic request is SAMPLED_TOKEN throughout (prompt and outputs), so block i of every
        # one has the same chained content hash: computed here once, not once per request.
        self._filler_hashes = filler_hashes(max(r.prompt_len + r.output_len for r in requests), self.config.block_size)
        pop = heapq.heappop
        inf = math.inf
        while True:
            if not events or events[0][0] > next_arrival:  # (at one time, every other kind goes before ``ARRIVE``)
                if next_arrival == inf:
                    break
                now = next_arrival
                r = arrivals[self._num_arrived]
                self._num_arrived += 1
                next_arrival = arrival_times[self._num_arrived] if self._num_arrived < num_requests else inf
                unfinished -= self._arrive(r, now, prompts)
            elif (event := pop(events))[1] == STEP_DONE:
                now = event[0]
                inst, plan, version = cast("tuple[SimInstance, Any, int]", event[3])
                inst.last_load = None
                if version != inst.step_version:
                    if self.shared is not None:
                        continue  # superseded: shared compute moved this step's completion
                    # else superseded by a pipeline's jump, which applied it: only the instant's end below
                else:
                    if plan is None:  # lazy decodes' marker: their step in flight ends, or they launch again
                        unfinished -= inst.lazy.on_marker(self, now)  # type: ignore[union-attr]
                    elif type(plan) is list:  # requests a fast-forward finished in its step ending now
                        for seq in plan:
                            self._record_finish(inst, seq, now)
                        unfinished -= len(plan)
                        self._finishes_ahead -= len(plan)
                    else:
                        if inst.plan_in_flight is not None:
                            self._push_completions(self.shared.stop(inst, now))  # type: ignore[union-attr]
                        if inst.layered is not None:
                            unfinished -= self._updated(inst, inst.layered.done(now, self._sampled), now)
                        else:
                            unfinished -= self._step_done(inst, plan, now)
                    self._admit_due = True
                    if inst.kind != "decode":
                        self._admission_stale = True
                    if self._stop:
                        break
                    if self.pending:
                        self._queue_migrate(now)
            else:
                now, kind, _, payload = event
                if kind == MIGRATE:
                    self._migrate_pending(now)
                elif kind == MIGRATED:
                    src_, dst_, mid_ = cast("tuple[SimInstance, SimInstance, str]", payload)
                    self._migrated(src_, dst_, mid_, now)
                else:  # LAUNCH
                    inst = cast(SimInstance, payload)
                    inst.launch_pending = False
                    self._launch_at_end(inst)
            if (self._due or self._admit_due) and (not events or events[0][0] > now) and next_arrival > now:
                if self._admit_due and self.admission and (
                        self._admission_stale or tpot_backpressure or self.admission.next_deadline() <= now):
                    unfinished -= self._admit(now)
                self._admit_due = False
                self._launch_due(now)
        if self._stop:
            for inst in self.instances:
                undo_after(inst, now)
        if unfinished and not self._stop:
            stuck = {i.name: (i.core.scheduler.num_waiting, i.core.scheduler.num_running) for i in self.instances}
            raise RuntimeError(f"simulation stalled with {unfinished} unfinished requests ({len(self.admission)} in the "
                               f"admission queue); (waiting, running): {stuck}")
        return SimResult(
            records=list(records.values()),
            num_gpus=self.num_gpus,
            duration_s=now,
            wall_s=time.perf_counter() - wall0,
            instances={i.name: i.summary(now) for i in self.instances},
            num_prefill_tokens_computed=sum(i.core.num_prefill_tokens_computed for i in self.instances),
            num_prefix_cache_hit_tokens=sum(i.core.num_prefix_cache_hit_tokens for i in self.instances),
            num_migrations=self.counters.num_migrations,
            migration_bytes=self.counters.num_bytes_migrated,
            mean_migration_s=self.counters.migration_s / self.counters.num_migrations if self.counters.num_migrations else 0.0,
            stopped_early=self._stop,
            admission=self.admission.stats(),
        )

    # ---- one instant's order --------------------------------------------------------------------
    def _launch_at_end(self, inst: SimInstance) -> None:
        if not inst.launch_due:
            inst.launch_due = True
            self._due.append(inst)

    def _launch_due(self, now: float) -> None:
        """The end of an instant: each instance that got work or finished a step launches its next
        one, seeing everything that happened at ``now`` — as the runtime's step collects finished
        transfers and new requests before it schedules."""
        due, self._due = self._due, []
        if len(due) > 1:
            due.sort(key=lambda i: i.position)
        for inst in due:
            inst.launch_due = False
            self._try_launch(inst, now)

    def _try_launch(self, inst: SimInstance, now: float) -> None:
        core = inst.core
        inst.last_load = None
        if inst.kind != "decode":
            self._admission_stale = True  # its load may change: the next dispatch attempt reads it again
        if inst.layered is not None:
            self._push_completions(inst.layered.launch(inst, now, self.shared, self.on_plan))
            return
        if inst.lazy is not None and inst.lazy.try_launch(self, now, self._finished_in_jump):
            return  # busy, or launched with its lazy decodes (else handed back: planned as usual)
        if len(core.in_flight) >= inst.pp or inst.launch_pending:
            return
        if inst.stage_free[0] > now:  # stage 0 still busy with the previous micro-batch
            inst.launch_pending = True
            heapq.heappush(self._events, (inst.stage_free[0], LAUNCH, next(self._seq_no), inst))
            return
        launched = core.launch(send_finished=False)  # no simulated worker keeps per-request state
        if launched is None:
            return
        plan = launched.plan
        if self.on_plan is not None:
            self.on_plan(inst.instance_id, plan)
        t = inst.step_time(inst.batch_shape(plan))
        core.observe(plan, t)
        core.last_step_s = t  # what the runtime measures: the SLO budget learns from it
        inst.busy_s += t
        if self.shared and t > 0 and inst.pp == 1:
            self._push_completions(self.shared.start(inst, plan, t, now))
            return
        end = now
        stage_free = inst.stage_free
        for s in range(inst.pp):
            start = stage_free[s] if stage_free[s] > end else end
            end = start + t
            stage_free[s] = end
        if inst.pp > 1:
            inst.plan_ends.append(end)
        if self._fast_forward and inst.kind != "prefill":  # its decodes go on in a compact form (``simulator.fast_forward``)
            if inst.pp == 1:
                lazy = LazyDecodes.enter(self, inst, plan, end, SAMPLED_TOKEN)
                if lazy is not None:
                    inst.lazy = lazy
                    lazy.advance(self, now, self._finished_in_jump)
                    return
            elif (lanes := LazyLanes.enter(self, inst, SAMPLED_TOKEN)) is not None:  # each micro-batch a lane
                inst.lazy = lanes
                lanes.advance(self, now, inst.stage_free[0] if len(lanes.lanes) < inst.pp else None, self._finished_in_jump)
                return
        heapq.heappush(self._events, (end, STEP_DONE, next(self._seq_no), (inst, plan, inst.step_version)))
        if inst.pp > 1 and len(core.in_flight) < inst.pp:
            inst.launch_pending = True
            heapq.heappush(self._events, (stage_free[0], LAUNCH, next(self._seq_no), inst))

    def _push(self, time_s: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (time_s, kind, next(self._seq_no), payload))

    def _push_completions(self, group: list[SimInstance]) -> None:
        """Shared compute moved the steps in flight of ``group``: a new completion event for each
        (the old one is superseded by the version)."""
        for inst in group:
            plan = inst.layered.plan if inst.layered is not None else inst.plan_in_flight
            heapq.heappush(self._events, (inst.stage_free[0], STEP_DONE, next(self._seq_no), (inst, plan, inst.step_version)))

    def _step_done(self, inst: SimInstance, plan: StepPlan, now: float) -> int:
        """Apply a finished micro-batch (the oldest in flight: stages finish in launch order);
        returns how many requests finished."""
        tokens = self._sampled
        sampled = [tokens[c.seq_id] for c in plan.chunks if c.sample]
        assert inst.core.in_flight[0].plan is plan
        if inst.pp > 1:
            inst.plan_ends.popleft()
        return self._updated(inst, inst.core.apply_oldest(sampled, now), now)

    def _updated(self, inst: SimInstance, updated: list[Sequence], now: float) -> int:
        """After a plan of ``inst`` was applied: record the finished requests, queue the finished
        prefills for migration, launch the next step; returns how many requests finished."""
        num_finished = 0
        finished = SequenceStatus.FINISHED
        awaiting = inst.core.prefill.awaiting_migration if inst.kind == "prefill" else None
        first_token = self._on_first_token
        for seq in updated:
            if seq.status is finished:
                self._record_finish(inst, seq, now)
                num_finished += 1
                continue
            if first_token is not None and seq.first_token_time == now:
                self._record_first_token(seq, now, first_token)
            if awaiting is not None and seq.seq_id in awaiting:
                self.pending.push((inst, seq, seq.detached_copy()))
        self._launch_at_end(inst)
        return num_finished


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off meanwhile (as it was after). Its passes walk every live object
    (a simulation's and the host's, e.g. torch's): ~10% of a simulation's time, while a run leaves no
    reference cycle (it is freed by reference counting). No result depends on when."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def simulate(
    placement: Placement, latency: LatencyModel, requests: Seq[Request], config: SimConfig | None = None
) -> SimResult:
    """One run of ``requests`` through ``placement``: per-request TTFT/TPOT/E2E and summaries."""
    return Simulation(placement, latency, config).run(requests)


def with_rate(requests: Seq[Request], scale: float) -> list[Request]:
    """The same requests with arrival times divided by ``scale`` (a unit-rate workload at rate ``scale``)."""
    # ``replace(r, arrival_s=...)`` at half its cost (a planner's probe rescales its whole workload).
    get = _fields_but_arrival
    return [Request(v[0], r.arrival_s / scale, *v[1:]) for r in requests for v in (get(r),)]


_arrival_time = attrgetter("arrival_s")
_REQUEST_FIELDS = [f.name for f in fields(Request)]
assert _REQUEST_FIELDS[1] == "arrival_s", _REQUEST_FIELDS  # with_rate passes it second
_fields_but_arrival = attrgetter(*(_REQUEST_FIELDS[:1] + _REQUEST_FIELDS[2:]))
