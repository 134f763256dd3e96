"""DistServe's reproduction table (issue 18): every model x workload of its evaluation, simulated at A100 scale.

DistServe (OSDI'24) reports, on A100-80G, that its disaggregated layouts serve more requests per GPU
than vLLM within the SLOs of its Table 1: chatbots (ShareGPT) 2.0-4.6x across OPT-13B/66B/175B, code
completion (HumanEval, OPT-66B) 5.7x, summarisation (LongBench, OPT-66B) 4.3x; and that it meets up
to 12.6x tighter SLOs. Per row (``ROWS``) this script measures, with our simulator running our real
schedulers, goodput per GPU of

  * **DistServe's layout**: one prefill + one decode instance with the parallelism of DistServe's
    launch script (``distserve_setting.PARALLEL_PARAMS``: one layout per model, used for every dataset;
    Table 3's per-application layouts for code and summarisation are not in the repository);
  * **the planner's best disaggregated** plan (``distserve.planner``, on ``plan_nodes`` nodes of 8 A100-80G);
  * **vLLM as DistServe ran it**: one colocated instance at vLLM's TP of the launch script, step policy
    ``vllm-2023`` (a step that admits prompts runs only them, whole; decodes pause);
  * **the best colocated ``mixed``** (ours: prompts join the decodes' step), the planner's colocated plan;

and the ratio DistServe-layout / vllm-2023 against the published one (within +-30% and in the same
direction, i.e. > 1). Goodput: the highest Poisson rate at which 90% of requests meet both SLOs
(``joint``: DistServe's plotting script counts a request only if it meets both, ``distserve_setting.MODE``);
``separate`` (90% meet the TTFT SLO and 90% the TPOT SLO) is in the JSON. Each system is measured by
``sweeper.Sweeper`` (``find_goodput``'s bisection) on the first ``--requests-per-gpu`` x GPUs requests of
one seeded stream (``distserve_setting.request_stream``).
SLO-scale curves: attainment vs SLO scale (0.25x-4x of both SLOs) at a fixed per-GPU rate (the lower
of DistServe's and vllm-2023's goodput), DistServe's layout vs vllm-2023 vs the planner's plans; and
each row's SLO scale as DistServe's figure measured it (``eval_slo_scale``: its per-GPU rate and run length).

Step times: DistServe's fitted A100 coefficients (``simulator/data/distserve-a100-80g-profile.json``)
for OPT-13B and OPT-66B; the **roofline model** for OPT-175B (no published coefficients).

Ablations (``ABLATIONS``, each alone; DistServe's layout and vllm-2023 re-measured where it changes
them): sequence cap, KV capacity, DistServe's launch limits, first-turn prompts, the baseline's
engine (vLLM's own fitted step times, ``simulator/data/distserve-a100-80g-vllm-profile.json``; for
OPT-175B, which has none, OPT-66B TP4's vLLM/DistServe step-time ratios applied to the roofline),
6 ms per vLLM step (DistServe's real vLLM traces), both engines as DistServe's real traces show them
(``aligned``), and DistServe's run lengths (``short-runs``: each rate measured on 25-100 prompts per GPU, as
its figures were, the goodput averaged over ``SHORT_RUN_SEEDS`` seeds). For each row outside +-30% or in the wrong
direction the table names the ablations that move the ratio into the published band.

Writes distserve_table.{json,md,png} and distserve_table_slo_scale.png under --out-dir; the last stdout
line is one JSON object of figures. ``--quick``: two rows, 8 requests per GPU, two ablations (seconds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import harness
import simulator  # noqa: F401 - first of ours: the simulator's modules load compiled (distserve.compiled)
from distserve.cli.arg_types import fraction, positive_int
from distserve.placement import Placement
from distserve.slo import SLO
from distserve_setting import ATTAINMENT, MODE, ROWS, Row, request_stream
from distserve_systems import (
    ABLATIONS, ALIGNED, RUN_SEP, UNLIMITED_KV_BLOCKS, Ablation, distserve_config, distserve_placement, has_vllm_fit,
    mean_or_none, row_latency, runs_of, vllm_config,
)
from simulator.simulation import SimConfig
from simulator.workload import describe
from sweep_systems import SimTarget, with_overrides
from distserve_table_report import BAND, OTHER_MODE, _f, gap_text, published_text, within, write_outputs
from sweeper import Sweeper

HARDWARE, GPUS_PER_NODE, MAX_GPUS = "a100-80g", 8, 24  # MAX_GPUS: the stream every workload is a prefix of (>= 21, 175B's layout)
MODES = ["separate", "joint"]
SCALES = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)
PUBLISHED_SLO_SCALE = 12.6  # "up to 12.6x tighter SLOs", over all rows


QUICK_ROWS = ("opt-13b-chatbot", "opt-66b-code")


NEEDED_MAX_S = 0.05  # the extra vLLM overhead per step searched for (needed_vllm_overhead)
NEEDED_ITERATIONS = 7
ASSUMPTIONS = {a.name: a.assumption for a in ABLATIONS}
QUICK_ABLATIONS = ("baseline", "vllm-steps", "aligned")


# ---- one measurement (in a worker process) ------------------------------------------------------
@dataclass(frozen=True)
class Job:
    row: Row
    system: str
    placement: dict[str, Any]
    config: SimConfig
    engine: str  # "distserve" (the row's step times) | "vllm" (vLLM's fitted ones)
    workload: str
    requests_per_gpu: int
    seed: int
    rel_tol: float
    modes: tuple[str, ...] = tuple(MODES)
    scale_rate: float | None = None  # set: an SLO-scale sweep at this per-GPU rate instead of a goodput search
    scales: tuple[float, ...] = SCALES


def measure(job: Job) -> dict[str, Any]:
    placement = Placement.from_dict(job.placement)
    latency, _ = row_latency(job.row.model, job.engine)
    unit = request_stream(job.workload, job.requests_per_gpu * placement.num_workers, job.requests_per_gpu * MAX_GPUS, job.seed)
    slo = SLO(job.row.ttft_s, job.row.tpot_s, ATTAINMENT)
    args = argparse.Namespace(modes=list(job.modes), rel_tol=job.rel_tol, start_per_gpu=0.5)
    sweeper = Sweeper(args, latency, unit, slo)
    target = SimTarget(job.system, "-", placement, job.config)
    t0 = time.perf_counter()
    out = sweeper.scale_sweep(target, job.scale_rate, list(job.scales)) if job.scale_rate is not None else sweeper.rate_sweep(target)
    return {**out, "num_gpus": placement.num_workers, "num_requests": len(unit), "wall_s": round(time.perf_counter() - t0, 2)}


def plan(row: Row, num_requests: int, seed: int) -> dict[str, Any]:
    """The planner's best disaggregated and colocated plans for the row, on ``row.plan_nodes`` x 8 A100-80G."""
    from distserve.planner.report import PlanArgs, run_plan

    _, profile = row_latency(row.model)
    a = PlanArgs(model=row.model, gpu=HARDWARE, nodes=row.plan_nodes, gpus_per_node=GPUS_PER_NODE, workload=row.workload,
                 ttft_s=row.ttft_s, tpot_s=row.tpot_s, attainment=ATTAINMENT, attainment_mode=MODE, profile=profile,
                 num_requests=num_requests, seed=seed)
    t0 = time.perf_counter()
    _, result = run_plan(a, show_progress=False)
    out: dict[str, Any] = {"cluster": f"{row.plan_nodes} x {GPUS_PER_NODE} A100-80G", "num_simulated": result.num_simulated,
                           "wall_s": round(time.perf_counter() - t0, 2)}
    for kind in ("disagg", "colocated"):
        options = [o for o in result.options if (o.name == "colocated") == (kind == "colocated")]
        best = max(options, key=lambda o: o.per_gpu, default=None)
        out[kind] = None if best is None else {
            "name": best.name, "placement": best.placement.to_dict(), "layout": harness.layout(best.placement),
            "predicted_per_gpu": round(best.per_gpu, 4), "step_budget": best.predicted.get("step_budget", "static")}
    return out


