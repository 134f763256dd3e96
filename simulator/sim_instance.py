"""One simulated instance: the runtime's ``InstanceCore`` with clocks, how long its steps take, and
how instances sharing a node's compute slow each other down.

``Simulation`` drives these: it launches the core's plans, times each one with ``step_time_fn``
(the latency model's time of the plan's ``batch_shape``) and applies it when its clock gets there;
with ``SharedCompute`` the steps in flight on a node finish later while others compute there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from distserve.cluster.backpressure import EntryLoad, entry_load, step_capacity
from distserve.cluster.routing import RouteState
from distserve.engine.instance_core import InstanceCore
from distserve.engine.step_plan import StepPlan
from distserve.errors import InvalidConfigError
from distserve.placement import InstanceSpec
from simulator.latency import BatchShape, LatencyModel

if TYPE_CHECKING:
    from kernels.cascade_attention import CascadeRule
    from simulator.layer_preemption import LayeredPrefill
    from simulator.lazy_decodes import LazyDecodes
    from simulator.lazy_lanes import LazyLanes
    from simulator.workload import Request
    from simulator.sim_config import SimConfig

StepTimeFn = Callable[[BatchShape], float]
DecodeTimeFn = Callable[[int, int, int], float]  # (num_decode, decode_ctx, decode_max_ctx) -> seconds


class SimInstance:
    """One instance: the runtime's ``InstanceCore``, a clock for each of its ``pp`` stages, a link."""

    def __init__(
        self, kind: str, index: int, spec: InstanceSpec, core: InstanceCore, step_time_fn: StepTimeFn, position: int = 0,
        cascade: CascadeRule | None = None,
    ) -> None:
        """``cascade``: the rule of the instance's cascade decode attention (``cascade_rule_of``), so
        its step shapes carry what shared prefixes save; None for a backend without one."""
        self.kind = kind  # "colocated" | "prefill" | "decode"
        self.index = index
        self.position = position  # in ``Simulation.instances``: instances due at one instant launch in this order
        self.launch_due = False
        self.spec = spec
        self.tp, self.pp = spec.tp, spec.pp
        self.core = core
        self.stage_free = [0.0] * spec.pp  # when each pipeline stage finishes its last micro-batch
        self.launch_pending = False
        self.plan_ends: deque[float] = deque()  # pp > 1: when each plan in flight ends, oldest first
        self.route = RouteState(pool=spec.pool)  # what routing knows (``cluster.routing``, as the runtime's)
        self.tx_free = 0.0  # the transfer thread: busy until
        self.rx_free = 0.0
        self.rx_ends: deque[float] = deque()  # when each migration into it in flight completes (in order)
        # (launch instant, num_steps, busy_s) before each step a fast-forward skipped (``simulator.fast_forward``),
        # kept while it lasts in a run that may stop early, to count only the steps launched by then.
        self.fast_forward_log: list[tuple[float, int, float]] | None = None
        self.busy_s = 0.0
        self.step_time = step_time_fn
        self.decode_time: DecodeTimeFn = lambda n, ctx, max_ctx: step_time_fn(BatchShape(0, 0, 0, n, ctx, max_ctx))
        # Its decoding sequences in a compact form (``simulator.lazy_decodes``, pp > 1: ``simulator.lazy_lanes``).
        self.lazy: LazyDecodes | LazyLanes | None = None
        self.cascade = cascade
        self.layered: LayeredPrefill | None = None  # prefill plans yield between layers (``simulator.layer_preemption``)
        # ``entry_load``'s last answer, until the instance changes (``Simulation`` forgets it then: a
        # step ends, it launches, a request is dispatched to it or migrated off it).
        self.last_load: EntryLoad | None = None
        self._savings: dict[tuple, tuple[int, int]] = {}  # batch_shape's memo of shared-prefix savings
        self.pad_prefill = False  # its prompt batches padded to the longest (``SimConfig.prefill_padding``)
        # Shared compute: the step in flight's solo seconds still to run, its current speed, when
        # those were last brought up to date, and a version that invalidates superseded completions.
        self.work_left = 0.0
        self.speed = 1.0
        self.updated_at = 0.0
        self.step_version = 0
        self.plan_in_flight: StepPlan | None = None
        self.launched_at = 0.0
        self.solo_s = 0.0

    @property
    def name(self) -> str:
        return f"{self.kind}{self.index}"

    @property
    def instance_id(self) -> str:
        """The runtime's name of this instance (``prefill-0``)."""
        return f"{self.kind}-{self.index}"

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    def entry_load(self, tpot_s: float | None, decode_room: int | None = None, headroom: int | None = None) -> EntryLoad:
        """``cluster.backpressure.entry_load`` of this (entry) instance: its lazy decodes, the head of
        ``running``, left unread (they hold no prompt tokens). Read at every dispatch attempt and jump
        (``fast_forward.horizon``), it is computed again only after the instance changed (``last_load``)."""
        load = self.last_load
        if load is not None and load.tpot_s == tpot_s and load.decode_room_tokens == decode_room and load.decode_headroom == headroom:
            return load
        sched = self.core.scheduler
        if self.lazy is None:
            load = entry_load(sched, tpot_s, decode_room, headroom)
        else:
            load = EntryLoad(sched.num_waiting, tpot_s, sched.pending_prompt_tokens(self.lazy.num_members),
                             *step_capacity(sched.config, sched.phase, sched.pipeline_depth), decode_room, headroom)
        self.last_load = load
        return load

    def summary(self, duration_s: float) -> dict[str, float]:
        """Its figures in ``SimResult.instances``, for a run that lasted ``duration_s``."""
        core = self.core
        return {
            "tp": self.tp,
            "pp": self.pp,
            "num_steps": core.num_steps,
            "utilization": self.busy_s / duration_s if duration_s > 0 else 0.0,
            "num_preemptions": core.scheduler.num_preemptions,
            "num_blocks": core.block_manager.num_blocks,
            "prefill_tokens_computed": core.num_prefill_tokens_computed,
            "prefix_cache_hit_tokens": core.num_prefix_cache_hit_tokens,
            **(self.layered.stats() if self.layered is not None else {}),
        }

    def batch_shape(self, plan: StepPlan) -> BatchShape:
        """The aggregates of ``plan`` this instance's latency model times."""
        if len(self._savings) > 256:
            self._savings.clear()
        return batch_shape(plan, self.cascade, self.core.block_manager.block_size, self._savings, self.pad_prefill)


