"""Does the planner's predicted goodput hold when its plan is deployed? A plan for this machine, measured.

Issue acceptance: "a plan for this machine (CPU, the real engine's fitted profile) deploys with
``distserve serve --placement`` and its measured goodput is within 15% of the prediction".

1. Profile the real engine here (``distserve.measure.profiler.profile_engine``, one thread per worker, as
   the Ray workers run) or reuse ``--profile``.
2. Calibrate the runtime's constants as ``validate_simulator.py`` does (``solo_calibration``: one request
   alone on a deployment; the serving process's step-time scale, the per-step overhead and, for
   1P1D, the per-migration overhead). They differ by kind, and ``SimConfig`` holds one set, so
   they are measured on both kinds (``--gpus`` colocated instances; 1P1D) and the planner is run once
   per kind with that kind's overhead: its colocated options from the one run, its disaggregated
   ones from the other. The plan is the best of those by goodput per "GPU", the planner's own rule.
3. Plan ``--gpu cpu --nodes 1 --gpus-per-node N`` for validate_simulator's scaled chatbot workload
   (the unit-rate requests, written to a .jsonl trace), the SLOs, the profile, the scheduler limits
   and KV blocks of the deployment.
4. Deploy the chosen ``Placement`` on the Ray runtime (``DisaggLLM``: what ``distserve serve
   --placement`` runs; node indices the single-node Ray cluster lacks are dropped) and replay the
   same workload open loop (after one uncounted warm-up replay; every replay with freshly drawn
   prompt token ids, as the same ids again would be prefix-cache hits) at rates around the prediction
   ({0.6 ... 1.4} x predicted, extended upwards while the highest passes, downwards while none
   does). Measured goodput: the highest rate meeting the SLO,
   interpolated linearly between the last passing and the first failing rate, after ``--refine``
   bisection steps between those two (each a measured rate) narrow the bracket. The same
   interpolation over the simulated attainments at those rates gives the sweep's own prediction.

The machine is shared and other work disturbs the measurements: before profiling, each calibration
and each measured rate the full run waits until no ``validate_simulator.py``/
``reproduce_distserve.py``/``bench_simulator.py`` runs and processes outside this run's tree use
< ``--max-other-cores``, and redoes a measurement during which either happened (``--retries``).

Writes JSON + markdown + PNG under --out-dir; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

import harness
from distserve.cli.arg_types import fraction, positive_float, positive_int
from distserve.cli.args import latency_type
from distserve.slo import SLO
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.placement import InstanceSpec, Placement
from distserve.planner.report import PlanArgs, run_plan
from distserve.planner.plan import PlanOption, PlanResult
from harness import Outputs, QuietGuard, layout
from simulator.calibration import Calibration, StepTrace, step_diagnostics
from simulator.latency import FittedLatencyModel
from distserve.slo import SLOSpec, attainment, latency_summary
from simulator.simulation import SimConfig, simulate, with_rate
from simulator.workload import Request, generate_requests, rescale, write_trace
from validation import (
    add_profile_args, concurrent_slowdown, fresh_prompts, lengths, make_profile, overrides, rel_err, replay, solo_calibration,
)

TARGET_ERROR = 0.15


def parse_args() -> argparse.Namespace:
    p = harness.parser(__doc__, "tiny model, 12 requests, 3 rates (the test suite's run)")
    add_profile_args(p)
    p.add_argument("--gpus", type=positive_int, default=2, help="'GPUs' (one-thread workers) the plan may use: --gpus-per-node")
    p.add_argument("--kv-cache-gb", type=positive_float, default=0.5, help="KV cache per instance (as validate_simulator)")
    p.add_argument("--num-requests", type=int, default=300,
                   help="requests in the workload (planned and replayed at each rate); enough that a rate above what the "
                        "deployment sustains builds a queue instead of a burst it drains within the SLO slack")
    p.add_argument("--ttft", type=latency_type("--ttft"), default=1.5, help="TTFT SLO (s)")
    p.add_argument("--tpot", type=latency_type("--tpot"), default=0.25, help="TPOT SLO (s)")
    p.add_argument("--attainment", type=fraction, default=0.9)
    p.add_argument("--rate-factors", default="0.6,0.8,1.0,1.2,1.4", help="measured rates, as multiples of the predicted goodput")
    p.add_argument("--max-extra-rates", type=int, default=3, help="rates added while all pass (x1.4) or all fail (/1.4)")
    p.add_argument("--refine", type=int, default=2, help="rates added by bisecting between the last passing and first failing rate")
    harness.add_quiet_args(p, max_wait_s=3600.0, retries=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.model, args.dtype, args.profile_grid = "tiny", "float32", "quick"
        args.num_requests, args.rate_factors, args.max_extra_rates = 12, "0.7,1.0,1.4", 1
        args.refine = 0
        args.kv_cache_gb = 0.02  # ~650 blocks, 10x what 12 requests need: each simulation builds a block manager
        args.ttft, args.tpot = 0.5, 0.1  # loose: a busy CI machine can triple the runtime overhead
    args.factor_list = sorted(float(f) for f in args.rate_factors.split(","))
    if any(f <= 0 for f in args.factor_list) or args.num_requests < 2 or args.gpus < 1:
        p.error("--rate-factors must be positive, --num-requests >= 2 and --gpus >= 1")
    return args


# ---- deployments ---------------------------------------------------------------------------------
def strip_missing_nodes(placement: Placement, num_nodes: int) -> tuple[Placement, list[str]]:
    """The placement with node indices >= ``num_nodes`` dropped (Ray then places those instances)."""
    notes: list[str] = []

    def fix(kind: str, specs: tuple[InstanceSpec, ...]) -> tuple[InstanceSpec, ...]:
        out = []
        for i, s in enumerate(specs):
            if s.node is not None and s.node >= num_nodes:
                notes.append(f"{kind}[{i}] named node {s.node}; this Ray cluster has {num_nodes} node(s): dropped")
                s = replace(s, node=None)
            out.append(s)
        return tuple(out)

    fixed = Placement(fix("prefill", placement.prefill), fix("decode", placement.decode), fix("colocated", placement.colocated),
                      placement.predicted)
    return fixed, notes


def same_layout(a: Placement, b: Placement) -> bool:
    """Same instances and parallelism, whatever the nodes."""
    def key(p: Placement) -> tuple[Any, ...]:
        return tuple(tuple((s.tp, s.pp) for s in specs) for specs in (p.prefill, p.decode, p.colocated))

    return key(a) == key(b)


def deploy(args: argparse.Namespace, placement: Placement, cache: CacheConfig, sched: SchedulerConfig,
           unit: list[Request], rng: np.random.Generator, vocab_size: int) -> Any:
    """A warmed-up deployment: the first steps pay one-off costs (allocator, oneDNN) the profile excluded."""
    from distserve.runtime.llm import DisaggLLM

    # The controller in this process: the calibration's StepTrace instruments it.
    llm = DisaggLLM(args.model, placement, dtype=args.dtype, cache_config=cache, scheduler_config=sched,
                    controller_in_process=True)
    warm = fresh_prompts(unit[:2], rng, vocab_size)
    llm.generate([warm[r.req_id] for r in unit[:2]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    return llm


def calibrate(args: argparse.Namespace, llm: Any, name: str, rng: np.random.Generator,
              latency: FittedLatencyModel, block_size: int) -> Calibration:
    """validate_simulator's calibration (one request alone), with the command line's overrides."""
    with StepTrace(llm.controller) as trace:
        cal, _ = solo_calibration(QuietGuard.from_args(args), llm, trace, name, rng, latency, block_size)
    return overrides(args, cal)


# ---- planning ------------------------------------------------------------------------------------
def plan_for_kind(args: argparse.Namespace, profile_path: str, trace_path: str, config: SimConfig) -> PlanResult:
    plan_args = PlanArgs(model=args.model, gpu="cpu", nodes=1, gpus_per_node=args.gpus, workload=trace_path,
                         ttft_s=args.ttft, tpot_s=args.tpot, attainment=args.attainment, profile=profile_path,
                         seed=args.seed, sim_config=config)
    return run_plan(plan_args, show_progress=False)[1]


def option_row(o: PlanOption, overhead: float) -> dict[str, Any]:
    return {"name": o.name, "layout": layout(o.placement), "num_gpus": o.num_gpus, "rate": o.rate, "per_gpu": o.per_gpu,
            "step_overhead_s": overhead, "predicted_attainment": o.predicted.get("attainment", {}).get("joint")}


# ---- goodput from a sweep --------------------------------------------------------------------------
def sweep_goodput(points: list[tuple[float, float]], target: float) -> tuple[float, str, tuple[float, float]]:
    """Highest rate meeting ``target``: linear between the last passing and the first failing rate.

    Returns the rate, how it was bracketed ("interpolated", "at least" the highest rate when all
    pass, "below" the lowest when none does — then interpolated from attainment 1 at rate 0), and
    the bracket (last passing rate, first failing rate; inf when none fails).
    """
    pts = sorted(points)
    passing = [i for i, (_, a) in enumerate(pts) if a >= target]
    if not passing:
        r, a = pts[0]
        return (r * (1.0 - target) / (1.0 - a) if a < 1.0 else r), "below", (0.0, r)
    i = passing[-1]
    if i == len(pts) - 1:
        return pts[i][0], "at least", (pts[i][0], math.inf)
    (rp, ap), (rf, af) = pts[i], pts[i + 1]
    return rp + (ap - target) / (ap - af) * (rf - rp), "interpolated", (rp, rf)


# ---- main ----------------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    out = Outputs.for_run(args, "validate_planner")
    guard = QuietGuard.from_args(args)
    wall0 = time.perf_counter()
    t = time.perf_counter()
    if args.profile is None:
        profile, _, watch = guard.measure("profile", lambda: make_profile(args))
        profile_other_cores = watch.other_cores
    else:
        profile, profile_other_cores = make_profile(args), math.nan
    latency = FittedLatencyModel.from_profile(profile)
    slowdown = concurrent_slowdown(args, profile)  # the workers share this machine's cores
    fit = profile["tp"]["1"]["fit_error"]
    print(f"profile: {latency!r} fit MAPE prefill {fit['prefill_mape']:.1%} decode {fit['decode_mape']:.1%} "
          f"({time.perf_counter() - t:.0f} s)", flush=True)

    unit = rescale(generate_requests(lengths(args.quick), 1.0, args.num_requests, seed=args.seed), 1.0)
    rng = np.random.default_rng(args.seed + 1)
    vocab = latency.model.vocab_size
    cache = CacheConfig(block_size=16, kv_cache_memory_gb=args.kv_cache_gb)
    sched = SchedulerConfig()
    slo = SLOSpec(SLO(args.ttft, args.tpot, args.attainment))
    import ray

    # The last deployment stays up and serves the measurement if the plan is that placement.
    calibration = {"disaggregated": Placement.disaggregated(1, 1), "colocated": Placement.colocated_instances(args.gpus)}
    calibrations: dict[str, Calibration] = {}
    llm, deployed = None, None
    for kind, placement in calibration.items():
        if llm is not None:
            llm.shutdown()
        llm, deployed = deploy(args, placement, cache, sched, unit, rng, vocab), placement
        calibrations[kind] = calibrate(args, llm, layout(placement), rng, latency, cache.block_size)
    assert llm is not None and deployed is not None
    num_blocks = llm.controller.num_blocks
    overheads = {k: c.step_overhead_s for k, c in calibrations.items()}

    with tempfile.TemporaryDirectory() as tmp:
        profile_path, trace_path = os.path.join(tmp, "profile.json"), os.path.join(tmp, "workload.jsonl")
        Path(profile_path).write_text(json.dumps(profile))
        write_trace(trace_path, unit)
        options: list[tuple[PlanOption, float, SimConfig]] = []
        notes: list[str] = []
        t = time.perf_counter()
        for kind, cal in calibrations.items():
            overhead = cal.step_overhead_s
            config = SimConfig(block_size=cache.block_size, scheduler=sched, prefill_scheduler=sched, decode_scheduler=sched,
                               num_blocks=num_blocks, concurrent_slowdown=slowdown, **asdict(cal))
            result = plan_for_kind(args, profile_path, trace_path, config)
            notes += [f"{kind} run: {n}" for n in result.notes]
            options += [(o, overhead, config) for o in result.options if (o.name == "colocated") == (kind == "colocated")]
        plan_s = time.perf_counter() - t
    options.sort(key=lambda oc: -oc[0].per_gpu)
    for o, overhead, _ in options:
        print(f"  option {o.name}: {layout(o.placement)}, {o.rate:.3g} req/s ({o.per_gpu:.3g} per worker; "
              f"step overhead {1e3 * overhead:.1f} ms)", flush=True)
    if not options:
        llm.shutdown()
        figures = {"model": args.model, "feasible": False, "notes": notes, "wall_s": time.perf_counter() - wall0}
        print("no placement meets the SLO on this machine")
        harness.finish(figures)
        return
    best, plan_overhead, config = options[0]
    predicted = best.rate
    placement, node_notes = strip_missing_nodes(best.placement, len([n for n in ray.nodes() if n["Alive"]]))
    notes += node_notes
    print(f"plan: {best.name}, {layout(placement)}, predicted goodput {predicted:.3g} req/s "
          f"(planning {plan_s:.1f} s)", flush=True)

    if same_layout(placement, deployed):
        deployed_overhead = overheads["colocated" if placement.colocated else "disaggregated"]
    else:
        llm.shutdown()
        llm = deploy(args, placement, cache, sched, unit, rng, vocab)
        deployed_overhead = calibrate(args, llm, layout(placement), rng, latency, cache.block_size).step_overhead_s

    rates = [f * predicted for f in args.factor_list]
    rows: list[dict[str, Any]] = []

    trace = StepTrace(llm.controller)  # every step of a measured run: where the real system spends its time (until shutdown)

    def traced(reqs: list[Request], tag: str) -> list[Any]:
        trace.steps.clear()
        trace.new_run()
        trace.enabled = True
        try:
            # Fresh prompts: the same token ids again would be prefix-cache hits (see validate_simulator).
            return llm.run(replay(llm.controller, reqs, fresh_prompts(reqs, rng, vocab), tag))
        finally:
            trace.enabled = False

    def run_rate(rate: float) -> dict[str, Any]:
        reqs = with_rate(unit, rate)
        t0 = time.perf_counter()
        measured, waited, watch = guard.measure(f"{rate:.3g} req/s", lambda: traced(reqs, f"rate-{rate:.4g}-{time.monotonic()}"))
        seconds = time.perf_counter() - t0 - waited
        sim = simulate(placement, latency, reqs, config)
        row: dict[str, Any] = {"rate": rate, "factor": rate / predicted, "num_requests": len(measured), "seconds": seconds,
                               "waited_s": waited, "own_cores": watch.own_cores, "other_cores": watch.other_cores,
                               "disturbed": watch.other_cores >= args.max_other_cores}
        for side, records in (("measured", measured), ("predicted", sim.records)):
            att, lat = attainment(records, slo), latency_summary(records)
            row[f"{side}_attainment"] = att["joint"]
            row[f"{side}_ttft_attainment"], row[f"{side}_tpot_attainment"] = att["ttft"], att["tpot"]
            row[f"{side}_ttft_p90_s"], row[f"{side}_tpot_p90_s"] = lat["ttft_p90_s"], lat["tpot_p90_s"]
        row.update(step_diagnostics(trace.steps, latency))
        print(f"  {rate:.3g} req/s ({row['factor']:.2f}x): attainment measured {row['measured_attainment']:.0%} "
              f"(TTFT {row['measured_ttft_attainment']:.0%}, TPOT {row['measured_tpot_attainment']:.0%}), predicted "
              f"{row['predicted_attainment']:.0%} (TTFT {row['predicted_ttft_attainment']:.0%}, TPOT "
              f"{row['predicted_tpot_attainment']:.0%}) ({row['seconds']:.0f} s; CPU: this run {watch.own_cores:.2f} cores, "
              f"others {watch.other_cores:.2f}); model time / profile: prefill {row['prefill_execute_over_profile']:.2f}, "
              f"decode {row['decode_execute_over_profile']:.2f}; decode round trip {1e3 * row['decode_round_trip_s']:.1f} ms",
              flush=True)
        return row

    try:
        # The first loaded run on a fresh deployment is slow (new batch shapes, allocator growth) and
        # the 2-request warm-up does not cover it: one uncounted replay at the lowest rate does.
        warm_reqs = with_rate(unit, rates[0])
        warm = llm.run(replay(llm.controller, warm_reqs, fresh_prompts(warm_reqs, rng, vocab), "warm-up"))
        print(f"  warm-up replay at {rates[0]:.3g} req/s (not counted): attainment {attainment(warm, slo)['joint']:.0%}", flush=True)
        rows = [run_rate(r) for r in rates]
        for _ in range(args.max_extra_rates):
            top = max(rows, key=lambda r: r["rate"])
            if top["measured_attainment"] >= args.attainment:  # no failing rate above the passing ones yet
                rows.append(run_rate(top["rate"] * 1.4))
            elif all(r["measured_attainment"] < args.attainment for r in rows):
                rows.append(run_rate(min(r["rate"] for r in rows) / 1.4))
            else:
                break
        for _ in range(args.refine):
            points = sorted((r["rate"], r["measured_attainment"]) for r in rows)
            passing = [i for i, (_, a) in enumerate(points) if a >= args.attainment]
            if not passing or passing[-1] == len(points) - 1:
                break
            rows.append(run_rate(0.5 * (points[passing[-1]][0] + points[passing[-1] + 1][0])))
    finally:
        llm.shutdown()
    rows.sort(key=lambda r: r["rate"])
    measured_goodput, bracket, bracket_rates = sweep_goodput([(r["rate"], r["measured_attainment"]) for r in rows], args.attainment)
    sweep_predicted, sweep_bracket, _ = sweep_goodput([(r["rate"], r["predicted_attainment"]) for r in rows], args.attainment)
    error = rel_err(predicted, measured_goodput)
    figures = {
        "model": args.model,
        "dtype": profile["meta"].get("dtype"),
        "fit_mape": fit,
        "feasible": True,
        "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot, "attainment": args.attainment},
        "num_requests_per_rate": args.num_requests,
        "num_workers": args.gpus,
        "runtime_overhead_s_per_step": overheads,
        "calibration": {k: asdict(c) for k, c in calibrations.items()},
        "concurrent_slowdown": slowdown,
        "deployed_overhead_s_per_step": deployed_overhead,
        "num_blocks": num_blocks,
        "options": [option_row(o, ov) for o, ov, _ in options],
        "plan": {"name": best.name, "layout": layout(placement), "placement": placement.to_dict(),
                 "step_overhead_s": plan_overhead},
        "predicted_goodput_rps": predicted,
        "measured_goodput_rps": measured_goodput,
        "measured_bracket": bracket,
        "measured_bracket_rates": bracket_rates,
        "error_range": [rel_err(predicted, bracket_rates[1]), rel_err(predicted, bracket_rates[0])],
        "sweep_predicted_goodput_rps": sweep_predicted,
        "sweep_predicted_bracket": sweep_bracket,
        "error": error,
        "abs_error": abs(error),
        "target_error": TARGET_ERROR,
        "target_met": bracket == "interpolated" and abs(error) <= TARGET_ERROR,
        "rows": rows,
        "profile_other_cores": profile_other_cores,
        "notes": notes,
        "wall_s": time.perf_counter() - wall0,
    }
    write_outputs(out, figures)
    print(f"predicted goodput {predicted:.3g} req/s, measured {measured_goodput:.3g} req/s ({bracket}): "
          f"error {error:+.1%} (target {TARGET_ERROR:.0%})", flush=True)
    harness.finish(figures)


def write_outputs(out: Outputs, f: dict[str, Any]) -> None:
    out.json(f)
    slo = f["slo"]
    lo, hi = f["measured_bracket_rates"]
    lines = [
        f"# Planner's predicted goodput vs the deployed plan ({f['model']}, {f['dtype']}, this machine)",
        "",
        f"SLO TTFT {slo['ttft_s']} s / TPOT {slo['tpot_s']} s at {slo['attainment']:.0%} (joint); "
        f"{f['num_requests_per_rate']} requests per rate (validate_simulator's scaled chatbot lengths); "
        f"{f['num_workers']} one-thread workers. Profile fit MAPE: prefill {f['fit_mape']['prefill_mape']:.1%}, "
        f"decode {f['fit_mape']['decode_mape']:.1%}. Runtime overhead per step (solo-request calibration): "
        + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in f["runtime_overhead_s_per_step"].items())
        + f"; on the deployed plan {1e3 * f['deployed_overhead_s_per_step']:.1f} ms. Concurrent slowdown (both workers "
        f"computing, the simulator's shared compute): {f['concurrent_slowdown']:.2f}.",
        "",
        "| option (planner) | layout | workers | predicted rate (req/s) | per worker | step overhead used (ms) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for o in f["options"]:
        lines.append(f"| {o['name']} | {o['layout']} | {o['num_gpus']} | {o['rate']:.3g} | {o['per_gpu']:.3g} "
                     f"| {1e3 * o['step_overhead_s']:.1f} |")
    lines += [
        "",
        f"Deployed: **{f['plan']['name']}, {f['plan']['layout']}**. Predicted goodput **{f['predicted_goodput_rps']:.3g} req/s**, "
        f"measured **{f['measured_goodput_rps']:.3g} req/s** ({f['measured_bracket']} between {lo:.3g} and {hi:.3g} req/s): "
        f"error **{f['error']:+.1%}** (between {f['error_range'][0]:+.1%} and {f['error_range'][1]:+.1%}) "
        f"(target ±{f['target_error']:.0%}: {'met' if f['target_met'] else 'not met'}). The simulated attainments at "
        f"the measured rates, interpolated the same way, give {f['sweep_predicted_goodput_rps']:.3g} req/s "
        f"({f['sweep_predicted_bracket']}).",
        "",
        "| rate (req/s) | x predicted | attainment meas / pred | TTFT att. meas / pred | TPOT att. meas / pred "
        "| P90 TTFT ms meas / pred | P90 TPOT ms meas / pred | CPU cores: this run / others "
        "| model time / profile: prefill, decode | decode round trip (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in f["rows"]:
        cells = [f"{r[f'measured_{k}']:.0%} / {r[f'predicted_{k}']:.0%}" for k in ("attainment", "ttft_attainment", "tpot_attainment")]
        cells += [f"{1e3 * r[f'measured_{k}']:.0f} / {1e3 * r[f'predicted_{k}']:.0f}" for k in ("ttft_p90_s", "tpot_p90_s")]
        lines.append(f"| {r['rate']:.3g} | {r['factor']:.2f} | " + " | ".join(cells)
                     + f" | {r['own_cores']:.2f} / {r['other_cores']:.2f}{' (disturbed)' if r['disturbed'] else ''} "
                     f"| {r['prefill_execute_over_profile']:.2f}, {r['decode_execute_over_profile']:.2f} "
                     f"| {1e3 * r['decode_round_trip_s']:.1f} |")
    if f["notes"]:
        lines += ["", "Notes: " + "; ".join(f["notes"])]
    out.markdown(lines)
    fig, ax = harness.pyplot().subplots(figsize=(6, 4))
    rates = [r["rate"] for r in f["rows"]]
    ax.plot(rates, [r["measured_attainment"] for r in f["rows"]], marker="o", label="measured")
    ax.plot(rates, [r["predicted_attainment"] for r in f["rows"]], marker="s", linestyle="--", label="simulated")
    ax.axhline(slo["attainment"], color="grey", linestyle=":", linewidth=1)
    ax.axvline(f["predicted_goodput_rps"], color="tab:orange", linewidth=1, label="planner's goodput")
    ax.axvline(f["measured_goodput_rps"], color="tab:blue", linewidth=1, label="measured goodput")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("SLO attainment (joint)")
    ax.set_title(f"{f['plan']['layout']} ({f['model']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.png(fig, dpi=100)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