def prefill_pipelining(row: Row, num_requests: int, seed: int) -> dict[str, Any] | None:
    """How much of pipelining's ideal gain DistServe's prefill instance gets (pp > 1 only): its prefill-only
    throughput under overload (every prompt queued at once, outputs of one token, no KV limit) over pp times
    that of the same TP without pipeline stages."""
    from simulator.simulation import simulate, with_rate

    tp, pp = row.layout[:2]
    if pp == 1:
        return None
    latency, _ = row_latency(row.model)
    prompts = [replace(r, output_len=1) for r in request_stream(row.workload, num_requests, num_requests, seed)]
    config = SimConfig(num_blocks=UNLIMITED_KV_BLOCKS)  # step times do not depend on memory: TP3 alone need not fit it

    def throughput(stages: int) -> float:
        result = simulate(Placement.disaggregated(1, 1, tp, stages, *row.layout[2:]), latency, with_rate(prompts, 1e4), config)
        return len(result.records) / max(r.first_token_s for r in result.records if r.first_token_s is not None)

    piped, flat = throughput(pp), throughput(1)
    return {"tp": tp, "pp": pp, "requests_per_s": round(piped, 3), "requests_per_s_pp1": round(flat, 3),
            "efficiency": round(piped / (pp * flat), 3)}


