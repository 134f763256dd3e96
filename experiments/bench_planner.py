"""How long does ``distserve plan`` take? The full search for OPT-66B on 4 x 8 A100-80G, timed.

The setting: OPT-66B, the chatbot workload (ShareGPT's shape), TTFT 2.5 s and TPOT 0.15 s at 90%
(joint), affinity ``auto`` (colocated, high- and low-affinity disaggregated all searched), with
DistServe's fitted A100 profile (``simulator/data/distserve-a100-80g-profile.json``; the roofline
model of the A100 when that file is absent, and the JSON says so). The search is run for every
combination of ``--workers`` (processes simulating candidates) and ``--num-requests`` (requests per
simulated probe), so the trade-off between search time and workload size is visible: more requests
make each goodput estimate steadier and each probe slower.

For each run: wall and CPU time (this process and its workers), the candidates enumerated, how many
were simulated and how many were pruned (by the throughput bound, or because the unloaded latency
already misses the SLO), how many searches stopped early (the candidate could no longer win its
chain: ``planner.chains``' best-first search), the simulations run (bisection probes + each option's verification), how many probes
ended as soon as their SLO verdict was certain, and the chosen plan. Target: <= 10 s on 2 cores (goal <= 1 s) for the CLI's defaults (1 worker, 300 requests).
The machine may be shared: the load average at the start is recorded.

Unless ``--no-reference``, the CLI-default run is repeated with every candidate searched in full
(``PlanRequest.stop_losers=False, stop_probes=False``: every candidate bisected to the end, every
probe simulated to its last request, the search before early stopping): the JSON says whether the
plan and its figures are identical, and how much CPU the early stop saves on the same machine.

Writes JSON + markdown under --out-dir; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness
import simulator  # noqa: F401 - first of ours: the simulator's modules load compiled (distserve.compiled)
from distserve.cli.arg_types import fraction, positive_int
from distserve.cli.args import latency_type
from distserve.planner.report import PlanArgs, build_request
from distserve.planner.plan import PlanResult
from distserve.planner.search import Planner
from harness import Outputs
from simulator import DISTSERVE_A100_PROFILE as DEFAULT_PROFILE
TARGET_S, GOAL_S = 10.0, 1.0
DEFAULT_MODEL = "facebook/opt-66b"
CLI_DEFAULTS = {"workers": 1, "num_requests": 300}


def parse_args() -> argparse.Namespace:
    p = harness.parser(__doc__, "OPT-13B on 1 x 4, 50 requests (the test suite's run)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--gpu", default="a100-80g")
    p.add_argument("--nodes", type=positive_int, default=4)
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--workload", default="chatbot")
    p.add_argument("--ttft", type=latency_type("--ttft"), default=2.5, help="TTFT SLO, seconds")
    p.add_argument("--tpot", type=latency_type("--tpot"), default=0.15, help="TPOT SLO, seconds")
    p.add_argument("--attainment", type=fraction, default=0.9)
    p.add_argument("--affinity", default="auto", choices=["high", "low", "auto"])
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="latency profile JSON (roofline if the file is absent)")
    p.add_argument("--workers", default="1,2", help="comma-separated --workers values to time")
    p.add_argument("--num-requests", default="100,300", help="comma-separated --num-requests values to time")
    p.add_argument("--no-reference", action="store_true", help="skip the full-search reference run")
    args = p.parse_args()
    if args.quick:
        args.model, args.nodes, args.gpus_per_node, args.num_requests = "facebook/opt-13b", 1, 4, "50"
        args.ttft, args.tpot = 0.25, 0.1
    args.workers_list = [int(w) for w in args.workers.split(",")]
    args.num_requests_list = [int(n) for n in args.num_requests.split(",")]
    if min(args.workers_list) < 1 or min(args.num_requests_list) < 2:
        p.error("--workers must be >= 1 and --num-requests >= 2")
    return args


def cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (the worker pool's processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def describe_plan(result: PlanResult) -> dict[str, Any] | None:
    best = result.best
    if best is None:
        return None
    return {"name": best.name, "layout": harness.layout(best.placement), "num_gpus": best.num_gpus, "rate": best.rate, "per_gpu": best.per_gpu,
            "predicted_attainment": best.predicted.get("attainment", {}).get("joint")}


def time_one(args: argparse.Namespace, profile: str | None, workers: int, num_requests: int,
             stop_losers: bool = True) -> dict[str, Any]:
    plan_args = PlanArgs(model=args.model, gpu=args.gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         workload=args.workload, ttft_s=args.ttft, tpot_s=args.tpot, attainment=args.attainment,
                         profile=profile, affinity=args.affinity, num_requests=num_requests, workers=workers)
    t0, c0 = time.perf_counter(), cpu_seconds()
    req = replace(build_request(plan_args), stop_losers=stop_losers, stop_probes=stop_losers)
    t1 = time.perf_counter()
    result = Planner(req).plan()
    t2, c2 = time.perf_counter(), cpu_seconds()
    cands = result.candidates
    by_bound = sum(1 for c in cands if c.skipped and c.skipped.startswith("bound"))
    by_floor = sum(1 for c in cands if c.skipped and not c.skipped.startswith("bound"))
    probes = [len(c.probes) for c in cands if c.probes]
    capped = sum(1 for c in cands if c.probes and c.binding == "throughput")
    return {
        "search": "early stop" if stop_losers else "full",
        "workers": workers,
        "num_requests": num_requests,
        "wall_s": t2 - t0,
        "build_s": t1 - t0,
        "search_s": t2 - t1,
        "cpu_s": c2 - c0,
        "num_enumerated": len(cands),
        "num_candidates_simulated": len(probes),
        "num_pruned_by_bound": by_bound,
        "num_pruned_by_floor": by_floor,
        "num_simulated": result.num_simulated,
        "num_stopped_early": sum(1 for c in cands if c.goodput_below is not None),
        "num_simulations": sum(probes) + len(result.options),
        "num_probes_stopped": sum(c.num_probes_stopped for c in cands),
        "max_probes_per_candidate": max(probes, default=0),
        "num_capped_at_bound": capped,
        "feasible": result.feasible,
        "best": describe_plan(result),
        "options": [{"name": o.name, "num_gpus": o.num_gpus, "rate": o.rate, "per_gpu": o.per_gpu,
                     "predicted": {k: v for k, v in o.predicted.items() if k != "kind"}} for o in result.options],
        "simulated": [{"kind": c.kind, "configuration": c.label(), "num_gpus": c.num_gpus, "bound": c.bound_rate,
                       "goodput": c.goodput, "goodput_below": c.goodput_below, "binding": c.binding,
                       "num_probes": len(c.probes), "num_probes_stopped": c.num_probes_stopped} for c in cands if c.probes],
    }


def main() -> None:
    args = parse_args()
    # Another model's results go next to the default's (bench_planner_opt-13b.*), not over them.
    out = Outputs.for_run(args, "bench_planner", tag="" if args.model == DEFAULT_MODEL else args.model.split("/")[-1].lower())
    profile_used = Path(args.profile).is_file()
    profile = args.profile if profile_used else None
    if not profile_used:
        print(f"profile {args.profile} not found: using the roofline model of {args.gpu}", flush=True)
    load = os.getloadavg()
    settings = [(n, w, True) for n in args.num_requests_list for w in args.workers_list]
    if not args.no_reference:
        n = CLI_DEFAULTS["num_requests"] if CLI_DEFAULTS["num_requests"] in args.num_requests_list else max(args.num_requests_list)
        settings.append((n, CLI_DEFAULTS["workers"], False))
    runs = []
    for num_requests, workers, stop_losers in settings:
        run = time_one(args, profile, workers, num_requests, stop_losers)
        runs.append(run)
        best = run["best"]
        print(f"{run['search']}, workers {workers}, {num_requests} requests: {run['wall_s']:.1f} s wall "
              f"({run['cpu_s']:.1f} s CPU), {run['num_enumerated']} candidates: {run['num_candidates_simulated']} "
              f"simulated ({run['num_stopped_early']} stopped early), {run['num_pruned_by_bound']} pruned by bound, "
              f"{run['num_pruned_by_floor']} by SLO floor; {run['num_simulations']} simulations -> "
              + (f"{best['name']}: {best['layout']}, {best['num_gpus']} GPUs, {best['rate']:.3g} req/s "
                 f"({best['per_gpu']:.3g}/GPU)" if best else "no feasible plan"), flush=True)
    searched = [r for r in runs if r["search"] == "early stop"]
    default = next((r for r in searched if all(r[k] == v for k, v in CLI_DEFAULTS.items())), None)
    fastest = min(searched, key=lambda r: r["wall_s"])
    headline = default or fastest
    full = next((r for r in runs if r["search"] == "full"), None)
    same = next((r for r in searched if full is not None and (r["workers"], r["num_requests"]) == (full["workers"], full["num_requests"])), None)
    reference = None if full is None or same is None else {
        "workers": full["workers"],
        "num_requests": full["num_requests"],
        "full_wall_s": full["wall_s"],
        "full_cpu_s": full["cpu_s"],
        "full_num_simulations": full["num_simulations"],
        "early_stop_wall_s": same["wall_s"],
        "early_stop_cpu_s": same["cpu_s"],
        "early_stop_num_simulations": same["num_simulations"],
        "cpu_saving": 1.0 - same["cpu_s"] / full["cpu_s"],
        # The early stop is exact: the same best plan and every option's rate and predicted figures.
        "identical_plan": same["best"] == full["best"] and same["options"] == full["options"],
    }
    # Workers change the time only (``planner.chains``): the same plan and candidates as one process.
    outcome = ("best", "options", "simulated", "num_simulations", "num_probes_stopped", "num_pruned_by_bound")
    one = {r["num_requests"]: r for r in searched if r["workers"] == 1}
    same_as_one = [all(r[k] == one[r["num_requests"]][k] for k in outcome)
                   for r in searched if r["workers"] > 1 and r["num_requests"] in one]
    figures = {
        "model": args.model,
        "cluster": f"{args.nodes} x {args.gpus_per_node} {args.gpu}",
        "workload": args.workload,
        "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot, "attainment": args.attainment},
        "affinity": args.affinity,
        "profile_used": profile_used,
        "latency_model": "FittedLatencyModel (DistServe profile)" if profile_used else "RooflineLatencyModel",
        "cpu_count": os.cpu_count(),
        "load_avg_at_start": load[0],
        "headline": "cli_defaults" if default else "fastest",
        "wall_s": headline["wall_s"],
        "cpu_s": headline["cpu_s"],
        "num_simulated": headline["num_simulated"],
        "fastest_wall_s": fastest["wall_s"],
        "fastest": {"workers": fastest["workers"], "num_requests": fastest["num_requests"]},
        "target_s": TARGET_S,
        "goal_s": GOAL_S,
        "target_met": headline["wall_s"] <= TARGET_S,
        "goal_met": headline["wall_s"] <= GOAL_S,
        "best": headline["best"],
        "reference": reference,
        "identical_across_workers": all(same_as_one) if same_as_one else None,
        "runs": runs,
    }
    write_outputs(out, figures)
    harness.finish(figures)


def write_outputs(out: Outputs, f: dict[str, Any]) -> None:
    out.json(f)
    slo = f["slo"]
    lines = [
        f"# Planner search time: {f['model']} on {f['cluster']}",
        "",
        f"Workload {f['workload']}, TTFT {slo['ttft_s']} s / TPOT {slo['tpot_s']} s at {slo['attainment']:.0%} (joint), "
        f"affinity {f['affinity']}, latency model: {f['latency_model']}. {f['cpu_count']} cores, load average "
        f"{f['load_avg_at_start']:.1f} at the start (the machine is shared; CPU time is the steadier figure).",
        "",
        f"**{f['wall_s']:.1f} s** ({f['cpu_s']:.1f} s CPU) for the {f['headline'].replace('_', ' ')} run (target {f['target_s']:g} s: "
        f"{'met' if f['target_met'] else 'not met'}; goal {f['goal_s']:g} s: {'met' if f['goal_met'] else 'not met'}); "
        f"fastest run {f['fastest_wall_s']:.1f} s.",
        "",
        "| search | workers | requests/probe | wall s | CPU s | enumerated | simulated | stopped early | pruned (bound) "
        "| pruned (SLO floor) | simulations | probes ended early | max probes/candidate | best plan | GPUs | rate (req/s) | per GPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in f["runs"]:
        b = r["best"] or {"name": "none", "layout": "-", "num_gpus": 0, "rate": 0.0, "per_gpu": 0.0}
        lines.append(
            f"| {r['search']} | {r['workers']} | {r['num_requests']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} "
            f"| {r['num_enumerated']} | {r['num_candidates_simulated']} | {r['num_stopped_early']} "
            f"| {r['num_pruned_by_bound']} | {r['num_pruned_by_floor']} | {r['num_simulations']} | {r['num_probes_stopped']} "
            f"| {r['max_probes_per_candidate']} | {b['name']}: {b['layout']} | {b['num_gpus']} | {b['rate']:.3g} "
            f"| {b['per_gpu']:.3g} |"
        )
    ref = f.get("reference")
    if ref is not None:
        lines += ["", f"Early stop vs full search ({ref['workers']} worker, {ref['num_requests']} requests, same process): "
                  f"{ref['early_stop_cpu_s']:.1f} vs {ref['full_cpu_s']:.1f} s CPU ({ref['cpu_saving']:.0%} less), "
                  f"{ref['early_stop_num_simulations']} vs {ref['full_num_simulations']} simulations; plan and predicted "
                  f"figures {'identical' if ref['identical_plan'] else 'DIFFERENT'}."]
    if f["identical_across_workers"] is not None:
        lines += ["", "More workers, the same search: plan, options, candidates simulated, their goodputs and probe counts "
                  f"{'identical' if f['identical_across_workers'] else 'DIFFERENT'} to one worker's (`planner.chains`)."]
    lines += ["", "Candidates simulated (early-stop run with the most requests, 1st listed worker count; "
              "\"<= x\": the search stopped once the candidate could not win: its goodput is at most x):", "",
              "| kind | configuration | GPUs | throughput bound (req/s) | goodput (req/s) | binding | probes (ended early) |",
              "|---|---|---:|---:|---:|---|---:|"]
    last = max((r for r in f["runs"] if r["search"] == "early stop"), key=lambda r: (r["num_requests"], -r["workers"]))
    for c in last["simulated"]:
        goodput = f"<= {c['goodput_below']:.3g}" if c["goodput_below"] is not None else f"{c['goodput']:.3g}"
        lines.append(f"| {c['kind']} | {c['configuration']} | {c['num_gpus']} | {c['bound']:.3g} | {goodput} "
                     f"| {c['binding'] or '-'} | {c['num_probes']} ({c['num_probes_stopped']}) |")
    out.markdown(lines)


if __name__ == "__main__":
    main()
