"""DistServe's own setting in our simulator: OPT-13B on one node of 4 A100-80G, chatbot SLOs.

Issue #5, validation part 2. DistServe's simulator README reports, for OPT-13B on ShareGPT with
TTFT 200 ms / TPOT 100 ms at 90%/90% on one node of 4 A100-80G, a best goodput of 1.56 req/s per GPU
with one prefill instance at TP2 and one decode instance at TP1. This script searches the same
space with our simulator (our real schedulers, DistServe's fitted step times):

  * every disaggregated placement that fits 4 GPUs: n_p x (tp_p, pp_p) prefill + n_d x (tp_d, pp_d)
    decode instances, tp in {1, 2, 4} (the profiled tps), pp in {1, 2, 4}, tp*pp <= 4;
  * every colocated placement n x (tp, pp) on <= 4 GPUs (the baseline).

Each placement's goodput is the highest Poisson arrival rate at which 90% of requests meet the
TTFT SLO and 90% meet the TPOT SLO (``mode="separate"``, DistServe's "90%/90%"), found by bisection
on one seeded ShareGPT-like workload replayed at each rate (``simulator.goodput``). The best
placements, and DistServe's own, are searched again with both SLOs required of the same request
(``mode="joint"``), which is stricter.

A finite workload overstates goodput: just past capacity, queues grow slowly and a short run ends
before they hurt. With a fixed number of requests a 4-GPU placement, probed at 4x the rate, gets a
4x shorter run and so the larger bonus (e.g. colocated 4 x TP1: 97% TTFT attainment at 32.6 req/s
with 600 requests, 22% with 2,400). So the workload has ``--requests-per-gpu`` requests per GPU of
the placement (the same seeded stream, so smaller workloads are prefixes of larger ones, and
rescaled to exactly 1 req/s): at equal per-GPU rates every placement is simulated for the same time.

Two stages keep the run to minutes on 2 cores: every placement is first searched on a short
workload (``--screen-requests-per-gpu``, rel_tol 0.1), which ranks them; then the ``--top-k`` best
of each kind (disaggregated, colocated), and DistServe's layout, are searched on the full one.

DistServe's figure is coarse: its search bisects the per-GPU rate on [0, 5] and stops when
hi - lo < 0.25, so 1.56 (= 1.5625) means "between 1.5625 and 1.71875".

Writes JSON + markdown + PNG (SLO attainment vs per-GPU rate of the best placements) under
--out-dir; the last stdout line is the JSON of figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from distserve.cli.arg_types import fraction, positive_float, positive_int
from distserve.cli.args import latency_type
from distserve.slo import SLO, SLOSpec
from distserve.config import SchedulerConfig
from distserve.placement import InstanceSpec, Placement
from harness import Outputs
from simulator import DISTSERVE_A100_PROFILE
from simulator.goodput import find_goodput
from simulator.latency import FittedLatencyModel, LatencyModel, RooflineLatencyModel
from simulator.simulation import SimConfig
from simulator.workload import Request, describe, generate_requests, rescale

MODEL, HARDWARE, NUM_GPUS = "facebook/opt-13b", "a100-80g", 4
TPS, PPS = (1, 2, 4), (1, 2, 4)  # the tps DistServe profiled for OPT-13B
DISTSERVE_PER_GPU = 1.56  # simdistserve/README.md: "Best per GPU rate: 1.56"
DISTSERVE_BRACKET = (1.5625, 1.71875)  # its bisection grid on [0, 5] with esp 0.25
START_PER_GPU = 3.0  # first probe, req/s per GPU; the bracket search doubles or halves from there
SCREEN_REL_TOL = 0.1


# ---- candidates ------------------------------------------------------------------------------
def instance_shapes() -> list[tuple[int, int]]:
    return [(tp, pp) for tp in TPS for pp in PPS if tp * pp <= NUM_GPUS]


def shape_name(n: int, tp: int, pp: int) -> str:
    return f"{n}x(tp{tp}" + (f",pp{pp}" if pp > 1 else "") + ")"


def placement_name(p: Placement) -> str:
    def group(specs: tuple[InstanceSpec, ...]) -> str:
        return shape_name(len(specs), specs[0].tp, specs[0].pp)

    if p.is_disaggregated:
        return f"P {group(p.prefill)} + D {group(p.decode)}"
    return f"colocated {group(p.colocated)}"


def enumerate_placements(num_gpus: int = NUM_GPUS) -> list[Placement]:
    """Every homogeneous-per-role disaggregated placement and every colocated one on <= num_gpus."""
    shapes = instance_shapes()
    out = []
    for tp_p, pp_p in shapes:
        for tp_d, pp_d in shapes:
            for n_p in range(1, num_gpus + 1):
                for n_d in range(1, num_gpus + 1):
                    if n_p * tp_p * pp_p + n_d * tp_d * pp_d <= num_gpus:
                        out.append(Placement.disaggregated(n_p, n_d, tp_p, pp_p, tp_d, pp_d))
    for tp, pp in shapes:
        for n in range(1, num_gpus // (tp * pp) + 1):
            out.append(Placement.colocated_instances(n, tp, pp))
    return out


DISTSERVE_PLACEMENTS = {  # DistServe's reported layout (prefill TP2, decode TP1), as 3 and as 4 GPUs
    "distserve_3gpu": Placement.disaggregated(1, 1, 2, 1, 1, 1),
    "distserve_4gpu": Placement.disaggregated(1, 2, 2, 1, 1, 1),
}
QUICK_PLACEMENTS = [*DISTSERVE_PLACEMENTS.values(), Placement.colocated_instances(1, 1, 1)]


# ---- the search, one placement per task (run in worker processes) ----------------------------
@dataclass(frozen=True)
class SearchSetup:
    """What every worker needs to rebuild the latency model, the workload and the runtime knobs."""

    profile: str | None  # None: the roofline model
    workload: str
    seed: int
    ttft_slo_s: float
    tpot_slo_s: float
    attainment: float
    max_num_seqs: int


_STATE: dict[str, Any] = {}


def build_latency(profile: str | None) -> LatencyModel:
    if profile is None:
        return RooflineLatencyModel(MODEL, HARDWARE)
    return FittedLatencyModel.from_profile(profile, model=MODEL)


def build_requests(setup: SearchSetup, num_requests: int, stream_len: int) -> list[Request]:
    """The first ``num_requests`` of one seeded stream of ``stream_len``, rescaled to exactly 1 request/s."""
    stream = generate_requests(setup.workload, 1.0, stream_len, seed=setup.seed, max_total_len=2048)
    requests = stream[:num_requests]
    return rescale(requests, 1.0) if num_requests > 1 else requests


def sim_config(max_num_seqs: int) -> SimConfig:
    sched = SchedulerConfig(max_num_seqs=max_num_seqs)
    return SimConfig(scheduler=sched, prefill_scheduler=sched, decode_scheduler=sched)


def _init_worker(setup: SearchSetup) -> None:
    _STATE["latency"] = build_latency(setup.profile)
    _STATE["requests"] = {}  # num_requests -> workload
    _STATE["config"] = sim_config(setup.max_num_seqs)
    _STATE["setup"] = setup


@dataclass(frozen=True)
class Task:
    placement: dict[str, Any]
    mode: str  # "separate" | "joint"
    requests_per_gpu: int
    rel_tol: float
    start_rate: float


def search(task: Task) -> dict[str, Any]:
    """find_goodput for one placement under one attainment mode; a plain dict (cheap to pickle)."""
    setup: SearchSetup = _STATE["setup"]
    placement = Placement.from_dict(task.placement)
    num_requests = task.requests_per_gpu * placement.num_workers
    requests = _STATE["requests"].get(num_requests)
    if requests is None:
        stream_len = task.requests_per_gpu * NUM_GPUS
        requests = _STATE["requests"][num_requests] = build_requests(setup, num_requests, stream_len)
    slo = SLOSpec(SLO(setup.ttft_slo_s, setup.tpot_slo_s, setup.attainment), mode=task.mode)
    t0 = time.perf_counter()
    g = find_goodput(
        placement, _STATE["latency"], requests, slo, _STATE["config"], rel_tol=task.rel_tol, start_rate=task.start_rate,
    )
    at_goodput: dict[str, Any] = {}
    if g.result is not None and g.rate > 0:
        s = g.result.summary(slo)
        at_goodput = {
            "attainment": {k: round(v, 4) for k, v in s["attainment"].items()},  # type: ignore[union-attr]
            **{k: round(float(s[k]), 4) for k in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")},  # type: ignore[arg-type]
            "num_preemptions": s["num_preemptions"],
            "utilization": {name: round(i["utilization"], 3) for name, i in g.result.instances.items()},
        }
    return {
        "placement": placement_name(placement),
        "placement_spec": task.placement,
        "kind": "disagg" if placement.is_disaggregated else "colocated",
        "mode": task.mode,
        "num_requests": num_requests,
        "num_gpus": g.num_gpus,
        "rate": round(g.rate, 4),
        "per_gpu": round(g.per_gpu, 4),
        "binding": g.binding,
        "probes": [{"rate": round(p.rate, 4), "meets": p.meets, **{k: round(v, 4) for k, v in p.attainment.items()}} for p in g.probes],
        "at_goodput": at_goodput,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def run_searches(setup: SearchSetup, tasks: list[Task], jobs: int) -> list[dict[str, Any]]:
    """Every task in a pool of ``jobs`` processes; results in task order."""
    def report(r: dict[str, Any]) -> dict[str, Any]:
        print(f"  {r['placement']:<30} {r['mode']:<8} {r['num_requests']:5d} requests: {r['rate']:7.3f} req/s = "
              f"{r['per_gpu']:.3f}/GPU ({len(r['probes'])} probes, {r['wall_s']:.0f} s)", flush=True)
        return r

    if jobs <= 1:
        _init_worker(setup)
        return [report(search(t)) for t in tasks]
    with ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker, initargs=(setup,)) as pool:
        return [report(f.result()) for f in [pool.submit(search, t) for t in tasks]]


# ---- outputs ---------------------------------------------------------------------------------
def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def merge_rows(
    candidates: list[Placement], screen: dict[str, dict[str, Any]], final: dict[str, dict[str, Any]],
    joint: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """One row per placement: searched ones by final goodput/GPU, then the screened-out by screen goodput/GPU."""
    rows = []
    for p in candidates:
        name = placement_name(p)
        f, sc, j = final.get(name), screen.get(name), joint.get(name)
        rows.append({
            "placement": name,
            "kind": "disagg" if p.is_disaggregated else "colocated",
            "num_gpus": p.num_workers,
            "screen_per_gpu": sc["per_gpu"] if sc else None,
            "rate": f["rate"] if f else None,
            "per_gpu": f["per_gpu"] if f else None,
            "binding": (f or sc or {}).get("binding"),
            "per_gpu_joint": j["per_gpu"] if j else None,
            "at_goodput": f["at_goodput"] if f else {},
            "note": "",
        })
    rows.sort(key=lambda r: (r["per_gpu"] is None, -(r["per_gpu"] or 0.0), -(r["screen_per_gpu"] or 0.0), r["num_gpus"], r["placement"]))
    return rows


def mark_notes(rows: list[dict[str, Any]], figures: dict[str, Any]) -> None:
    for r in rows:
        notes = []
        if r["placement"] == figures["best_disagg"]["placement"]:
            notes.append("best disagg")
        if r["placement"] == figures["best_colocated"]["placement"]:
            notes.append("best colocated")
        for key, p in DISTSERVE_PLACEMENTS.items():
            if r["placement"] == placement_name(p):
                notes.append(f"DistServe's ({key.split('_')[1].replace('gpu', ' GPUs')})")
        r["note"] = ", ".join(notes)


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    harness.rich_table(
        title, ["#", "placement", "GPUs", "screen/GPU", "goodput (req/s)", "per GPU", "binding SLO", "per GPU joint", "note"],
        [[str(i), r["placement"], str(r["num_gpus"]), _fmt(r["screen_per_gpu"]), _fmt(r["rate"]), _fmt(r["per_gpu"]),
          r["binding"] or "-", _fmt(r["per_gpu_joint"]), r["note"]] for i, r in enumerate(rows, 1)],
        width=160, left=("placement", "note"),
    )


def write_outputs(out: Outputs, rows: list[dict[str, Any]], searches: list[dict[str, Any]], figures: dict[str, Any]) -> None:
    out.json({"figures": figures, "rows": rows, "searches": searches})
    w = figures["workload_stats"]
    screened = figures["screen_requests_per_gpu"] is not None
    md = [
        f"{figures['model']} on {NUM_GPUS} x {HARDWARE}, latency model: {figures['latency_model']}. "
        f"SLOs: TTFT {figures['ttft_slo_s'] * 1000:.0f} ms, TPOT {figures['tpot_slo_s'] * 1000:.0f} ms, "
        f"{figures['attainment_target']:.0%} of requests each (goodput: `separate`; `joint` = both on the same request).",
        "",
        f"Workload: `{figures['workload']}` Poisson arrivals (seed {figures['seed']}), {figures['requests_per_gpu']} requests "
        f"per GPU of the placement; the 4-GPU stream has prompt mean/p50/p90 {w['prompt_mean']:.0f}/{w['prompt_p50']:.0f}/"
        f"{w['prompt_p90']:.0f} and output mean/p50/p90 {w['output_mean']:.0f}/{w['output_p50']:.0f}/{w['output_p90']:.0f} tokens. "
        f"Runtime limits: max_num_seqs {figures['max_num_seqs']}, max_num_batched_tokens 2048. Bisection rel_tol {figures['rel_tol']}."
        + (f" Screen: all {figures['num_candidates']} placements at {figures['screen_requests_per_gpu']} requests per GPU "
           f"(rel_tol {SCREEN_REL_TOL}); the top {figures['top_k']} of each kind and DistServe's layout "
           f"({figures['num_searched']} placements) searched in full." if screened else "")
        + f" Wall time {figures['wall_s']:.0f} s.",
        "",
        "| # | placement | GPUs | screen/GPU | goodput (req/s) | per GPU | binding SLO | per GPU, joint | TTFT p90 (ms) | TPOT p90 (ms) | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        a = r["at_goodput"]
        ttft = f"{a['ttft_p90_s'] * 1000:.0f}" if a else ""
        tpot = f"{a['tpot_p90_s'] * 1000:.0f}" if a else ""
        md.append(
            f"| {i} | {r['placement']} | {r['num_gpus']} | {_fmt(r['screen_per_gpu'])} | {_fmt(r['rate'])} | "
            f"{_fmt(r['per_gpu'])} | {r['binding'] or '-'} | {_fmt(r['per_gpu_joint'])} | {ttft} | {tpot} | {r['note']} |"
        )
    ours = figures["ours_for_distserve_placement"]
    md += [
        "",
        f"Best disaggregated: {figures['best_disagg']['placement']}, {figures['best_disagg']['per_gpu']:.3f} req/s/GPU; "
        f"best colocated: {figures['best_colocated']['placement']}, {figures['best_colocated']['per_gpu']:.3f} req/s/GPU; "
        f"ratio {_fmt(figures['ratio'])}x.",
        "",
        f"DistServe reports {DISTSERVE_PER_GPU} req/s/GPU (its bisection grid: [{DISTSERVE_BRACKET[0]}, {DISTSERVE_BRACKET[1]})) "
        f"for prefill TP2 + decode TP1; ours for that layout: {ours['distserve_3gpu']['per_gpu']:.3f} (1 + 1, 3 GPUs), "
        f"{ours['distserve_4gpu']['per_gpu']:.3f} (1 + 2, 4 GPUs).",
    ]
    out.markdown(md)

    fig, ax = harness.pyplot().subplots(figsize=(8, 4.5))
    final = {r["placement"]: r for r in searches if r["stage"] == "final"}
    for key, color in (("best_disagg", "tab:blue"), ("best_colocated", "tab:orange")):
        r = final[figures[key]["placement"]]
        probes = sorted(r["probes"], key=lambda p: p["rate"])
        x = [p["rate"] / r["num_gpus"] for p in probes]
        ax.plot(x, [p["ttft"] * 100 for p in probes], marker="o", color=color, label=f"{r['placement']}: TTFT")
        ax.plot(x, [p["tpot"] * 100 for p in probes], marker="s", linestyle="--", color=color, label=f"{r['placement']}: TPOT")
    ax.axhline(figures["attainment_target"] * 100, color="grey", linestyle=":", linewidth=1)
    ax.axvline(DISTSERVE_PER_GPU, color="tab:red", linestyle=":", linewidth=1, label=f"DistServe's {DISTSERVE_PER_GPU}/GPU")
    ax.set(xlabel="arrival rate per GPU (req/s/GPU)", ylabel="SLO attainment (%)", ylim=(0, 105),
           title=f"{figures['model']}, TTFT {figures['ttft_slo_s'] * 1000:.0f} ms / TPOT {figures['tpot_slo_s'] * 1000:.0f} ms, "
                 f"{figures['latency_model'].split('(')[0]}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.png(fig)


# ---- main ------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__, "3 placements, 20 requests per GPU, no screen, rel_tol 0.2, joint mode for the best two only")
    ap.add_argument("--profile", default=str(DISTSERVE_A100_PROFILE), help="DistServe's coefficients file")
    ap.add_argument("--workload", default="chatbot", help="a length spec for simulator.workload.generate_requests")
    ap.add_argument("--requests-per-gpu", type=positive_int, default=300, help="workload size per GPU of the placement")
    ap.add_argument("--screen-requests-per-gpu", type=int, default=100, help="0: no screen, search every placement in full")
    ap.add_argument("--top-k", type=positive_int, default=3, help="placements of each kind the screen passes on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo", type=latency_type("--ttft-slo", allow_inf=True), default=0.2, help="seconds")
    ap.add_argument("--tpot-slo", type=latency_type("--tpot-slo", allow_inf=True), default=0.1, help="seconds")
    ap.add_argument("--attainment", type=fraction, default=0.9)
    ap.add_argument("--max-num-seqs", type=positive_int, default=SchedulerConfig.max_num_seqs)
    ap.add_argument("--rel-tol", type=positive_float, default=0.02, help="bisection stops when (hi - lo) / hi <= this")
    ap.add_argument("--jobs", type=positive_int, default=2, help="worker processes")
    args = ap.parse_args()
    if args.rel_tol >= 1:
        ap.error("--rel-tol must be in (0, 1)")
    if args.screen_requests_per_gpu < 0:
        ap.error(f"--screen-requests-per-gpu must be >= 0 (0: no screen), got {args.screen_requests_per_gpu}")
    if args.quick:
        args.requests_per_gpu, args.screen_requests_per_gpu, args.rel_tol = 20, 0, 0.2
    return args


def main() -> None:
    args = parse_args()
    t_start = time.monotonic()
    profile: str | None = args.profile
    if not Path(args.profile).is_file():
        if not args.quick:
            print(f"error: DistServe's latency profile {args.profile} does not exist; pass --profile PATH "
                  "(DistServe's simdistserve/estimators/profile_data/ coefficients)", file=sys.stderr)
            sys.exit(2)
        print(f"profile {args.profile} not found: --quick falls back to the roofline model", flush=True)
        profile = None
    setup = SearchSetup(
        profile=profile, workload=args.workload, seed=args.seed, ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo,
        attainment=args.attainment, max_num_seqs=args.max_num_seqs,
    )
    latency = build_latency(profile)
    stream_len = args.requests_per_gpu * NUM_GPUS
    workload_stats = {k: round(v, 2) for k, v in describe(build_requests(setup, stream_len, stream_len)).items()}
    candidates = QUICK_PLACEMENTS if args.quick else enumerate_placements()
    by_name = {placement_name(p): p for p in candidates}
    print(f"{len(candidates)} placements, {latency!r}, {args.requests_per_gpu} requests per GPU, {args.jobs} processes", flush=True)

    screen: dict[str, dict[str, Any]] = {}
    if args.screen_requests_per_gpu > 0:
        print(f"screen: {args.screen_requests_per_gpu} requests per GPU, rel_tol {SCREEN_REL_TOL}", flush=True)
        tasks = [Task(p.to_dict(), "separate", args.screen_requests_per_gpu, SCREEN_REL_TOL, START_PER_GPU * p.num_workers)
                 for p in candidates]
        screen = {r["placement"]: {**r, "stage": "screen"} for r in run_searches(setup, tasks, args.jobs)}
        ranked = sorted(screen.values(), key=lambda r: -r["per_gpu"])
        chosen = [r["placement"] for kind in ("disagg", "colocated") for r in [x for x in ranked if x["kind"] == kind][: args.top_k]]
        chosen += [placement_name(p) for p in DISTSERVE_PLACEMENTS.values() if placement_name(p) not in chosen]
    else:
        chosen = list(by_name)

    # A longer run can only hold a rate for longer, so start a little below the screen's goodput.
    print(f"full search: {len(chosen)} placements, {args.requests_per_gpu} requests per GPU, rel_tol {args.rel_tol}", flush=True)
    tasks = [
        Task(by_name[n].to_dict(), "separate", args.requests_per_gpu, args.rel_tol,
             0.8 * screen[n]["rate"] if screen.get(n, {}).get("rate") else START_PER_GPU * by_name[n].num_workers)
        for n in chosen
    ]
    final = {r["placement"]: {**r, "stage": "final"} for r in run_searches(setup, tasks, args.jobs)}
    best = {kind: max((r for r in final.values() if r["kind"] == kind), key=lambda r: r["per_gpu"]) for kind in ("disagg", "colocated")}

    # Joint attainment <= each separate one at the same rate: start from the separate goodput.
    again = [best["disagg"]["placement"], best["colocated"]["placement"]]
    if not args.quick:
        again = list(dict.fromkeys([*again, *(placement_name(p) for p in DISTSERVE_PLACEMENTS.values())]))
    print(f"joint-mode search: {len(again)} placements", flush=True)
    tasks = [Task(by_name[n].to_dict(), "joint", args.requests_per_gpu, args.rel_tol,
                  max(final[n]["rate"], 0.05 * final[n]["num_gpus"])) for n in again]
    joint = {r["placement"]: {**r, "stage": "joint"} for r in run_searches(setup, tasks, args.jobs)}

    def brief(name: str) -> dict[str, Any]:
        r = final[name]
        return {
            "placement": name, "num_gpus": r["num_gpus"], "rate": r["rate"], "per_gpu": r["per_gpu"],
            "binding": r["binding"], "per_gpu_joint": joint[name]["per_gpu"] if name in joint else None,
        }

    ratio = best["disagg"]["per_gpu"] / best["colocated"]["per_gpu"] if best["colocated"]["per_gpu"] > 0 else None
    figures: dict[str, Any] = {
        "model": MODEL,
        "latency_model": repr(latency),
        "profile_used": profile is not None,
        "workload": args.workload,
        "workload_stats": workload_stats,
        "requests_per_gpu": args.requests_per_gpu,
        "screen_requests_per_gpu": args.screen_requests_per_gpu or None,
        "top_k": args.top_k,
        "seed": args.seed,
        "ttft_slo_s": args.ttft_slo,
        "tpot_slo_s": args.tpot_slo,
        "attainment_target": args.attainment,
        "attainment_mode": "separate",
        "max_num_seqs": args.max_num_seqs,
        "rel_tol": args.rel_tol,
        "num_candidates": len(candidates),
        "num_searched": len(final),
        "best_disagg": brief(best["disagg"]["placement"]),
        "best_colocated": brief(best["colocated"]["placement"]),
        "ratio": None if ratio is None else round(ratio, 3),
        "distserve_reported_per_gpu": DISTSERVE_PER_GPU,
        "distserve_reported_bracket": list(DISTSERVE_BRACKET),
        "ours_for_distserve_placement": {key: brief(placement_name(p)) for key, p in DISTSERVE_PLACEMENTS.items()},
    }
    rows = merge_rows(candidates, screen, final, joint)
    mark_notes(rows, figures)
    figures["wall_s"] = round(time.monotonic() - t_start, 1)

    print_table(rows, f"{MODEL}, {NUM_GPUS} GPUs, TTFT {args.ttft_slo * 1000:.0f} ms / TPOT {args.tpot_slo * 1000:.0f} ms "
                      f"at {args.attainment:.0%}/{args.attainment:.0%} ({'fitted' if profile else 'roofline'})")
    ours = figures["ours_for_distserve_placement"]
    print(f"best disagg {best['disagg']['placement']}: {best['disagg']['per_gpu']:.3f} req/s/GPU; "
          f"best colocated {best['colocated']['placement']}: {best['colocated']['per_gpu']:.3f} req/s/GPU; "
          f"ratio {_fmt(ratio)}x")
    print(f"DistServe reports {DISTSERVE_PER_GPU} req/s/GPU for prefill TP2 + decode TP1; ours: "
          f"{ours['distserve_3gpu']['per_gpu']:.3f} (1 + 1, 3 GPUs), {ours['distserve_4gpu']['per_gpu']:.3f} (1 + 2, 4 GPUs)")
    searches = [*screen.values(), *final.values(), *joint.values()]
    write_outputs(Outputs.for_run(args, "reproduce_distserve"), rows, searches, figures)
    harness.finish(figures)


if __name__ == "__main__":
    main()