def run_jobs(fn: Any, items: list[Any], jobs: int) -> list[Any]:
    if jobs <= 1:
        return [fn(i) for i in items]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(fn, items))


def _plan_job(item: tuple[Row, int, int]) -> dict[str, Any]:
    return plan(*item)


# ---- systems and ablations ---------------------------------------------------------------------
def engine_ratios(row: Row, unit_stats: dict[str, float]) -> tuple[float, float]:
    """vLLM's / DistServe's fitted step time of OPT-66B at TP4 (prefill of the mean prompt; a decode step of
    32 sequences at the mean context): what ``vllm-steps`` scales the roofline by for a model without a vLLM fit."""
    v, _ = row_latency("facebook/opt-66b", "vllm")
    d, _ = row_latency("facebook/opt-66b")
    prompt = round(unit_stats["prompt_mean"])
    ctx = [round(unit_stats["prompt_mean"] + unit_stats["output_mean"] / 2)] * 32
    return v.prefill_time([prompt], 4) / d.prefill_time([prompt], 4), v.decode_time(ctx, 4) / d.decode_time(ctx, 4)


def applies(a: Ablation, row: Row) -> bool:
    return (a.chatbot_workload is None or row.workload == "sharegpt-multiturn") and (not a.pp_as_replicas or row.layout[1] * row.layout[3] > 1)


# Whose runs measure the SLO scale at DistServe's figures' rate (``eval_slo_scale``): both engines as DistServe's traces show
# them on DistServe's run lengths, and the same with vLLM v0.2.3's Ray control plane at TP > 1.
EVAL_SCALE_ABLATIONS = ("aligned+short-runs", "aligned+ray+short-runs")