def check_fits(instances: Sequence[SimInstance], requests: Sequence[Request], max_model_len: int, block_size: int) -> None:
    """Refuse a workload whose longest request exceeds the context, or the KV of an instance it must fit in."""
    longest = max(r.prompt_len + r.output_len for r in requests)
    if longest > max_model_len:
        raise InvalidConfigError(
            f"a request needs {longest} tokens but the model's context is {max_model_len}; "
            "clip the workload (max_total_len) or raise max_model_len"
        )
    for inst in instances:
        capacity = inst.core.block_manager.num_blocks * block_size
        need = longest if inst.kind != "prefill" else max(r.prompt_len + 1 for r in requests)
        if need > capacity:
            raise InvalidConfigError(
                f"{inst.name} (tp={inst.tp}, pp={inst.pp}) holds {capacity} KV tokens, "
                f"but a request needs {need}: the placement does not fit in memory"
            )


def hold_every_prompt(instances: Sequence[SimInstance], requests: Sequence[Request], block_size: int) -> None:
    """Instant prefill: every request gets its first token on arrival and waits, TPOT clock running,
    for a decode instance, so each prefill instance must be able to hold them all."""
    need = sum(-(-(r.prompt_len + 1) // block_size) for r in requests)
    for inst in instances:
        if inst.kind == "prefill":
            inst.core.num_blocks = need
            inst.core.reset()
            inst.core.scheduler.max_running = len(requests)


def batch_shape(
    plan: StepPlan, cascade: CascadeRule | None = None, block_size: int = 16, memo: dict[tuple, tuple[int, int]] | None = None,
    pad_prefill: bool = False,
) -> BatchShape:
    """The aggregates of ``plan`` a latency model times; with ``cascade`` (the instance's cascade
    rule) also the KV reads its shared prefixes save (``shared_prefix_savings``). ``pad_prefill``
    (``SimConfig.prefill_padding``): its prompt chunks count as that many copies of the longest.

    ``memo`` keeps the savings by the decodes' (id, first block): a shared node is made of full
    committed blocks, so while the same sequences decode together their tree is the same however
    far their own suffixes grow (new blocks are never shared). It spares the tree on every step of
    an unchanged batch.
    """
    num_prefill = prefill_tokens = prefill_sq = num_decode = decode_ctx = max_ctx = longest = longest_sq = 0
    firsts: set[int] | None = set() if cascade is not None else None
    shared = False
    for c in plan.chunks:
        n = len(c.token_ids)
        if n == 1:
            num_decode += 1
            decode_ctx += c.start_pos + 1
            if c.start_pos >= max_ctx:
                max_ctx = c.start_pos + 1
            if firsts is not None and c.start_pos >= block_size - 1:  # a full first block: shareable
                first = c.block_table[0]
                if first in firsts:
                    shared = True
                firsts.add(first)
        else:
            s = c.start_pos
            num_prefill += 1
            prefill_tokens += n
            sq = (s + n) * (s + n) - s * s
            prefill_sq += sq
            if pad_prefill:
                longest = n if n > longest else longest
                longest_sq = sq if sq > longest_sq else longest_sq
    if pad_prefill and num_prefill > 1:
        prefill_tokens, prefill_sq = num_prefill * longest, num_prefill * longest_sq
    if not shared:  # no two decodes start on one block: nothing to read once (and no tree to build)
        return BatchShape(num_prefill, prefill_tokens, prefill_sq, num_decode, decode_ctx, max_ctx)
    decodes = [c for c in plan.chunks if len(c.token_ids) == 1]
    key = tuple((c.seq_id, c.block_table[0]) for c in decodes) if memo is not None else ()
    found = memo.get(key) if memo is not None else None
    if found is None:
        found = shared_prefix_savings(
            [c.block_table for c in decodes], [c.start_pos + 1 for c in decodes], block_size, cascade  # type: ignore[arg-type]
        )
        if memo is not None:
            memo[key] = found
    saved, nodes = found
    return BatchShape(num_prefill, prefill_tokens, prefill_sq, num_decode, decode_ctx, max_ctx, saved, nodes)


def shared_prefix_savings(
    block_tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int, rule: CascadeRule
) -> tuple[int, int]:
    """(KV tokens a cascade step does not read, kept nodes): the shared-prefix tree of these
    decodes (``find_prefix_tree``), its nodes that pay by ``rule``, each read once for its members."""
    from kernels.cascade_attention import find_prefix_tree  # torch: only for a cascade instance

    kept = rule.kept(find_prefix_tree(block_tables, context_lens, block_size), block_size)
    return sum((len(n.members) - 1) * n.num_blocks * block_size for n in kept), len(kept)


def cascade_rule_of(latency: LatencyModel) -> CascadeRule | None:
    """The rule of the cascade backend a latency model with ``decode_attention == "cascade"`` models
    (the registered ``cascade`` backend's, as the runner uses it), else None."""
    if latency.decode_attention != "cascade":
        return None
    from kernels.backends import get_decode_attention

    rule = getattr(get_decode_attention("cascade"), "rule", None)
    if rule is None:
        from kernels.cascade_attention import CascadeRule

        rule = CascadeRule()
    return rule


def route_of(inst: SimInstance) -> RouteState:
    return inst.route


def step_time_fn(latency: LatencyModel, tp: int, pp: int, overhead_s: float, scale: float = 1.0,
                 prefill_scale: float = 1.0, instant: bool = False) -> StepTimeFn:
    """Seconds one step of an instance of ``tp`` × ``pp`` takes: the latency model's time, scaled
    (steps with prompt tokens by ``prefill_scale``), plus ``overhead_s``; 0 if ``instant``."""
    step_time = latency.step_time
    if instant:
        return lambda shape: 0.0
    if prefill_scale == scale:
        if scale == 1.0:
            return lambda shape: step_time(shape, tp, pp) + overhead_s
        return lambda shape: scale * step_time(shape, tp, pp) + overhead_s
    return lambda shape: (prefill_scale if shape.prefill_tokens else scale) * step_time(shape, tp, pp) + overhead_s


def instance_step_times(latency: LatencyModel, tp: int, pp: int, cfg: SimConfig, instant: bool = False) -> tuple[StepTimeFn, DecodeTimeFn | None]:
    """(seconds of any step, seconds of a decode-only step from (num_decode, decode_ctx, decode_max_ctx); None: no
    decode steps, ``instant``) of an instance of ``tp`` × ``pp`` under ``cfg``'s runtime constants: the latency model's
    time scaled, plus ``step_overhead_s`` per step and ``seq_overhead_s`` per sequence in it."""
    fn = step_time_fn(latency, tp, pp, cfg.step_overhead_s, cfg.step_time_scale, cfg.prefill_scale, instant=instant)
    if instant:
        return fn, None
    decode_fn = latency.decode_step_fn(tp, pp, cfg.step_time_scale, cfg.step_overhead_s)
    k = cfg.seq_overhead_s
    if not k:
        return fn, decode_fn
    return (lambda shape: fn(shape) + k * (shape.num_prefill + shape.num_decode),
            lambda n, ctx, max_ctx: decode_fn(n, ctx, max_ctx) + k * n)


class SharedCompute:
    """Processor sharing among the instances of a node (unpinned ones share one): while ``k`` of them
    compute, each step progresses ``1 + (k - 1)(slowdown - 1)`` times slower than alone.

    ``start`` and ``stop`` return the instances whose step in flight got a new end
    (``stage_free[0]``) and ``step_version``; the driver schedules those completions.
    """

    def __init__(self, slowdown: float) -> None:
        self.slowdown = slowdown
        self.computing: dict[int | None, list[SimInstance]] = {}  # per node: the instances computing now

    def start(self, inst: SimInstance, plan: StepPlan, solo_s: float, now: float) -> list[SimInstance]:
        group = self.computing.setdefault(inst.spec.node, [])
        _advance(group, now)
        inst.work_left, inst.updated_at = solo_s, now
        inst.plan_in_flight, inst.launched_at, inst.solo_s = plan, now, solo_s
        group.append(inst)
        return self._reschedule(group, now)

    def stop(self, inst: SimInstance, now: float) -> list[SimInstance]:
        group = self.computing[inst.spec.node]
        _advance(group, now)
        group.remove(inst)
        inst.busy_s += (now - inst.launched_at) - inst.solo_s  # busy for as long as it took
        inst.plan_in_flight = None
        return self._reschedule(group, now)

    def progress(self, inst: SimInstance, now: float) -> float:
        """Solo seconds of work ``inst``'s step in flight has done by ``now``."""
        _advance(self.computing[inst.spec.node], now)
        return inst.solo_s - inst.work_left

    def shorten(self, inst: SimInstance, now: float, solo_s: float) -> list[SimInstance]:
        """``inst``'s step in flight ends after ``solo_s`` seconds of work in all (a plan yielding
        between layers: ``simulator.layer_preemption``), as ``start``'s return."""
        group = self.computing[inst.spec.node]
        _advance(group, now)
        inst.work_left = max(0.0, inst.work_left - (inst.solo_s - solo_s))
        inst.solo_s = solo_s
        return self._reschedule(group, now)

    def _reschedule(self, group: list[SimInstance], now: float) -> list[SimInstance]:
        if group:
            speed = 1.0 / (1.0 + (len(group) - 1) * (self.slowdown - 1.0))
            for inst in group:
                inst.speed = speed
                inst.step_version += 1
                inst.stage_free[0] = now + inst.work_left / speed
        return group


def _advance(group: list[SimInstance], now: float) -> None:
    """Bring the work left of ``group``'s steps up to ``now``."""
    for inst in group:
        inst.work_left = max(0.0, inst.work_left - (now - inst.updated_at) * inst.speed)
        inst.updated_at = now
