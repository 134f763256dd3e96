"""Plans for a mix of objectives: per-class goodput of a plan, and class-pool variants of a shared plan.

A workload whose requests carry scheduling-class objectives (``latency``, ``throughput``, ...;
``Request.objective``, trace field ``objective``) is planned against one SLO per objective
(``distserve plan --class-slo latency=TTFT:TPOT``). The search (``planner.search``) sizes a shared
plan as usual; then the same decode instances are divided into class pools (``InstanceSpec.pool``):
a latency pool with a small batch cap, where a latency request's TPOT stays low, and a pool for
the other classes with a large one, where throughput work batches deeply. The shared pool is also
weighed with those larger caps, so a split is credited only with what the pools add. Each variant
is simulated with the real schedulers and routing (``decode_order`` routes by pool).

**Per-class goodput** of a plan: the highest rate of the whole mix (every class's arrivals scaled
together) at which that class's requests meet their SLO at the target attainment. The two figures
a split is judged by come from one set of simulations per plan, shared by the classes' searches;
as in the search, they are capped at the plan's steady-state throughput bound (a finite workload
lets an overloaded deployment meet a loose SLO for ever), each pool's from its own batch cap.

**The rule** (``RULE``): a split replaces the shared plan only when every class's goodput per GPU
is at least the shared pool's at every cap weighed and one class's is higher by more than the
search's tolerance; of those, the highest worst-class gain wins. Every variant is searched in full,
so the table shows each trade-off (a split that serves the latency class more and the throughput
class less is not chosen, but shown). The planner does not change the batch cap of a shared plan;
when a larger cap alone serves every class more, it says so (a note).

A class's SLO here is the one given for it, checked as given: an explicit throughput SLO is
checked (unlike the default scoring, where throughput requests need only complete).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from distserve.cluster.classes import LATENCY, OBJECTIVES
from distserve.errors import InvalidConfigError
from distserve.placement import InstanceSpec, Placement
from distserve.planner.candidates import placement_bound
from distserve.slo import SLO, TimedRequest, parse_latency
from simulator.goodput import search_rate
from simulator.latency import LatencyModel
from simulator.metrics import SimResult
from simulator.simulation import SimConfig, Simulation, with_rate
from simulator.workload import Request

RULE = ("class pools replace the shared plan only if every class's goodput/GPU >= the shared pool's at every cap weighed "
        "and one class's is higher by > the search tolerance")
MAX_PROBES = 24


def parse_class_slo(text: str) -> tuple[str, SLO]:
    """``latency=200ms:0.05`` -> ("latency", SLO(0.2, 0.05)): an objective, its TTFT and TPOT
    (``distserve.slo.parse_latency``: 200ms, 0.2s or 0.2 seconds; "inf": not checked)."""
    objective, sep, targets = text.partition("=")
    ttft, colon, tpot = targets.partition(":")
    if not sep or not colon:
        raise InvalidConfigError(f"--class-slo {text!r}: expected OBJECTIVE=TTFT:TPOT, e.g. latency=1.0:0.05 or latency=200ms:50ms",
                                 "class_slo")
    try:
        slo = SLO(parse_latency(ttft, "--class-slo", allow_inf=True), parse_latency(tpot, "--class-slo", allow_inf=True))
    except InvalidConfigError as exc:
        raise InvalidConfigError(f"--class-slo {text!r}: {str(exc).removeprefix('--class-slo ')}", "class_slo") from None
    if objective not in OBJECTIVES:
        raise InvalidConfigError(f"--class-slo {text!r}: the objective must be one of {', '.join(OBJECTIVES)}", "class_slo")
    return objective, slo


def workload_objectives(requests: Sequence[Request]) -> list[str]:
    """The objectives the requests carry, in ``OBJECTIVES`` order."""
    present = {r.objective for r in requests}
    return [o for o in OBJECTIVES if o in present]


def check_class_slos(requests: Sequence[Request], slos: Mapping[str, SLO]) -> list[str]:
    """The workload's objectives, each of which must have an SLO in ``slos``."""
    objectives = workload_objectives(requests)
    missing = [o for o in objectives if o not in slos]
    if missing:
        raise InvalidConfigError(f"the workload has {', '.join(missing)} requests but no --class-slo for them "
                                 f"(given: {', '.join(sorted(slos)) or 'none'})", "class_slo")
    return objectives


def class_attainment(records: Sequence[TimedRequest], slos: Mapping[str, SLO]) -> dict[str, float]:
    """Per objective in ``slos``: the fraction of that class's records meeting its SLO (NaN: none of that class)."""
    out = {}
    for objective, slo in slos.items():
        own = [r for r in records if r.objective == objective]
        out[objective] = sum(r.meets(slo) for r in own) / len(own) if own else math.nan
    return out


