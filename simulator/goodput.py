"""Goodput: the highest arrival rate whose SLO attainment meets the target, found by simulation + bisection.

The workload is generated once at unit rate (seeded) and replayed at each probed rate by scaling
its arrival times, so every probe sees the same requests in the same order: the search is
reproducible and attainment is (close to) monotone in the rate.

A caller that only needs the goodput if it reaches some rate passes that rate as ``min_rate``. The
search is unchanged; but first, the probes that decide whether it would end at or above ``min_rate``
are simulated, most decisive first (``rate_search.reaches``), and if it would not, the search stops
there (``below``). The outcome is exactly the full search's. (The planner goes further: it weighs
many candidates' searches at once, ``planner.chains``, with this module's ``probe_at``.)

A probe stops as soon as its verdict is certain (``early_stop``): once more requests have missed
their SLO than the attainment target allows, no later request can make it pass; and, with
``early_pass``, once enough have met it that no later one can make it fail. Its attainment is then
a lower bound (the open requests count as misses) and ``Probe.stopped_early`` says so; the
pass/fail outcome, hence the goodput, is exactly the full simulation's (``binding`` is read off the
requests finished by then, and only failed probes' is reported). The ``SimResult`` a
``GoodputResult`` hands back is a complete run (an early-stopped one is simulated again), except
for a search stopped by ``min_rate``, with ``early_pass`` (a caller that needs only the rates,
as the planner) and where its probe was ``known`` (made elsewhere: then there is none).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from distserve.errors import InvalidConfigError
from distserve.placement import Placement
from distserve.slo import SLOSpec, attainment, max_misses, meets, slo_for_objective
from simulator.latency import LatencyModel
from simulator.metrics import RequestRecord, SimResult
from simulator.rate_search import PartialSearch, reaches, search_rate
from simulator.simulation import SimConfig, Simulation, gc_paused
from simulator.workload import Request

Memo = dict[tuple[float, bool], tuple[SimResult, bool]]  # a search's simulations, by (rate, may stop early)
Known = Mapping[float, tuple["Probe", str]]  # probes made elsewhere, by rate: (the probe, the SLO that binds)


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
    # The simulation at ``rate`` (at the lowest probe if rate == 0), complete — except with ``below``;
    # None if that probe was one of ``known``'s.
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
    memo: Memo | None = None,
    known: Known | None = None,
) -> GoodputResult:
    """Bisection on the arrival rate; ``unit_rate_requests`` arrive at 1 request/s on average.

    ``max_rate`` caps the search (e.g. a throughput bound the deployment cannot sustain beyond,
    however long a finite workload hides it): a probe passing there ends the search.
    ``min_rate``: if the search would find less, stop as soon as that is certain, with ``rate`` 0
    and ``below`` = ``min_rate``; otherwise the result is the same as without it.
    ``early_stop``: end each probe once its verdict is certain to fail (same outcome, less
    simulating); ``early_pass`` also once it is certain to pass (then ``result`` may be a run that
    stopped early: its attainment a lower bound).
    ``memo``: simulations made earlier with the same arguments — by another search with another
    ``min_rate``, or by probes made one at a time (``simulate_probe``'s answers, by rate and whether it
    might stop early) — taken instead of simulating again; the new ones are added to it. A simulation
    is a function of its arguments, so the result is the same as without.
    ``known``: probes made elsewhere with the same arguments (``probe_at``'s, by rate: the probe and the
    SLO that binds), taken as they are — the planner's chains read a candidate's search off the probes
    their workers made (``planner.chains``) without shipping the simulations back.
    """
    with gc_paused():  # (its probes, and weighing the search's ways between them)
        return _find_goodput(placement, latency, unit_rate_requests, slo, config, rel_tol, start_rate, max_probes,
                             max_rate, min_rate, early_stop, early_pass, {} if memo is None else memo, known or {})


def _find_goodput(placement: Placement, latency: LatencyModel, unit_rate_requests: Sequence[Request], slo: SLOSpec,
                  config: SimConfig | None, rel_tol: float, start_rate: float | None, max_probes: int,
                  max_rate: float | None, min_rate: float | None, early_stop: bool, early_pass: bool,
                  memo: Memo, known: Known) -> GoodputResult:
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

    def probe(rate: float) -> bool:
        if rate not in outcomes:
            if rate in known:
                p, binding_at[rate] = known[rate]
            else:
                p, binding_at[rate], results[rate] = probe_at(placement, latency, unit_rate_requests, slo, config, rate,
                                                              early_stop, early_pass, memo)
            outcomes[rate] = p.meets
            probes.append(p)
        return outcomes[rate]

    def complete(rate: float) -> SimResult | None:
        """The full simulation at a probed rate (its probe's attainment made exact); None for a probe
        ``known`` complete (its simulation was made elsewhere)."""
        res = results.get(rate)
        if res is None and not known[rate][0].stopped_early:
            return None
        if res is None or res.stopped_early:
            results[rate] = simulate_probe(placement, latency, unit_rate_requests, slo, config, rate, False, False, memo)[0]
            i = next(i for i, p in enumerate(probes) if p.rate == rate)
            probes[i] = Probe(rate, attainment(results[rate].records, slo), outcomes[rate])
        return results[rate]

    start = start_rate or float(num_gpus)
    if min_rate is not None and not reaches(PartialSearch(start, max_rate, rel_tol, max_probes), probe, min_rate):
        failed = min((p for p in probes if not p.meets), key=lambda p: p.rate, default=None)
        # (A loser's ``result`` is left as simulated: possibly stopped early.)
        return GoodputResult(0.0, num_gpus, probes, results[min(results)] if results else None,
                             binding_at[failed.rate] if failed is not None else None, below=min_rate)
    lo, hi = search_rate(probe, start, max_rate, rel_tol, max_probes, max_first=True)
    above = next((p for p in probes if p.rate == hi), None)
    best = results.get(lo) if lo > 0 else complete(min(outcomes))
    return GoodputResult(
        rate=lo,
        num_gpus=num_gpus,
        probes=probes,
        result=best,
        binding=binding_at[above.rate] if above is not None else None,
    )


def simulate_probe(placement: Placement, latency: LatencyModel, unit_rate_requests: Sequence[Request], slo: SLOSpec,
                   config: SimConfig | None, rate: float, stop: bool, early_pass: bool, memo: Memo) -> tuple[SimResult, bool]:
    """A probe's simulation at ``rate`` (taken from ``memo`` if there, else run and added): ending once its
    verdict is certain to fail if ``stop`` (and to pass, ``early_pass``); and whether it stopped because it passes."""
    if (rate, stop) not in memo:
        # A fresh Simulation per probe: it validates the placement and owns the run's state.
        stop_when = _MissCounter(len(unit_rate_requests), slo, early_pass) if stop else None
        res = Simulation(placement, latency, config).run(unit_rate_requests, stop_when, rate)
        memo[rate, stop] = res, stop_when is not None and stop_when.passed
    return memo[rate, stop]


def probe_at(placement: Placement, latency: LatencyModel, unit_rate_requests: Sequence[Request], slo: SLOSpec,
             config: SimConfig | None, rate: float, early_stop: bool, early_pass: bool, memo: Memo) -> tuple[Probe, str, SimResult]:
    """One probe of a goodput search: whether ``rate`` meets the SLO target, which SLO binds (read off the
    requests finished, all of them unless it stopped early) and the simulation (``simulate_probe``)."""
    res, passed = simulate_probe(placement, latency, unit_rate_requests, slo, config, rate, early_stop, early_pass, memo)
    att = attainment(res.records, slo)
    if res.stopped_early and meets(att, slo) != passed:  # (rounding at the bound: never seen)
        res, _ = simulate_probe(placement, latency, unit_rate_requests, slo, config, rate, False, False, memo)
        att = attainment(res.records, slo)
    done = [r for r in res.records if r.finish_s is not None] if res.stopped_early else None
    binding = binding_slo(attainment(done, slo) if done else att, slo)
    return Probe(rate, att, meets(att, slo), res.stopped_early), binding, res
