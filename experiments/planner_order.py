"""How good is the planner's search order? Best first vs bound order vs an oracle, one worker and two.

``distserve plan`` searches each chain of candidates (colocated configs, prefill configs, decode
configs, low-affinity units) best first (``planner.chains``): the candidate whose goodput per GPU may
still be highest is probed next, each loser only until it certainly loses. This times, for each
setting, one worker, CPU seconds of this process:

* **best first**: the planner as it is;
* **bound order** (the planner before best first, here as a baseline): each chain's candidates in
  turn, best throughput bound per GPU first, each searched only while it may still beat the best
  found so far (``find_goodput``'s ``min_rate``) — a high bound that turns out poor costs a full
  bisection before the true best is found;
* **oracle order**: the bound order's rules with each chain's candidates ordered by the goodputs per
  GPU the best-first run found, its winner first — what a search told the answer in advance costs;

and the best-first plan's wall time with two workers (``distserve plan``'s default on 2 cores). Every
plan (every option and its rate) must be the same.

Settings (4 x 8 A100-80G, DistServe's fitted profile, 300 requests per probe, 90% joint): the
chatbot rows ``bench_planner.py`` times, and DistServe's own workloads with its Table 1 SLOs
(``sharegpt-multiturn``, ``humaneval``, ``longbench``). ``--quick``: OPT-13B ``sharegpt-multiturn`` on
1 x 8, 50 requests. Writes JSON + markdown; the last stdout line is the JSON.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from typing import Any

import harness
import simulator  # noqa: F401 - first of ours: the simulator's modules load compiled (distserve.compiled)
from distserve import compiled
from distserve.cli.arg_types import positive_int
from distserve.planner.chains import Chain, FollowUp, chain_order, evaluate, rounded, run_follow_ups
from distserve.planner.plan import Candidate, PlanRequest, PlanResult
from distserve.planner.report import PlanArgs, build_request
from distserve.planner.search import Planner
from harness import Outputs
from simulator import DISTSERVE_A100_PROFILE

TARGET_PLAN_WALL_S = 2.0  # issue 18: any 4 x 8 plan in <= 2 s on these 2 cores (two workers: `distserve plan`'s default)
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


class InOrder(Planner):
    """The same plan, each chain's candidates searched in turn (the baseline orders above): in chain
    order, or by the goodput per GPU an earlier run found (``known``), best first."""

    def __init__(self, request: PlanRequest, known: dict[tuple[str, str], float] | None = None) -> None:
        super().__init__(request)
        self.known = known

    def _run(self, chains: list[Chain], follow_ups: list[FollowUp]) -> None:
        for chain in chains:
            if self.known is not None:
                chain.jobs.sort(key=lambda cj: (-self.known.get(key(cj[0]), 0.0), chain_order(cj[0])))  # type: ignore[union-attr]
            best = 0.0
            for i, (cand, job) in enumerate(chain.jobs):
                if rounded(cand.bound_rate / cand.num_gpus) <= rounded(best):
                    cand.skipped = f"bound {cand.bound_rate / cand.num_gpus:.3g} req/s/GPU <= best {best:.3g}"
                    continue
                # (the lowest rate that beats the best so far: a tie does not win, as best_of prefers the first)
                min_rate = math.nextafter(best * cand.num_gpus, math.inf) if best > 0 else None
                chain.record(i, evaluate(job, min_rate=min_rate))
                best = max(best, cand.per_gpu)
                self.num_simulated += 1
        run_follow_ups(follow_ups)  # (the options' verification, after every chain)


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
    (best, best_cpu, _), _, w1 = guard.measure(f"{label}: best first", lambda: timed(Planner(build_request(args))))
    (bound, bound_cpu, _), _, w2 = guard.measure(f"{label}: bound order", lambda: timed(InOrder(build_request(args))))
    known = {key(c): c.per_gpu for c in best.candidates if c.goodput > 0}
    (oracle, oracle_cpu, _), _, w3 = guard.measure(f"{label}: oracle order", lambda: timed(InOrder(build_request(args), known)))
    # The CLI's default on 2 cores; its wall time needs the second core idle.
    (two, _, two_wall), _, w4 = guard.measure(f"{label}: two workers", lambda: timed(Planner(build_request(replace(args, workers=2)))))

    def probes(result: PlanResult) -> int:
        return sum(len(c.probes) for c in result.candidates)

    return {
        "model": model, "workload": workload, "ttft_s": ttft, "tpot_s": tpot,
        "best": plan_figures(best)[0] if best.options else None,
        "best_first_cpu_s": best_cpu, "bound_order_cpu_s": bound_cpu, "oracle_order_cpu_s": oracle_cpu,
        "speedup_vs_bound_order": bound_cpu / best_cpu,
        "best_first_probes": probes(best), "bound_order_probes": probes(bound), "oracle_order_probes": probes(oracle),
        "same_plan": plan_figures(best) == plan_figures(bound) == plan_figures(oracle),
        "two_workers_wall_s": two_wall, "two_workers_same_plan": plan_figures(two) == plan_figures(best),
        "other_cores": [round(w.other_cores, 3) for w in (w1, w2, w3, w4)],  # the rest of the machine, during each
    }


def main() -> None:
    p = harness.parser(__doc__, "OPT-13B sharegpt-multiturn on 1 x 8, 50 requests per probe")
    p.add_argument("--num-requests", type=positive_int, default=300)
    harness.add_quiet_args(p, max_wait_s=600.0, retries=3)
    args = p.parse_args()
    guard = harness.QuietGuard.from_args(args)
    settings, nodes, gpus, n = SETTINGS, 4, 8, args.num_requests
    if args.quick:
        settings, nodes, gpus, n = SETTINGS[2:3], 1, 8, 50
    out = Outputs.for_run(args, "planner_order")
    load = os.getloadavg()[0]
    loop_ns = harness.python_loop_ns()
    rows = []
    for model, workload, ttft, tpot in settings:
        row = one(model, workload, ttft, tpot, nodes, gpus, n, guard)
        rows.append(row)
        print(f"{model} {workload}: best first {row['best_first_cpu_s']:.2f} s ({row['best_first_probes']} probes), "
              f"bound order {row['bound_order_cpu_s']:.2f} s ({row['bound_order_probes']}), oracle order "
              f"{row['oracle_order_cpu_s']:.2f} s ({row['oracle_order_probes']}), 2 workers {row['two_workers_wall_s']:.2f} s wall, "
              f"same plan {row['same_plan'] and row['two_workers_same_plan']}", flush=True)
    figures = {"cluster": f"{nodes} x {gpus} a100-80g", "num_requests": n, "load_avg_at_start": load,
               "python_loop_ns": round(loop_ns, 2), "simulator_mode": compiled.mode(), "rows": rows,
               "all_same_plan": all(r["same_plan"] and r["two_workers_same_plan"] for r in rows),
               "max_two_workers_wall_s": max(r["two_workers_wall_s"] for r in rows),
               # issue 18's target: any 4 x 8 plan in <= 2 s on these 2 cores (<= 1: met)
               "target_plan_wall_s": TARGET_PLAN_WALL_S,
               "max_two_workers_wall_of_target": round(max(r["two_workers_wall_s"] for r in rows) / TARGET_PLAN_WALL_S, 3),
               "max_best_first_cpu_s": max(r["best_first_cpu_s"] for r in rows),
               "max_bound_order_cpu_s": max(r["bound_order_cpu_s"] for r in rows),
               "max_oracle_order_cpu_s": max(r["oracle_order_cpu_s"] for r in rows)}
    md = [f"# Planner: search order ({figures['cluster']}, {n} requests per probe, CPU s of one worker; load {load:.2f}; "
          f"Python speed {loop_ns:.1f} ns per loop iteration, `harness.python_loop_ns`; simulator "
          f"{figures['simulator_mode']}, `distserve.compiled`)", "",
          "| model | workload | SLO TTFT / TPOT | plan | best first: CPU s (probes) | 2 workers: wall s | bound order: CPU s (probes) | "
          "bound order / best first | oracle order: CPU s (probes) | same plan |",
          "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        best = f"{r['best'][0]}: {r['best'][1]}" if r["best"] else "-"
        md.append(f"| {r['model']} | {r['workload']} | {r['ttft_s']:g} / {r['tpot_s']:g} s | {best} | "
                  f"{r['best_first_cpu_s']:.2f} ({r['best_first_probes']}) | {r['two_workers_wall_s']:.2f} | "
                  f"{r['bound_order_cpu_s']:.2f} ({r['bound_order_probes']}) | {r['speedup_vs_bound_order']:.2f}x | "
                  f"{r['oracle_order_cpu_s']:.2f} ({r['oracle_order_probes']}) | {r['same_plan'] and r['two_workers_same_plan']} |")
    md += ["", f"Slowest plan with 2 workers: {figures['max_two_workers_wall_s']:.2f} s wall, "
           f"{figures['max_two_workers_wall_of_target']:.0%} of issue 18's {TARGET_PLAN_WALL_S:g} s target (a 4 x 8 plan on 2 cores)."]
    out.markdown(md)
    out.json(figures)
    harness.finish(figures)


if __name__ == "__main__":
    main()
