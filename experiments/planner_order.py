"""How much of a plan's time is the order its candidates are searched in? Bound order vs the oracle order.

``distserve plan`` searches each chain of candidates (colocated configs, prefill configs, decode
configs, low-affinity units) best throughput bound per GPU first; a candidate is only searched on while
it may still beat the best found so far (``planner.chains``). A candidate found early that turns out
best makes every later one a cheap loser (one or two failing probes); a high bound that turns out poor
costs a full bisection first. This times, for each setting, the plan in bound order and then again
with every chain ordered by the goodputs per GPU the first run found (the *oracle* order: the best
first), one worker, CPU seconds of this process; and, for reference, the wall time of the bound order with
two workers (``distserve plan``'s default on 2 cores). The plan (every option and its rate) must be the
same; the difference is what a better order could save at most, and the oracle's time is a floor no
reordering alone goes below.

Settings (4 x 8 A100-80G, DistServe's fitted profile, 300 requests per probe, 90% joint): the
chatbot rows ``bench_planner.py`` times, and DistServe's own workloads with its Table 1 SLOs
(``sharegpt-multiturn``, ``humaneval``, ``longbench``). ``--quick``: OPT-13B ``sharegpt-multiturn`` on
1 x 8, 50 requests. Writes JSON + markdown; the last stdout line is the JSON.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import harness
from distserve.planner.chains import Chain, chain_order
from distserve.planner.plan import Candidate, PlanRequest, PlanResult
from distserve.planner.report import PlanArgs, build_request
from distserve.planner.search import Planner
from harness import Outputs
from simulator import DISTSERVE_A100_PROFILE

# (model, workload, TTFT s, TPOT s): bench_planner's two chatbot rows, then DistServe's Table 1 settings.
SETTINGS = [
    ("facebook/opt-13b", "chatbot", 0.25, 0.1),
    ("facebook/opt-66b", "chatbot", 2.5, 0.15),
    ("facebook/opt-13b", "sharegpt-multiturn", 0.25, 0.1),
    ("facebook/opt-66b", "sharegpt-multiturn", 2.5, 0.15),
    ("facebook/opt-66b", "humaneval", 0.125, 0.2),
    ("facebook/opt-66b", "longbench", 15.0, 0.15),
]


def key(cand: Candidate) -> tuple[str, str]:
    return cand.kind, cand.label()


class OracleOrder(Planner):
    """The same search, each chain's candidates ordered by the goodput per GPU an earlier run found."""

    def __init__(self, request: PlanRequest, goodput_per_gpu: dict[tuple[str, str], float]) -> None:
        super().__init__(request)
        self.known = goodput_per_gpu

    def _run(self, chains: list[Chain]) -> None:
        for chain in chains:
            chain.jobs.sort(key=lambda cj: (-self.known.get(key(cj[0]), 0.0), chain_order(cj[0])))
        super()._run(chains)


