"""Goodput: the highest arrival rate whose SLO attainment meets the target, found by simulation + bisection.

The workload is generated once at unit rate (seeded) and replayed at each probed rate by scaling
its arrival times, so every probe sees the same requests in the same order: the search is
reproducible and attainment is (close to) monotone in the rate.

A caller that only needs the goodput if it reaches some rate (a planner comparing a candidate with
the best so far) passes that rate as ``min_rate``. The search is unchanged; but first, the probes
that decide whether it would end at or above ``min_rate`` are simulated, most decisive first, and
if it would not, the search stops there (``below``). The outcome is exactly the full search's.

A probe stops as soon as its verdict is certain (``early_stop``): once more requests have missed
their SLO than the attainment target allows, no later request can make it pass; and, with
``early_pass``, once enough have met it that no later one can make it fail. Its attainment is then
a lower bound (the open requests count as misses) and ``Probe.stopped_early`` says so; the
pass/fail outcome, hence the goodput, is exactly the full simulation's (``binding`` is read off the
requests finished by then, and only failed probes' is reported). The ``SimResult`` a
``GoodputResult`` hands back is a complete run (an early-stopped one is simulated again), except
for a search stopped by ``min_rate`` and with ``early_pass`` (a caller that needs only the rates,
as the planner).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from distserve.errors import InvalidConfigError
from distserve.placement import Placement
from distserve.slo import SLOSpec, attainment, max_misses, meets, slo_for_objective
from simulator.latency import LatencyModel
from simulator.metrics import RequestRecord, SimResult
from simulator.simulation import SimConfig, Simulation, gc_paused, with_rate
from simulator.workload import Request


@dataclass(frozen=True)
class Probe:
    rate: float
    attainment: dict[str, float]  # a lower bound when stopped_early
    meets: bool
    stopped_early: bool = False


class _MissCounter:
    """``Simulation.run``'s ``stop_when``: True once the probe is certain to miss the target (or,
    ``passes``, to meet it), each finished request judged as ``attainment`` judges it — and a
    request whose first token came too late counted as a miss (of TTFT, and joint) already then:
    whatever it does next, ``attainment`` will count it so."""

    def __init__(self, num_requests: int, slo: SLOSpec, passes: bool = False) -> None:
        # meets() needs hits / n >= target, so at most this many misses (of one kind, or joint) pass.
        self.allowed = max_misses(num_requests, slo.default.attainment - 1e-12)  # the tolerance as ``meets``
        # Hits (of each kind, or joint) that leave at most ``allowed`` misses whatever the rest do
        # (requests never finishing, refused or expired, are among the rest).
        self.needed = num_requests - self.allowed if passes else num_requests + 1
        self.slo = slo
        self.joint = slo.mode == "joint"
        self.misses = [0, 0, 0]  # ttft, tpot, either
        self.hits = [0, 0, 0]  # ttft, tpot, both
        self.passed = False  # it stopped because it is certain to pass
        self.late: set[int] = set()  # requests counted as TTFT misses at their first token

    def first_token(self, rec: RequestRecord) -> bool:
        """A request that goes on decoding got its first token (``rec.first_token_s``): True if its
        TTFT missed and that makes the probe certain to fail."""
        target = slo_for_objective(self.slo.for_class(rec.slo_class), rec.objective)
        if target.ttft_met(rec.first_token_s - rec.arrival_s):  # type: ignore[operator]
            return False
        self.late.add(rec.req_id)
        m = self.misses
        m[0] += 1
        m[2] += 1
        return (m[2] if self.joint else max(m[0], m[1])) > self.allowed

    def __call__(self, rec: RequestRecord) -> bool:
        target = slo_for_objective(self.slo.for_class(rec.slo_class), rec.objective)
        tpot_hit = rec.meets_tpot(target)
        m, h = self.misses, self.hits
        m[1] += not tpot_hit
        h[1] += tpot_hit
        if rec.req_id not in self.late:  # (else its TTFT and joint misses are counted)
            ttft_hit = rec.meets_ttft(target)
            m[0] += not ttft_hit
            m[2] += not (ttft_hit and tpot_hit)
            h[0] += ttft_hit
            h[2] += ttft_hit and tpot_hit
        if (m[2] if self.joint else max(m[0], m[1])) > self.allowed:
            return True
        self.passed = (h[2] if self.joint else min(h[0], h[1])) >= self.needed
        return self.passed

    def finishes_to_decide(self) -> int:
        """The fewest more finished requests after which this could return True (``Simulation.run``)."""
        m, h = self.misses, self.hits
        if self.joint:
            return min(self.allowed + 1 - m[2], self.needed - h[2])
        return min(self.allowed + 1 - max(m[0], m[1]), self.needed - min(h[0], h[1]))


@dataclass
class GoodputResult:
    """The best rate found, per GPU, and every probe the search made."""

    rate: float  # requests/s meeting the SLO target (0 if even a trickle misses it)
    num_gpus: int
    probes: list[Probe] = field(default_factory=list)
    # The simulation at ``rate`` (at the lowest probe if rate == 0), complete — except with ``below``.
    result: SimResult | None = None
    binding: str | None = None  # the SLO that fails first just above ``rate``: "ttft", "tpot" or "both"
    below: float | None = None  # set when the search would end below ``min_rate``: the goodput is below it (``rate`` is 0)

    @property
    def per_gpu(self) -> float:
        return self.rate / self.num_gpus


def binding_slo(att: dict[str, float], slo: SLOSpec) -> str:
    """Which SLO keeps ``att`` from (or is closest to keeping it from) the target: "ttft", "tpot" or "both"."""
    target = slo.default.attainment
    ttft_short, tpot_short = att["ttft"] < target, att["tpot"] < target
    if ttft_short and tpot_short:
        return "both"
    if ttft_short:
        return "ttft"
    if tpot_short:
        return "tpot"
    return "ttft" if att["ttft"] <= att["tpot"] else "tpot"  # joint mode: the weaker of the two


def find_goodput(
    placement: Placement,
    latency: LatencyModel,
    unit_rate_requests: Sequence[Request],
    slo: SLOSpec,
    config: SimConfig | None = None,
    rel_tol: float = 0.02,
    start_rate: float | None = None,
    max_probes: int = 40,
    max_rate: float | None = None,
    min_rate: float | None = None,
    early_stop: bool = True,
    early_pass: bool = False,
    memo: dict[tuple[float, bool], tuple[SimResult, bool]] | None = None,
) -> GoodputResult:
    """Bisection on the arrival rate; ``unit_rate_requests`` arrive at 1 request/s on average.

    ``max_rate`` caps the search (e.g. a throughput bound the deployment cannot sustain beyond,
    however long a finite workload hides it): a probe passing there ends the search.
    ``min_rate``: if the search would find less, stop as soon as that is certain, with ``rate`` 0
    and ``below`` = ``min_rate``; otherwise the result is the same as without it.
    ``early_stop``: end each probe once its verdict is certain to fail (same outcome, less
    simulating); ``early_pass`` also once it is certain to pass (then ``result`` may be a run that
    stopped early: its attainment a lower bound).
    ``memo``: the simulations of an earlier search with the same arguments but perhaps another
    ``min_rate`` (``simulate_at``'s answers, by rate and whether it might stop early), taken instead of
    simulating again; the new ones are added to it. A simulation is a function of its arguments, so
    the result is the same as without (the planner's speculative workers, ``planner.search``).
    """
    with gc_paused():  # (its probes, and weighing the search's ways between them)
        return _find_goodput(placement, latency, unit_rate_requests, slo, config, rel_tol, start_rate, max_probes,
                             max_rate, min_rate, early_stop, early_pass, {} if memo is None else memo)


def _find_goodput(placement: Placement, latency: LatencyModel, unit_rate_requests: Sequence[Request], slo: SLOSpec,
                  config: SimConfig | None, rel_tol: float, start_rate: float | None, max_probes: int,
                  max_rate: float | None, min_rate: float | None, early_stop: bool, early_pass: bool,
                  memo: dict[tuple[float, bool], tuple[SimResult, bool]]) -> GoodputResult:
    if not unit_rate_requests:
        raise InvalidConfigError("the workload has no requests")
    if not 0 < rel_tol < 1:
        raise InvalidConfigError(f"rel_tol must be in (0, 1), got {rel_tol}")
    for name, value in (("max_rate", max_rate), ("min_rate", min_rate)):
        if value is not None and not value > 0:
            raise InvalidConfigError(f"{name} must be > 0, got {value}")
    num_gpus = placement.num_workers
    probes: list[Probe] = []
    results: dict[float, SimResult] = {}
    outcomes: dict[float, bool] = {}  # every simulated rate: the search may ask for one twice
    binding_at: dict[float, str] = {}

    def simulate_at(rate: float, stop: bool) -> tuple[SimResult, bool]:
        """The probe's simulation, and whether it stopped because it is certain to pass."""
        if (rate, stop) not in memo:
            # A fresh Simulation per probe: it validates the placement and owns the run's state.
            stop_when = _MissCounter(len(unit_rate_requests), slo, early_pass) if stop else None
            res = Simulation(placement, latency, config).run(with_rate(unit_rate_requests, rate), stop_when)
            memo[rate, stop] = res, stop_when is not None and stop_when.passed
        return memo[rate, stop]

    def probe(rate: float) -> bool:
        if rate not in outcomes:
            res, passed = simulate_at(rate, early_stop)
            att = attainment(res.records, slo)
            if res.stopped_early and meets(att, slo) != passed:  # (rounding at the bound: never seen)
                res, _ = simulate_at(rate, False)
                att = attainment(res.records, slo)
            outcomes[rate] = meets(att, slo)
            # Which SLO binds, from the requests that finished (all of them unless stopped early).
            done = [r for r in res.records if r.finish_s is not None] if res.stopped_early else None
            binding_at[rate] = binding_slo(attainment(done, slo) if done else att, slo)
            probes.append(Probe(rate, att, outcomes[rate], res.stopped_early))
            results[rate] = res
        return outcomes[rate]

    def complete(rate: float) -> SimResult:
        """The full simulation at a probed rate (its probe's attainment made exact)."""
        if results[rate].stopped_early:
            results[rate], _ = simulate_at(rate, False)
            i = next(i for i, p in enumerate(probes) if p.rate == rate)
            probes[i] = Probe(rate, attainment(results[rate].records, slo), outcomes[rate])
        return results[rate]

    def search(passes: Callable[[float], bool]) -> tuple[float, float]:
        return search_rate(passes, start_rate or float(num_gpus), max_rate, rel_tol, max_probes, max_first=True)

    if min_rate is not None and not _reaches(search, probe, outcomes, min_rate, max_rate):
        failed = min((p for p in probes if not p.meets), key=lambda p: p.rate, default=None)
        # (A loser's ``result`` is left as simulated: possibly stopped early.)
        return GoodputResult(0.0, num_gpus, probes, results[min(results)] if results else None,
                             binding_at[failed.rate] if failed is not None else None, below=min_rate)
    lo, hi = search(probe)
    above = next((p for p in probes if p.rate == hi), None)
    best = results[lo] if lo > 0 else complete(min(results))
    return GoodputResult(
        rate=lo,
        num_gpus=num_gpus,
        probes=probes,
        result=best,
        binding=binding_at[above.rate] if above is not None else None,
    )


def search_rate(passes: Callable[[float], bool], start_rate: float, max_rate: float | None, rel_tol: float,
                max_probes: int, max_first: bool = False) -> tuple[float, float]:
    """The search over an oracle ``passes(rate)``: (lo, hi), the best passing rate and the failing one above it.

    ``lo`` is 0 if no rate passed, ``hi`` inf if none failed. The oracle may be a simulation or a
    measurement of a real server (experiments/bench_serving.py): the search is the same.
    ``max_first``: where the bracket's second probe would be ``max_rate`` (``start_rate`` passing),
    probe ``max_rate`` first: if it passes, the search ends there without ``start_rate``; if not,
    ``start_rate`` is next and the bracket (hence the search) is the one they give in the other
    order — the same (lo, hi) wherever passing ``max_rate`` implies passing ``start_rate``, with a
    probe fewer when the bound is reached (the planner's throughput-capped candidates).
    """
    rate = start_rate if max_rate is None else min(start_rate, max_rate)
    lo, hi = 0.0, math.inf
    num_probes = 0
    if max_first and max_rate is not None and rate < max_rate <= 2.0 * rate:
        num_probes += 1
        if passes(max_rate):
            return max_rate, math.inf
        hi = max_rate
    # Bracket: grow or shrink by 2x until one rate passes and one fails.
    while num_probes < max_probes:
        num_probes += 1
        if passes(rate):
            lo = rate
            if hi < math.inf or (max_rate is not None and rate >= max_rate):
                break
            rate = rate * 2.0 if max_rate is None else min(rate * 2.0, max_rate)
        else:
            hi = rate
            if lo > 0:
                break
            rate /= 2.0
            if rate < 1e-4 * start_rate:
                break
    while lo > 0 and hi < math.inf and (hi - lo) / hi > rel_tol and num_probes < max_probes:
        num_probes += 1
        mid = 0.5 * (lo + hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


_MAX_PATHS = 4096  # beyond this many ways to go, _reaches stops weighing them and lets the search run
_Search = Callable[[Callable[[float], bool]], tuple[float, float]]


class _Unknown(Exception):
    def __init__(self, rate: float) -> None:
        self.rate = rate


def _run_until_unknown(search: _Search, outcomes: dict[float, bool]) -> tuple[float, float] | float:
    """The search's (lo, hi) if ``outcomes`` answer everything it asks, else the first rate they don't."""

    def oracle(rate: float) -> bool:
        if rate in outcomes:
            return outcomes[rate]
        raise _Unknown(rate)

    try:
        return search(oracle)
    except _Unknown as unknown:
        return unknown.rate


def _paths(search: _Search, known: dict[float, bool]) -> list[tuple[float, dict[float, bool]]] | None:
    """Every way the search can still go given the ``known`` outcomes: (its result, the outcomes it assumes)."""
    out: list[tuple[float, dict[float, bool]]] = []
    stack: list[dict[float, bool]] = [{}]
    while stack:
        assumed = stack.pop()
        step = _run_until_unknown(search, {**known, **assumed})
        if isinstance(step, tuple):
            out.append((step[0], assumed))
            continue
        stack += [{**assumed, step: True}, {**assumed, step: False}]
        if len(stack) + len(out) > _MAX_PATHS:
            return None
    return out


def _narrowed(paths: list[tuple[float, dict[float, bool]]], rate: float, outcome: bool) -> list[tuple[float, dict[float, bool]]]:
    """``_paths(search, known)`` from the ``paths`` of ``known`` without ``rate``, now that ``rate``'s
    ``outcome`` is known: the ways that assumed the other outcome go, the rest lose the assumption.
    Exactly ``_paths``' answer, in its order (the search tree with ``rate``'s forks cut to one side,
    walked as before) — and never more than ``_MAX_PATHS`` of them, as those were not."""
    return [(lo, {r: ok for r, ok in assumed.items() if r != rate} if rate in assumed else assumed)
            for lo, assumed in paths if assumed.get(rate, outcome) == outcome]


def _reaches(search: _Search, probe: Callable[[float], bool],
             known: dict[float, bool], min_rate: float, max_rate: float | None) -> bool:
    """Whether ``search(probe)`` ends at or above ``min_rate``, probing only what it takes to know.

    Exact: the outcomes that decide it are the search's own; only the order of the probes differs.
    With a ``max_rate``, each step probes the rate most likely to rule out the probable ways of
    reaching ``min_rate``, under a prior where the goodput lies uniformly between the best known
    pass and the lowest known fail (or 1.5 x ``max_rate``: the search often passes there). So a rate
    just below ``min_rate`` that the search would have to pass is tried early, and rates it would
    surely pass are left for last. Without one, the probes follow the search's own order.
    """
    paths: list[tuple[float, dict[float, bool]]] | None = None
    learned: float | None = None  # the rate probed last (its outcome is in ``known`` now)
    while True:
        if paths is None or learned is None:
            paths = _paths(search, known)
        else:
            paths = _narrowed(paths, learned, known[learned])
        if paths is None:
            return True  # too many to weigh: run the search itself
        wins = [assumed for lo, assumed in paths if lo >= min_rate]
        if not wins:
            return False
        if len(wins) == len(paths):
            return True
        if max_rate is None:
            step = _run_until_unknown(search, known)
            assert not isinstance(step, tuple)  # some ways are still open: the search has not ended
            probe(step)
            learned = step
            continue
        rates = {r for _, assumed in paths for r in assumed}
        top = min((r for r, ok in known.items() if not ok), default=1.5 * max_rate)
        bottom = max((r for r, ok in known.items() if ok and r < top), default=0.0)

        def p_pass(rate: float) -> float:
            return min(0.98, max(0.02, (top - rate) / (top - bottom)))

        def weight(assumed: dict[float, bool]) -> float:
            return math.prod(p_pass(r) if ok else 1.0 - p_pass(r) for r, ok in assumed.items())

        score = dict.fromkeys(rates, 0.0)
        for assumed in wins:
            w = weight(assumed)
            for r, ok in assumed.items():
                score[r] += w * (1.0 - p_pass(r) if ok else p_pass(r))  # the chance that r rules this way out
        learned = max(rates, key=lambda r: (score[r], r))
        probe(learned)