def eval_slo_scale(row: Row, found: dict[tuple[str, str, str], dict[str, Any]]) -> dict[str, Any] | None:
    """The SLO scale each system needs at DistServe's SLO-scale figure's per-GPU rate (``row.eval_scale_rate``), over the runs
    in ``found`` (one ablation's of ``EVAL_SCALE_ABLATIONS``): each run's tightest scale of both SLOs still meeting the
    attainment, their median, and vllm-2023's median over DistServe's layout's (how much tighter DistServe's layout goes).
    None without those runs."""
    per = {s: [v["min_scale"][MODE] for k, v in sorted(found.items()) if k[0] == row.key and k[2] == s] for s in ("distserve", "vllm-2023")}
    if not all(per.values()):
        return None
    med = {s: statistics.median(v) for s, v in per.items()}
    return {"per_gpu": row.eval_scale_rate, "prompts_per_gpu": row.eval_prompts_per_gpu, "runs": per,
            "median": med, "ratio": ratio(med["vllm-2023"], med["distserve"])}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def needed_vllm_overhead(item: tuple[Job, float, float, float]) -> float | None:
    """The extra per-step overhead of vLLM, on top of the ``aligned`` ablation's (``job``: its vllm-2023 search, which found
    ``vllm`` req/s/GPU), at which DistServe's layout (``distserve`` req/s/GPU) reaches ``target`` times vllm-2023's goodput:
    0 if it already does, None if not even at ``NEEDED_MAX_S`` (bisection, ``NEEDED_ITERATIONS`` steps). What the traces
    would have to miss at this model and TP (they are OPT-13B at TP1) for the published ratio."""
    job, distserve, vllm, target = item

    def reaches(extra_s: float) -> bool:
        cfg = replace(job.config, step_overhead_s=job.config.step_overhead_s + extra_s)
        v = vllm if extra_s == 0 else measure(replace(job, config=cfg, modes=(MODE,)))["per_gpu"][MODE]
        return v <= 0 or distserve / v >= target

    if reaches(0.0):
        return 0.0
    if not reaches(NEEDED_MAX_S):
        return None
    lo, hi = 0.0, NEEDED_MAX_S
    for _ in range(NEEDED_ITERATIONS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi


# ---- main ------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__, f"rows {', '.join(QUICK_ROWS)}; 8 requests per GPU, ablations {', '.join(QUICK_ABLATIONS)}, rel_tol 0.2")
    ap.add_argument("--rows", default=",".join(r.key for r in ROWS), help="comma-separated row keys")
    ap.add_argument("--ablations", default=",".join(a.name for a in ABLATIONS), help="comma-separated names (baseline first)")
    ap.add_argument("--requests-per-gpu", type=positive_int, default=300)
    ap.add_argument("--plan-requests", type=positive_int, default=300, help="the planner's workload size")
    ap.add_argument("--rel-tol", type=fraction, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=positive_int, default=2, help="worker processes")
    ap.add_argument("--render", default=None, metavar="FILE.json", help="only redraw the markdown and PNGs of a saved run, next to it")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.ablations = ",".join(QUICK_ROWS), ",".join(QUICK_ABLATIONS)
        args.requests_per_gpu, args.plan_requests, args.rel_tol, args.jobs = 8, 40, 0.2, 1
    keys = {r.key for r in ROWS}
    args.rows = [k for k in args.rows.split(",") if k]
    args.ablations = [a for a in args.ablations.split(",") if a]
    if bad := [k for k in args.rows if k not in keys]:
        ap.error(f"--rows: unknown {bad}; known: {sorted(keys)}")
    if bad := [a for a in args.ablations if a not in {a.name for a in ABLATIONS}]:
        ap.error(f"--ablations: unknown {bad}")
    if not args.ablations or args.ablations[0] != "baseline":
        ap.error("--ablations must start with baseline")
    if args.rel_tol >= 1:
        ap.error("--rel-tol must be in (0, 1)")
    return args


def render(path: str) -> None:
    """``--render``: the markdown and PNGs of a saved run, from its JSON, next to it."""
    import json
    from pathlib import Path

    data = json.loads(Path(path).read_text())
    for row in data["rows"]:
        row["gap"] = None if row["reproduced"] else gap_text(row)
    out = harness.Outputs(Path(path).parent, Path(path).stem)
    write_outputs(out, data["rows"], data["figures"], ASSUMPTIONS)
    harness.finish({"render": path, "num_rows": len(data["rows"])})


def main() -> None:
    args = parse_args()
    if args.render:
        render(args.render)
        return
    t0 = time.monotonic()
    rows = [r for r in ROWS if r.key in args.rows]
    ablations = [a for a in ABLATIONS if a.name in args.ablations]
    print(f"{len(rows)} rows, {len(ablations)} ablations, {args.jobs} processes", flush=True)

    plans = dict(zip([r.key for r in rows], run_jobs(_plan_job, [(r, args.plan_requests, args.seed) for r in rows], args.jobs)))
    for r in rows:
        p = plans[r.key]
        print(f"{r.key}: planner on {p['cluster']} ({p['wall_s']:.1f} s): disagg {p['disagg'] and p['disagg']['layout']}, "
              f"colocated {p['colocated'] and p['colocated']['layout']}", flush=True)

    pipelining = {r.key: prefill_pipelining(r, 50 if args.quick else 400, args.seed) for r in rows}
    stats = {r.key: describe(request_stream(r.workload, args.requests_per_gpu * MAX_GPUS, args.requests_per_gpu * MAX_GPUS, args.seed))
             for r in rows}
    ratios = {r.key: engine_ratios(r, stats[r.key]) for r in rows}
    # Every goodput search: the four systems at our defaults, then each ablation's pair (DistServe's layout, vllm-2023).
    jobs: dict[tuple[str, str, str], Job] = {}
    common = {"requests_per_gpu": args.requests_per_gpu, "seed": args.seed, "rel_tol": args.rel_tol}
    for r in rows:
        vllm = Placement.colocated_instances(1, r.vllm_tp).to_dict()
        for a in ablations:
            if not applies(a, r):
                continue
            workload = a.chatbot_workload or r.workload
            modes = tuple(MODES) if a.name == "baseline" else (MODE,)
            placement, config = distserve_placement(a, r, distserve_config(a))
            cfg, engine = vllm_config(a, r, ratios[r.key])
            for run, run_common in runs_of(a, r, common):
                jobs[(r.key, run, "distserve")] = Job(r, "distserve", placement.to_dict(), config, "distserve", workload, modes=modes, **run_common)
                jobs[(r.key, run, "vllm-2023")] = Job(r, "vllm-2023", vllm, cfg, engine, workload, modes=modes, **run_common)
        pd, pc = plans[r.key]["disagg"], plans[r.key]["colocated"]
        if pd:
            jobs[(r.key, "baseline", "planner-disagg")] = Job(r, "planner-disagg", pd["placement"], SimConfig(), "distserve", r.workload, **common)
        if pc:
            budget = ([f"colocated.tpot_slo_s={r.tpot_s}"] if pc["step_budget"] == "slo" else []) + [f"colocated.step_budget={pc['step_budget']}"]
            jobs[(r.key, "baseline", "colocated-mixed")] = Job(r, "colocated-mixed", pc["placement"], with_overrides(SimConfig(), budget),
                                                               "distserve", r.workload, **common)
    # Searches an ablation leaves unchanged are shared with the baseline's.
    keys = [k for k in jobs if k[1] == "baseline" or k[2] != "distserve"
            or next(a for a in ablations if a.name == k[1].split(RUN_SEP)[0]).changes_distserve]
    keys.sort(key=lambda k: -Placement.from_dict(jobs[k].placement).num_workers)  # big placements first: the pool ends together
    print(f"{len(keys)} goodput searches", flush=True)
    found = dict(zip(keys, run_jobs(measure, [jobs[k] for k in keys], args.jobs)))

    def per_gpu(key: tuple[str, str, str], mode: str = MODE) -> float | None:
        k = key if key in found else (key[0], "baseline", key[2])
        return found[k]["per_gpu"][mode] if k in found else None

    # What vLLM would have to spend per step more than its traces show for each row's published ratio (aligned otherwise).
    need_rows = [r for r in rows if (r.key, ALIGNED.name, "vllm-2023") in jobs and per_gpu((r.key, ALIGNED.name, "distserve"))]
    needed = dict(zip([r.key for r in need_rows], run_jobs(needed_vllm_overhead, [
        (jobs[(r.key, ALIGNED.name, "vllm-2023")], per_gpu((r.key, ALIGNED.name, "distserve")), per_gpu((r.key, ALIGNED.name, "vllm-2023")),
         r.published[0]) for r in need_rows], args.jobs)))

    # SLO-scale curves at the lower of DistServe's and vllm-2023's goodput per GPU.
    scale_jobs: dict[tuple[str, str], Job] = {}
    for r in rows:
        low = [x for x in (per_gpu((r.key, "baseline", "distserve")), per_gpu((r.key, "baseline", "vllm-2023"))) if x]
        rate = min(low) if low else 0.1
        for s in ("distserve", "vllm-2023", "planner-disagg", "colocated-mixed"):
            if (r.key, "baseline", s) in jobs:
                scale_jobs[(r.key, s)] = replace(jobs[(r.key, "baseline", s)], scale_rate=rate)
    scale_keys = sorted(scale_jobs, key=lambda k: -Placement.from_dict(scale_jobs[k].placement).num_workers)
    scaled = dict(zip(scale_keys, run_jobs(measure, [scale_jobs[k] for k in scale_keys], args.jobs)))
    # SLO scale as DistServe's figures measured it: at their per-GPU rate and run length (the runs of each of
    # EVAL_SCALE_ABLATIONS that is run).
    eval_jobs = {k: replace(j, scale_rate=next(r for r in rows if r.key == k[0]).eval_scale_rate, scales=(1.0,))
                 for k, j in jobs.items() if k[1].split(RUN_SEP)[0] in EVAL_SCALE_ABLATIONS}
    eval_scaled = dict(zip(eval_jobs, run_jobs(measure, list(eval_jobs.values()), args.jobs)))

    out_rows: list[dict[str, Any]] = []
    for r in rows:
        systems = ("distserve", "planner-disagg", "vllm-2023", "colocated-mixed")
        base = {s: found.get((r.key, "baseline", s)) for s in systems}
        ab = {}
        for a in ablations:
            if applies(a, r):
                d, v = (mean_or_none([per_gpu((r.key, run, system)) for run, _ in runs_of(a, r, common)]) for system in ("distserve", "vllm-2023"))
                ab[a.name] = {"distserve": d, "vllm-2023": v, "ratio": ratio(d, v),
                              "vllm_engine": jobs[(r.key, runs_of(a, r, common)[0][0], "vllm-2023")].engine if a.vllm_engine else None}
        rat = ab["baseline"]["ratio"]
        ok = within(rat, r.published)
        min_scale = {s: scaled[(r.key, s)]["min_scale"][MODE] for s in systems if (r.key, s) in scaled}
        row: dict[str, Any] = {
            "key": r.key, "model": r.model, "workload": r.workload, "application": r.application, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
            "latency_model": repr(row_latency(r.model)[0]), "vllm_tp": r.vllm_tp, "distserve_layout": list(r.layout),
            "layout_in_repo": r.layout_in_repo, "plan": plans[r.key], "workload_stats": {k: round(v, 1) for k, v in stats[r.key].items()},
            "per_gpu": {s: b["per_gpu"][MODE] for s, b in base.items() if b},
            f"per_gpu_{OTHER_MODE}": {s: b["per_gpu"][OTHER_MODE] for s, b in base.items() if b},
            "binding": {s: b["binding"][MODE] for s, b in base.items() if b},
            "num_gpus": {s: b["num_gpus"] for s, b in base.items() if b},
            "ratio": rat, f"ratio_{OTHER_MODE}": ratio(base["distserve"]["per_gpu"][OTHER_MODE], base["vllm-2023"]["per_gpu"][OTHER_MODE]),
            "ratio_planner_disagg": ratio(base["planner-disagg"]["per_gpu"][MODE] if base["planner-disagg"] else None, base["vllm-2023"]["per_gpu"][MODE]),
            "ratio_vs_mixed": ratio(base["distserve"]["per_gpu"][MODE], base["colocated-mixed"]["per_gpu"][MODE] if base["colocated-mixed"] else None),
            "published": list(r.published), "reproduced": ok, "same_direction": rat is not None and rat > 1.0,
            "ablations": ab, "scale_rate": scale_jobs[(r.key, "distserve")].scale_rate,
            "slo_scale": {s: scaled[(r.key, s)] for s in systems if (r.key, s) in scaled}, "min_slo_scale": min_scale,
            "slo_scale_ratio": ratio(min_scale.get("vllm-2023"), min_scale.get("distserve")),
            "eval_slo_scale": {name: e for name in EVAL_SCALE_ABLATIONS
                               if (e := eval_slo_scale(r, {k: v for k, v in eval_scaled.items() if k[1].split(RUN_SEP)[0] == name}))},
            "prefill_pipelining": pipelining[r.key],
            "vllm_overhead_needed_ms": None if needed.get(r.key) is None else round(needed[r.key] * 1e3, 1),
            "vllm_overhead_needed_searched": r.key in needed,
        }
        row["gap"] = None if ok else gap_text(row)
        out_rows.append(row)
        print(f"{r.key}: DistServe {_f(row['per_gpu']['distserve'])}/GPU, vllm-2023 {_f(row['per_gpu']['vllm-2023'])}, ratio "
              f"{_f(rat)} (published {published_text(r.published)}): {'reproduced' if ok else 'NOT reproduced'}", flush=True)

    figures: dict[str, Any] = {
        "mode": MODE, "attainment": ATTAINMENT, "requests_per_gpu": args.requests_per_gpu, "plan_requests": args.plan_requests,
        "rel_tol": args.rel_tol, "seed": args.seed, "jobs": args.jobs, "scales": list(SCALES), "ablations": [a.name for a in ablations],
        "num_searches": len(keys) + len(scale_keys), "band": BAND, "published_slo_scale": PUBLISHED_SLO_SCALE,
        "rows": {r["key"]: {"ratio": r["ratio"], "published": r["published"], "reproduced": r["reproduced"],
                            "same_direction": r["same_direction"], "per_gpu": r["per_gpu"],
                            "planner_disagg": r["plan"]["disagg"] and r["plan"]["disagg"]["layout"],
                            "planner_colocated": r["plan"]["colocated"] and r["plan"]["colocated"]["layout"],
                            "slo_scale_ratio": r["slo_scale_ratio"],
                            "eval_slo_scale_ratio": {name: e["ratio"] for name, e in r["eval_slo_scale"].items()}, "prefill_pipelining": r["prefill_pipelining"],
                            "vllm_overhead_needed_ms": r["vllm_overhead_needed_ms"],
                            "ablation_ratios": {a: x["ratio"] for a, x in r["ablations"].items()},
                            "reproduced_by": [a for a, x in r["ablations"].items() if within(x["ratio"], tuple(r["published"]))]}  # type: ignore[arg-type]
                 for r in out_rows},
        "num_reproduced": sum(r["reproduced"] for r in out_rows),
    }
    if any(not has_vllm_fit(r.model) for r in rows):
        figures["vllm_engine_ratios_175b"] = [round(x, 3) for x in next(ratios[r.key] for r in rows if not has_vllm_fit(r.model))]
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    harness.rich_table(f"DistServe reproduction (req/s per GPU, {MODE} {ATTAINMENT:.0%})",
                       ["row", "DistServe", "planner disagg", "vllm-2023", "mixed", "ratio", "published", "reproduced"],
                       [[r["key"], _f(r["per_gpu"].get("distserve")), _f(r["per_gpu"].get("planner-disagg")), _f(r["per_gpu"].get("vllm-2023")),
                         _f(r["per_gpu"].get("colocated-mixed")), _f(r["ratio"]), published_text(tuple(r["published"])),  # type: ignore[arg-type]
                         "yes" if r["reproduced"] else "no"] for r in out_rows], width=140, left=("row",))
    write_outputs(harness.Outputs.for_run(args, "distserve_table"), out_rows, figures, ASSUMPTIONS)
    harness.finish(figures)


if __name__ == "__main__":
    main()