@dataclass
class ClassFigures:
    """One plan of the comparison: per class, its goodput (req/s of the whole mix) and its
    attainment at the plan's rate."""

    name: str
    placement: Placement
    goodput: dict[str, float] = field(default_factory=dict)
    attainment: dict[str, float] = field(default_factory=dict)
    num_simulated: int = 0

    @property
    def num_gpus(self) -> int:
        return self.placement.num_workers

    def per_gpu(self, objective: str) -> float:
        return self.goodput.get(objective, 0.0) / self.num_gpus


@dataclass
class ClassComparison:
    """The shared plan, the same pool with larger caps (references) and its class-pool splits, per
    class; ``chosen`` is the split the rule picked (None: the shared plan stays)."""

    slos: dict[str, SLO]
    rate: float  # the plan's rate, at which the attainments are taken
    shared: ClassFigures
    references: list[ClassFigures]  # the shared pool with larger batch caps
    splits: list[ClassFigures]  # class pools
    chosen: ClassFigures | None = None
    larger_cap: ClassFigures | None = None  # a reference the rule prefers to the shared plan: its cap alone helps
    rule: str = RULE

    @property
    def plans(self) -> list[ClassFigures]:
        return [self.shared, *self.references, *self.splits]

    @property
    def num_simulated(self) -> int:
        return sum(p.num_simulated for p in self.plans)


def pools_label(placement: Placement) -> str:
    """``L1x16 + T1x128`` (pool initial, instances x batch cap), ``shared x128``, or ``shared``."""
    parts: dict[str | None, list[InstanceSpec]] = {}
    for s in placement.decode:
        parts.setdefault(s.pool, []).append(s)
    if set(parts) == {None}:
        caps = {s.max_num_seqs for s in placement.decode}
        return "shared" if caps == {None} else "shared x" + "/".join(str(c or "-") for c in sorted(caps, key=lambda c: c or 0))
    return " + ".join(f"{(pool or 'shared')[0].upper()}{len(specs)}x{specs[0].max_num_seqs or '-'}" for pool, specs in parts.items())