def timed(planner: Planner) -> tuple[PlanResult, float, float]:
    """The plan, its CPU seconds in this process and its wall seconds."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = planner.plan()
    return result, time.process_time() - cpu0, time.perf_counter() - wall0


def plan_figures(result: PlanResult) -> list[tuple[str, str, float]]:
    return [(o.name, harness.layout(o.placement), o.rate) for o in result.options]


def one(model: str, workload: str, ttft: float, tpot: float, nodes: int, gpus_per_node: int, num_requests: int,
        guard: harness.QuietGuard) -> dict[str, Any]:
    args = PlanArgs(model=model, gpu="a100-80g", nodes=nodes, gpus_per_node=gpus_per_node, workload=workload, ttft_s=ttft,
                    tpot_s=tpot, attainment=0.9, profile=str(DISTSERVE_A100_PROFILE), affinity="auto",
                    num_requests=num_requests, workers=1)
    label = f"{model} {workload}"
    (bound, bound_cpu, _), _, w1 = guard.measure(f"{label}: bound order", lambda: timed(Planner(build_request(args))))
    known = {key(c): c.per_gpu for c in bound.candidates if c.goodput > 0}
    (oracle, oracle_cpu, _), _, w2 = guard.measure(f"{label}: oracle order", lambda: timed(OracleOrder(build_request(args), known)))
    # The CLI's default on 2 cores; its wall time needs the second core idle.
    (two, _, two_wall), _, w3 = guard.measure(f"{label}: two workers", lambda: timed(Planner(build_request(replace(args, workers=2)))))

    def probes(result: PlanResult) -> int:
        return sum(len(c.probes) for c in result.candidates)

    return {
        "model": model, "workload": workload, "ttft_s": ttft, "tpot_s": tpot,
        "best": plan_figures(bound)[0] if bound.options else None,
        "bound_order_cpu_s": bound_cpu, "oracle_order_cpu_s": oracle_cpu, "speedup": bound_cpu / oracle_cpu,
        "bound_order_probes": probes(bound), "oracle_order_probes": probes(oracle),
        "same_plan": plan_figures(bound) == plan_figures(oracle),
        "two_workers_wall_s": two_wall, "two_workers_same_plan": plan_figures(two) == plan_figures(bound),
        "other_cores": [round(w.other_cores, 3) for w in (w1, w2, w3)],  # the rest of the machine, during each
    }


def main() -> None:
    p = harness.parser(__doc__, "OPT-13B sharegpt-multiturn on 1 x 8, 50 requests per probe")
    p.add_argument("--num-requests", type=int, default=300)
    harness.add_quiet_args(p, max_wait_s=600.0, retries=3)
    args = p.parse_args()
    guard = harness.QuietGuard.from_args(args)
    settings, nodes, gpus, n = SETTINGS, 4, 8, args.num_requests
    if args.quick:
        settings, nodes, gpus, n = SETTINGS[2:3], 1, 8, 50
    out = Outputs.for_run(args, "planner_order")
    load = os.getloadavg()[0]
    rows = []
    for model, workload, ttft, tpot in settings:
        row = one(model, workload, ttft, tpot, nodes, gpus, n, guard)
        rows.append(row)
        print(f"{model} {workload}: bound order {row['bound_order_cpu_s']:.2f} s ({row['bound_order_probes']} probes), "
              f"oracle order {row['oracle_order_cpu_s']:.2f} s ({row['oracle_order_probes']}), same plan {row['same_plan']}",
              flush=True)
    figures = {"cluster": f"{nodes} x {gpus} a100-80g", "num_requests": n, "load_avg_at_start": load, "rows": rows,
               "all_same_plan": all(r["same_plan"] and r["two_workers_same_plan"] for r in rows),
               "max_two_workers_wall_s": max(r["two_workers_wall_s"] for r in rows),
               "max_bound_order_cpu_s": max(r["bound_order_cpu_s"] for r in rows),
               "max_oracle_order_cpu_s": max(r["oracle_order_cpu_s"] for r in rows)}
    md = [f"# Planner: candidate order ({figures['cluster']}, {n} requests per probe, one worker, CPU s; load {load:.2f})", "",
          "| model | workload | SLO TTFT / TPOT | plan | bound order: CPU s (probes) | 2 workers: wall s | oracle order: CPU s (probes) | ratio | same plan |",
          "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        best = f"{r['best'][0]}: {r['best'][1]}" if r["best"] else "-"
        md.append(f"| {r['model']} | {r['workload']} | {r['ttft_s']:g} / {r['tpot_s']:g} s | {best} | "
                  f"{r['bound_order_cpu_s']:.2f} ({r['bound_order_probes']}) | {r['two_workers_wall_s']:.2f} | "
                  f"{r['oracle_order_cpu_s']:.2f} ({r['oracle_order_probes']}) | {r['speedup']:.2f}x | "
                  f"{r['same_plan'] and r['two_workers_same_plan']} |")
    out.markdown(md)
    out.json(figures)
    harness.finish(figures)


if __name__ == "__main__":
    main()
