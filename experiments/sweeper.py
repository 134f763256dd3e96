"""Measuring one system of an SLO sweep: ``Sweeper`` runs a target (simulated or an endpoint) on one
seeded workload and scores it — goodput per attainment mode (bisection for the knee), attainment on a
grid of rates, and attainment vs SLO scale at a fixed rate. Shared by ``slo_sweep.py`` and
``distserve_table.py``; the targets and the scoring are ``sweep_systems``'.

``args`` is the sweep's options: ``modes``, ``rel_tol``, ``start_per_gpu`` (every target); for an
endpoint also ``probe_requests``, ``seed``, ``request_timeout``, ``min_rate``, ``max_rate``, ``max_probes``.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from distserve.errors import InvalidConfigError
from distserve.measure.benchserve import wait_until_idle
from distserve.measure.loadgen import run_load
from distserve.measure.workload import Workload
from distserve.slo import SLO, SLOSpec, TimedRequest, meets
from simulator.goodput import binding_slo, find_goodput, search_rate
from simulator.latency import LatencyModel
from simulator.simulation import Simulation, with_rate
from simulator.workload import Request
from sweep_systems import MODES, EndpointTarget, SimTarget, min_scale, scaled, scored


class Sweeper:
    """Runs a system's sweeps: simulation or real load, the same workload, the same scoring."""

    def __init__(self, args: argparse.Namespace, latency: LatencyModel | None, unit: list[Request], slo: SLO) -> None:
        self.args, self.latency, self.unit, self.slo = args, latency, unit, slo

    def records(self, target: SimTarget | EndpointTarget, rate: float, scale: float = 1.0) -> tuple[list[TimedRequest], bool]:
        """One full run at ``rate`` req/s: (records, stopped early)."""
        if isinstance(target, SimTarget):
            assert self.latency is not None
            sim = Simulation(target.placement, self.latency, target.config_at(scale))
            return list(sim.run(with_rate(self.unit, rate)).records), False
        return self.load(target, rate, stop_below=None)

    def load(self, target: EndpointTarget, rate: float, stop_below: float | None) -> tuple[list[TimedRequest], bool]:
        wait_until_idle(target.url)
        reqs = self.unit[: self.args.probe_requests]
        # Prompts seeded by (seed, rate): a probe never finds an earlier probe's prompts in the server's prefix cache.
        prompt_seed = int(np.random.SeedSequence([self.args.seed, round(rate * 1e4)]).generate_state(1)[0])
        workload = Workload.replay([(r.arrival_s / rate, r.prompt_len, r.output_len) for r in reqs], seed=self.args.seed,
                                   prompt_seed=prompt_seed, ignore_eos=True, min_tokens=True)
        res = run_load(target.url, self.args.model_name, workload, self.slo, request_timeout_s=self.args.request_timeout,
                       stop_below=stop_below)
        s = res.summary
        if not s.num_completed and s.num_errors:
            raise InvalidConfigError(f"--endpoint {target.name}={target.url}: no request completed: {s.error_kinds}", "endpoint")
        print(f"  {target.name} at {rate:.3g} req/s: {s.num_completed}/{s.num_requests} done, {s.num_errors} errors, "
              f"attainment {s.slo_attainment:.0%}" + (" (stopped early)" if res.stopped_early else ""), flush=True)
        return list(res.requests), res.stopped_early

    def rate_sweep(self, target: SimTarget | EndpointTarget) -> dict[str, Any]:
        """Goodput per mode; the probes (endpoint) or none (sim: ``curve`` adds its grid)."""
        out: dict[str, Any] = {"goodput_rps": {}, "per_gpu": {}, "binding": {}, "knee_per_gpu": {}, "points": []}
        a = self.args
        for mode in a.modes:
            spec = SLOSpec(self.slo, mode=mode)
            if isinstance(target, SimTarget):
                assert self.latency is not None
                g = find_goodput(target.placement, self.latency, self.unit, spec, target.config, rel_tol=a.rel_tol,
                                 start_rate=a.start_per_gpu * target.num_gpus)
                lo, binding = g.rate, g.binding
                hi = min((p.rate for p in g.probes if not p.meets and p.rate > lo), default=math.inf)
            else:
                lo, hi, binding = self._endpoint_search(target, spec, out["points"])
            n = target.num_gpus
            out["goodput_rps"][mode], out["per_gpu"][mode], out["binding"][mode] = lo, lo / n, binding
            out["knee_per_gpu"][mode] = [lo / n, None if math.isinf(hi) else hi / n]
            print(f"{target.name} ({mode}): goodput {lo:.3g} req/s = {lo / n:.3g}/GPU, binding {binding}", flush=True)
        return out

    def _endpoint_search(self, target: EndpointTarget, spec: SLOSpec, points: list[dict[str, Any]]) -> tuple[float, float, str | None]:
        early = self.args.modes == ["joint"]
        seen = {p["rate"]: p for p in points}

        def passes(rate: float) -> bool:
            rate = round(rate, 4)
            if rate < self.args.min_rate:  # a probe there takes too long: counted as failing
                return False
            if rate not in seen:
                records, stopped = self.load(target, rate, self.slo.attainment if early else None)
                seen[rate] = {"rate": rate, "per_gpu": rate / target.num_gpus, "stopped_early": stopped, **scored(records, self.slo)}
                points.append(seen[rate])
            return meets(seen[rate], spec)

        a = self.args
        lo, hi = search_rate(passes, a.start_per_gpu * target.num_gpus, a.max_rate, a.rel_tol, a.max_probes)
        above = seen.get(round(hi, 4)) if math.isfinite(hi) else None
        return lo, hi, binding_slo(above, spec) if above else None

    def curve(self, target: SimTarget, per_gpu_rates: list[float]) -> list[dict[str, Any]]:
        """Full simulations on a grid of per-GPU rates."""
        points = []
        for x in per_gpu_rates:
            records, _ = self.records(target, x * target.num_gpus)
            points.append({"rate": x * target.num_gpus, "per_gpu": x, "stopped_early": False, **scored(records, self.slo)})
        return points

    def scale_sweep(self, target: SimTarget | EndpointTarget, per_gpu: float, scales: list[float]) -> dict[str, Any]:
        """Attainment at each SLO scale at ``per_gpu`` req/s per GPU: one run re-scored (or one per scale)."""
        rate = per_gpu * target.num_gpus
        rerun = isinstance(target, SimTarget) and target.slo_dependent
        base, _ = self.records(target, rate)
        points = [{"scale": s, **scored(self.records(target, rate, s)[0] if rerun and s != 1.0 else base, scaled(self.slo, s))}
                  for s in scales]
        exact = min_scale(base, self.slo) if not rerun else {
            m: min((p["scale"] for p in points if meets(p, SLOSpec(self.slo, mode=m))), default=math.inf) for m in MODES}
        return {"rate": rate, "per_gpu": per_gpu, "rescored": not rerun, "points": points, "min_scale": exact}