def variants(shared: Placement, requests: Sequence[Request], base_cap: int) -> list[Placement]:
    """What the shared plan is weighed against: the same decode instances as one pool with larger
    batch caps (so a split is not credited with what a larger cap alone gives), and divided into a
    latency pool (small cap) and a pool of the other classes (large cap) — latency-pool sizes
    around the latency class's share of the decode work, a few caps. No splits for fewer than two
    decode instances."""
    out = [replace(shared, decode=tuple(replace(s, max_num_seqs=cap) for s in shared.decode), predicted={})
           for cap in (2 * base_cap, 4 * base_cap)]
    m = len(shared.decode)
    if m < 2:
        return out
    work = {r.req_id: r.output_len * (r.prompt_len + r.output_len / 2) for r in requests}  # KV token-steps of decoding
    total = sum(work.values())
    share = sum(work[r.req_id] for r in requests if r.objective == LATENCY) / total if total else 0.0
    around = round(share * m)
    sizes = sorted({min(m - 1, max(1, n)) for n in (around - 1, around, around + 1)})
    others = sorted({r.objective for r in requests} - {LATENCY})
    other_pool = others[0] if len(others) == 1 else None  # several other classes: they share the rest
    caps = [(max(1, base_cap // 4), 2 * base_cap), (max(1, base_cap // 2), 2 * base_cap), (max(1, base_cap // 2), 4 * base_cap)]
    for n in sizes:
        for lat_cap, other_cap in caps:
            decode = tuple(replace(s, pool=LATENCY, max_num_seqs=lat_cap) if i < n else replace(s, pool=other_pool, max_num_seqs=other_cap)
                           for i, s in enumerate(shared.decode))
            out.append(replace(shared, decode=decode, predicted={}))
    return out


class _ClassSearch:
    """Per-class goodput of one placement: simulations of the mix by rate, cached, shared by the classes' searches."""

    def __init__(self, placement: Placement, latency: LatencyModel, requests: Sequence[Request], config: SimConfig,
                 slos: Mapping[str, SLO], rel_tol: float, max_rate: float | None) -> None:
        self.placement, self.latency, self.requests, self.config = placement, latency, requests, config
        self.slos, self.rel_tol, self.max_rate = dict(slos), rel_tol, max_rate
        self.target = min(s.attainment for s in slos.values())
        self._runs: dict[float, dict[str, float]] = {}

    @property
    def num_simulated(self) -> int:
        return len(self._runs)

    def attainment(self, rate: float) -> dict[str, float]:
        if rate not in self._runs:
            res: SimResult = Simulation(self.placement, self.latency, self.config).run(with_rate(self.requests, rate))
            self._runs[rate] = class_attainment(res.records, self.slos)
        return self._runs[rate]

    def passes(self, objective: str, rate: float) -> bool:
        return self.attainment(rate)[objective] >= self.slos[objective].attainment - 1e-12

    def goodput(self, objective: str, start_rate: float) -> float:
        lo, _ = search_rate(lambda rate: self.passes(objective, rate), start_rate, self.max_rate, self.rel_tol, MAX_PROBES)
        return lo


def _max_rate(latency: LatencyModel, placement: Placement, requests: Sequence[Request], config: SimConfig, rate: float) -> float | None:
    """Where a plan's class searches stop: a finite workload lets an overloaded deployment meet an
    SLO for a while (a loose one for ever), so, as in the search, at its steady-state throughput
    bound (its pools' own: a throughput pool with a large cap sustains more)."""
    bound = placement_bound(latency, placement, requests, config)
    return max(bound, rate) if math.isfinite(bound) else None


def _figures(name: str, search: _ClassSearch, rate: float, goodput: dict[str, float]) -> ClassFigures:
    return ClassFigures(name, search.placement, goodput, search.attainment(rate), search.num_simulated)


def better(variant: ClassFigures, shared: ClassFigures, rel_tol: float) -> bool:
    """``RULE``: every class at least as much goodput per GPU as ``shared``, one more by > ``rel_tol``."""
    classes = list(shared.goodput)
    return all(variant.per_gpu(c) >= shared.per_gpu(c) - 1e-12 for c in classes) and any(
        variant.per_gpu(c) > shared.per_gpu(c) * (1 + rel_tol) for c in classes)


def best_shared(shared: ClassFigures, references: Sequence[ClassFigures]) -> ClassFigures:
    """Per class, the most goodput of the shared pool at any of the caps weighed: what a split must beat."""
    figures = [shared, *references]
    goodput = {o: max(f.goodput.get(o, 0.0) for f in figures) for o in shared.goodput}
    return ClassFigures("best shared", shared.placement, goodput)


def choose(bar: ClassFigures, splits: Sequence[ClassFigures], rel_tol: float) -> ClassFigures | None:
    """The split the rule lets replace the shared plan: of those ``better`` than ``bar`` (the shared
    pool at every cap weighed: ``best_shared``), the highest worst-class gain, then total gain; None if none is."""
    def gain(f: ClassFigures) -> tuple[float, float]:
        ratios = [f.per_gpu(o) / bar.per_gpu(o) if bar.per_gpu(o) > 0 else math.inf for o in bar.goodput]
        return min(ratios), sum(ratios)

    return max((f for f in splits if better(f, bar, rel_tol)), key=gain, default=None)


def compare_pools(shared: Placement, rate: float, latency: LatencyModel, requests: Sequence[Request], config: SimConfig,
                  slos: Mapping[str, SLO], rel_tol: float) -> ClassComparison:
    """Per-class goodput of the shared plan (sized for ``rate``) and of its ``variants``; the one the rule chooses, if any."""
    objectives = check_class_slos(requests, slos)
    slos = {o: slos[o] for o in objectives}
    base = shared.decode[0].scheduler_config(config.decode_scheduler).max_num_seqs
    start = rate if rate > 0 else 1.0
    search = _ClassSearch(shared, latency, requests, config, slos, rel_tol, _max_rate(latency, shared, requests, config, rate))
    shared_figs = _figures("shared", search, rate, {o: search.goodput(o, start) for o in objectives})

    def weigh(variant: Placement, bar: ClassFigures) -> ClassFigures:
        s = _ClassSearch(variant, latency, requests, config, slos, rel_tol, _max_rate(latency, variant, requests, config, rate))
        name = pools_label(variant) if variant.pools == {None: len(variant.decode)} else f"pools {pools_label(variant)}"
        return _figures(name, s, rate, {o: s.goodput(o, bar.goodput[o] or start) for o in objectives})

    every = variants(shared, requests, base)
    references = [weigh(v, shared_figs) for v in every if v.pools == {None: len(v.decode)}]
    bar = best_shared(shared_figs, references)
    splits = [weigh(v, bar) for v in every if v.pools != {None: len(v.decode)}]
    larger_cap = max((r for r in references if better(r, shared_figs, rel_tol)), key=lambda r: min(r.goodput.values()), default=None)
    return ClassComparison(slos, rate, shared_figs, references, splits, choose(bar, splits, rel_tol), larger_cap)


__all__ = [
    "RULE", "ClassComparison", "ClassFigures", "best_shared", "better", "check_class_slos", "choose", "class_attainment", "compare_pools",
    "parse_class_slo", "pools_label", "variants", "workload_objectives",
]
