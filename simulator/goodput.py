"""Goodput: the highest arrival rate whose SLO attainment meets the target, found by simulation + bisection.

The workload is generated once at unit rate (seeded) and replayed at each probed rate by scaling
its arrival times, so every probe sees the same requests in the same order: the search is
reproducible and attainment is (close to) monotone in the rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from distserve.errors import InvalidConfigError
from distserve.placement.placement import Placement
from simulator.latency import LatencyModel
from simulator.metrics import SimResult, SLOSpec, attainment, meets
from simulator.simulation import SimConfig, Simulation, with_rate
from simulator.workload import Request


@dataclass(frozen=True)
class Probe:
    rate: float
    attainment: dict[str, float]
    meets: bool


@dataclass
class GoodputResult:
    """The best rate found, per GPU, and every probe the search made."""

    rate: float  # requests/s meeting the SLO target (0 if even a trickle misses it)
    num_gpus: int
    probes: list[Probe] = field(default_factory=list)
    result: SimResult | None = None  # the simulation at ``rate`` (at the lowest probe if rate == 0)
    binding: str | None = None  # the SLO that fails first just above ``rate``: "ttft", "tpot" or "both"

    @property
    def per_gpu(self) -> float:
        return self.rate / self.num_gpus


def _binding(att: dict[str, float], slo: SLOSpec) -> str:
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
) -> GoodputResult:
    """Bisection on the arrival rate; ``unit_rate_requests`` arrive at 1 request/s on average.

    ``max_rate`` caps the search (e.g. a throughput bound the deployment cannot sustain beyond,
    however long a finite workload hides it): a probe passing there ends the search.
    """
    if not unit_rate_requests:
        raise InvalidConfigError("the workload has no requests")
    if not 0 < rel_tol < 1:
        raise InvalidConfigError(f"rel_tol must be in (0, 1), got {rel_tol}")
    sim = Simulation(placement, latency, config)  # validates the placement once
    num_gpus = sim.num_gpus
    probes: list[Probe] = []
    results: dict[float, SimResult] = {}

    def probe(rate: float) -> bool:
        res = Simulation(placement, latency, config).run(with_rate(unit_rate_requests, rate))
        att = attainment(res.records, slo)
        ok = meets(att, slo)
        probes.append(Probe(rate, att, ok))
        results[rate] = res
        return ok

    rate = start_rate or float(num_gpus)
    if max_rate is not None:
        if not max_rate > 0:
            raise InvalidConfigError(f"max_rate must be > 0, got {max_rate}")
        rate = min(rate, max_rate)
    lo, hi = 0.0, math.inf
    # Bracket: grow or shrink by 2x until one rate passes and one fails.
    while len(probes) < max_probes:
        if probe(rate):
            lo = rate
            if hi < math.inf or (max_rate is not None and rate >= max_rate):
                break
            rate = rate * 2.0 if max_rate is None else min(rate * 2.0, max_rate)
        else:
            hi = rate
            if lo > 0:
                break
            rate /= 2.0
            if rate < 1e-4 * (start_rate or num_gpus):
                break
    while lo > 0 and hi < math.inf and (hi - lo) / hi > rel_tol and len(probes) < max_probes:
        mid = 0.5 * (lo + hi)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    above = next((p for p in probes if p.rate == hi), None)
    best = results.get(lo) if lo > 0 else results[min(results)]
    return GoodputResult(
        rate=lo,
        num_gpus=num_gpus,
        probes=probes,
        result=best,
        binding=_binding(above.attainment, slo) if above is not None else None,
    )
