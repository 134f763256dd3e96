"""Does the simulator predict the real engine? Measured vs simulated TTFT/TPOT/attainment on this machine.

1. Profile the real engine here (``distserve.measure.profiler.profile_engine``: ``ModelRunner.execute`` on
   real scheduler plans, one thread, as the Ray workers run; steps re-timed while other processes
   used the CPU) and fit DistServe's latency form. The profile also measures how much a step slows
   down while the other worker computes (``concurrent_slowdown``: the two workers share this
   machine's cores), which the simulator applies to instances computing at the same time.
2. Deploy each system on the Ray runtime (colocated: 1 instance; 1P1D: one prefill and one decode
   instance, KV over gloo; the controller in this process), warm it up with one uncounted replay,
   and replay the same seeded open-loop workload at three arrival rates: token-id prompts of the
   generated lengths, exactly ``output_len`` tokens each (ignore_eos).
3. Simulate the same requests (their actual submission times) on the same placement, with the
   same scheduler limits and KV blocks, and the fitted profile.
4. Print predicted vs measured P50/P90 TTFT and TPOT and SLO attainment, and the relative errors.
   Target: <= 10% error on P90 TTFT and TPOT (goal <= 5%).

No calibration against the validation runs: the simulator sees only the profile, the placement,
the scheduler settings, the requests, and three runtime constants measured beforehand on each
deployment with a single request running alone (``calibrate``): how much slower the model runs in
the serving process than in the profiler (``step_time_scale``), what the Ray runtime adds to every
step (controller → instance actor → controller, ``step_overhead_s``), and what it adds to a KV
migration beyond the link time (``migration_overhead_s``, 1P1D). ``--step-overhead-ms`` sets the
second instead.

Every replay (warm-up, calibration, each rate) sends freshly drawn prompts: the deployment keeps
prefix caching on (the server default), so replaying the same token ids would turn the prefills of
every later run into prefix-cache hits that the simulated workload (no shared prefixes) does not
have. The number of prompt tokens served from the cache is reported (``num_cached_tokens``: 0).

This machine is shared: each calibration and each rate waits for a quiet machine and is measured
again (``--retries``) when other processes used more than ``--max-other-cores`` meanwhile; the
table reports what they used. A step trace (``simulator.calibration.StepTrace``) records every step the controller
applies, with the batch it computed, and compares the real step times with the profile's: how far
the latency model itself is off, apart from the simulation around it. ``--from-raw`` simulates the
measurements of an earlier run again (its ``validate_simulator_raw.json``).

Writes JSON + markdown + PNG under --out-dir; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

import harness
from distserve.cli.arg_types import positive_int
from distserve.cli.args import latency_type
from distserve.slo import SLO
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.placement import Placement
from harness import Outputs, QuietGuard, ms
from simulator.calibration import Calibration, StepTrace, calibrate, step_time_summary
from simulator.latency import FittedLatencyModel
from distserve.slo import SLOSpec, attainment, latency_summary
from simulator.metrics import RequestRecord
from simulator.simulation import SimConfig, simulate, with_rate
from simulator.workload import Request, generate_requests
from validation import (
    add_profile_args, concurrent_slowdown, fresh_prompts, lengths, make_profile, overrides, rel_err, replay, solo_calibration,
)

SYSTEMS = {"colocated": Placement.colocated_instances(1), "1p1d": Placement.disaggregated(1, 1)}
METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")


def parse_args() -> argparse.Namespace:
    p = harness.parser(__doc__, "tiny model, few requests (the test suite's run)")
    add_profile_args(p)
    p.add_argument("--rates", default="0.4,0.8,1.2", help="arrival rates, requests/s")
    p.add_argument("--num-requests", type=positive_int, default=60, help="requests per rate")
    p.add_argument("--ttft", type=latency_type("--ttft"), default=1.0, help="TTFT SLO (s) for attainment")
    p.add_argument("--tpot", type=latency_type("--tpot"), default=0.15, help="TPOT SLO (s) for attainment")
    harness.add_quiet_args(p, max_wait_s=1800.0, retries=2)
    p.add_argument("--recalibrate", action="store_true",
                   help="with --from-raw: compute the calibration again from the stored calibration steps")
    p.add_argument("--from-raw", default=None,
                   help="simulate the measurements of an earlier run (its validate_simulator_raw.json; pass its profile "
                        "with --profile) instead of measuring")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.model, args.dtype, args.profile_grid = "tiny", "float32", "quick"
        # High rates: a quick run only exercises the path, and a replay lasts ~num_requests / rate seconds.
        args.rates, args.num_requests = "8,16,32", 8
        args.ttft, args.tpot = 0.5, 0.05
    args.rate_list = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in args.rate_list) or args.num_requests < 1:
        p.error("--rates must be positive and --num-requests >= 1")
    if args.from_raw and not args.profile:
        p.error("--from-raw needs the run's profile (--profile)")
    return args


def measure(args: argparse.Namespace, name: str, placement: Placement, unit: list[Request], rng: np.random.Generator,
            cache: CacheConfig, sched: SchedulerConfig, latency: FittedLatencyModel,
            ) -> tuple[dict[float, list[RequestRecord]], int, Calibration, dict[str, Any]]:
    """Deploy, warm up, calibrate the runtime constants, replay at every rate (fresh prompts each time,
    on a quiet machine: ``QuietGuard``).

    Returns the records per rate, the KV blocks per instance, the calibration and the diagnostics
    (prefix-cache hits, others' CPU per rate, the step trace and its summary, KV migration times)."""
    from distserve.runtime.llm import DisaggLLM

    guard = QuietGuard.from_args(args)
    vocab = latency.model.vocab_size
    runs: dict[float, list[RequestRecord]] = {}
    cached: list[int] = []
    other_cores: dict[float, float] = {}
    migrations: dict[float, list[float]] = {}
    # The controller in this process: StepTrace listens to its steps.
    with DisaggLLM(args.model, placement, dtype=args.dtype, cache_config=cache, scheduler_config=sched,
                   controller_in_process=True) as llm, StepTrace(llm.controller) as trace:
        num_blocks = llm.controller.num_blocks
        # Warm-up: first steps pay one-off costs (allocator, oneDNN primitives) the profile excluded.
        warm = fresh_prompts(unit[:2], rng, vocab)
        llm.generate([warm[r.req_id] for r in unit[:2]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        calibration, calibration_trace = solo_calibration(guard, llm, trace, name, rng, latency, cache.block_size)
        # One uncounted replay first, at the highest rate: the first step of every new token count
        # costs ~25 ms more (oneDNN builds its kernels per shape; the profile times warm shapes), and
        # the measured runs replay the same prompt lengths, so they then run warm as a server does.
        warm_reqs = with_rate(unit, max(args.rate_list))
        t = time.perf_counter()
        llm.run(replay(llm.controller, warm_reqs, fresh_prompts(warm_reqs, rng, vocab), f"{name}-warm-up"))
        print(f"  {name}: warm-up replay at {max(args.rate_list)} req/s (not counted) in {time.perf_counter() - t:.1f} s", flush=True)
        for rate in args.rate_list:
            reqs = with_rate(unit, rate)
            t = time.perf_counter()

            def run_rate() -> tuple[list[RequestRecord], list[int], list[dict[str, Any]], list[float]]:
                del trace.steps[num_kept:]  # a redone run's steps are not kept
                llm.controller.counters.drain_migration_durations()
                trace.enabled = True
                hits: list[int] = []
                records = llm.run(replay(llm.controller, reqs, fresh_prompts(reqs, rng, vocab), f"{name}-{rate}", hits))
                trace.enabled = False
                return records, hits, trace.steps[num_kept:], llm.controller.counters.drain_migration_durations()

            num_kept = len(trace.steps)
            (runs[rate], hits, _, migrations[rate]), waited, watch = guard.measure(f"{name} at {rate} req/s", run_rate)
            cached += hits
            other_cores[rate] = watch.other_cores
            print(f"  {name} at {rate} req/s: {len(reqs)} requests in {time.perf_counter() - t - waited:.1f} s "
                  f"(CPU: this run {watch.own_cores:.2f} cores, others {watch.other_cores:.2f})", flush=True)
    steps = step_time_summary(trace.steps, latency, overrides(args, calibration))
    for kind, v in steps.items():
        print(f"  {name} {kind} steps: {v['num_steps']}, real/profile step time {v['median_step_over_profile']:.2f} "
              f"(new shape {v['median_step_over_profile_new_shape']:.2f}, seen {v['median_step_over_profile_seen_shape']:.2f}), "
              f"real/simulated step cycle {v['median_cycle_over_simulated']:.2f} (medians)", flush=True)
    diagnostics = {"num_cached_prompt_tokens": int(sum(cached)), "steps": steps, "step_trace": trace.steps,
                   "other_cores": other_cores, "migration_s": migrations, "calibration_trace": calibration_trace}
    return runs, num_blocks, calibration, diagnostics


def from_raw(entry: dict[str, Any], latency: FittedLatencyModel,
             ) -> tuple[dict[float, list[RequestRecord]], int, Calibration, dict[str, Any]]:
    """``measure``'s results, read back from a ``validate_simulator_raw.json`` entry."""
    runs = {float(rate): [RequestRecord(**r) for r in recs] for rate, recs in entry["records"].items()}
    diagnostics = {
        "num_cached_prompt_tokens": entry.get("num_cached_prompt_tokens", 0),
        "other_cores": {float(k): v for k, v in (entry.get("other_cores") or {}).items()},
        "migration_s": {float(k): v for k, v in (entry.get("migration_s") or {}).items()},
        "step_trace": entry.get("step_trace", []),
    }
    cal = Calibration(**entry["calibration"]) if "calibration" in entry else Calibration(float(entry["step_overhead_s"]), 1.0)
    diagnostics["calibration_trace"] = entry.get("calibration_trace", [])
    return runs, int(entry["num_blocks"]), cal, diagnostics


def main() -> None:
    args = parse_args()
    out = Outputs.for_run(args, "validate_simulator")
    wall0 = time.perf_counter()
    t = time.perf_counter()
    profile = make_profile(args)
    profile_s = time.perf_counter() - t
    if not args.profile:
        out.json(profile, "_profile", indent=1)  # reusable: --profile
    latency = FittedLatencyModel.from_profile(profile)
    fit = profile["tp"]["1"]["fit_error"]
    print(f"profile: {latency!r} fit MAPE prefill {fit['prefill_mape']:.1%} decode {fit['decode_mape']:.1%} ({profile_s:.0f} s)", flush=True)

    unit = generate_requests(lengths(args.quick), 1.0, args.num_requests, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    cache = CacheConfig(block_size=16, kv_cache_memory_gb=0.5)
    sched = SchedulerConfig()
    slo = SLOSpec(SLO(args.ttft, args.tpot, 0.9))

    slowdown = concurrent_slowdown(args, profile)
    print(f"concurrent slowdown (step-time factor while both workers compute): {slowdown:.2f}", flush=True)
    rows: list[dict[str, Any]] = []
    calibrations: dict[str, Calibration] = {}
    diagnostics: dict[str, dict[str, Any]] = {}
    raw: dict[str, Any] = {}
    earlier = json.loads(Path(args.from_raw).read_text()) if args.from_raw else None
    for name, placement in SYSTEMS.items():
        if earlier is None:
            runs, num_blocks, cal, diagnostics[name] = measure(args, name, placement, unit, rng, cache, sched, latency)
        else:
            runs, num_blocks, cal, diagnostics[name] = from_raw(earlier[name], latency)
            if args.recalibrate and diagnostics[name]["calibration_trace"]:
                cal = calibrate(diagnostics[name]["calibration_trace"], latency, cache.block_size)
            args.rate_list = list(runs)
        raw[name] = {"num_blocks": num_blocks, "calibration": asdict(cal),
                     "records": {str(rate): [asdict(r) for r in recs] for rate, recs in runs.items()},
                     **{k: diagnostics[name][k] for k in ("num_cached_prompt_tokens", "other_cores", "migration_s", "step_trace",
                                                          "calibration_trace")}}
        cal = overrides(args, cal)
        calibrations[name] = cal
        diagnostics[name]["steps"] = step_time_summary(diagnostics[name]["step_trace"], latency, cal)
        config = SimConfig(block_size=cache.block_size, scheduler=sched, prefill_scheduler=sched, decode_scheduler=sched,
                           num_blocks=num_blocks, concurrent_slowdown=slowdown, **asdict(cal))
        for rate, measured in runs.items():
            # The simulator gets the requests as they were actually submitted.
            actual = [Request(r.req_id, r.arrival_s, r.prompt_len, r.output_len) for r in sorted(measured, key=lambda r: r.arrival_s)]
            shift = actual[0].arrival_s
            actual = [Request(r.req_id, r.arrival_s - shift, r.prompt_len, r.output_len) for r in actual]
            predicted = simulate(placement, latency, actual, config)
            m, s = latency_summary(measured), latency_summary(predicted.records)
            am, ap = attainment(measured, slo), attainment(predicted.records, slo)
            row: dict[str, Any] = {"system": name, "rate": rate, "num_requests": len(measured)}
            for key in METRICS:
                row[f"measured_{key}"], row[f"predicted_{key}"] = m[key], s[key]
                row[f"error_{key}"] = rel_err(s[key], m[key])
            row["measured_attainment"], row["predicted_attainment"] = am["joint"], ap["joint"]
            row["other_cores"] = diagnostics[name]["other_cores"].get(rate, math.nan)
            migrations = diagnostics[name]["migration_s"].get(rate)
            if migrations:
                row["measured_mean_migration_s"], row["predicted_mean_migration_s"] = float(np.mean(migrations)), predicted.mean_migration_s
            rows.append(row)

    p90_errors = [abs(r[f"error_{k}"]) for r in rows for k in ("ttft_p90_s", "tpot_p90_s") if not math.isnan(r[f"error_{k}"])]
    figures = {
        "model": args.model,
        "dtype": profile["meta"].get("dtype"),
        "fit_mape": fit,
        "rates": args.rate_list,
        "num_requests_per_rate": args.num_requests,
        "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot},
        "runtime_overhead_s_per_step": {k: c.step_overhead_s for k, c in calibrations.items()},
        "calibration": {k: asdict(c) for k, c in calibrations.items()},
        "concurrent_slowdown": slowdown,
        "profile_meta": {k: profile["meta"].get(k) for k in ("concurrent_slowdown", "prefill_first_use_extra_s", "quiet_guard",
                                                             "cpu_steal_fraction", "profile_seconds")},
        "num_cached_prompt_tokens": {k: d["num_cached_prompt_tokens"] for k, d in diagnostics.items()},
        "step_times": {k: d["steps"] for k, d in diagnostics.items()},
        "max_abs_p90_error": max(p90_errors) if p90_errors else math.nan,
        "mean_abs_p90_error": float(np.mean(p90_errors)) if p90_errors else math.nan,
        "target_p90_error": 0.10,
        "rows": rows,
        "wall_s": time.perf_counter() - wall0,
    }
    write_outputs(out, rows, figures)
    if earlier is None:  # the raw measurements: --from-raw simulates them again without a rerun
        out.json(raw, "_raw", indent=None)
    print_table(rows)
    harness.finish(figures)


def _errors(r: dict[str, Any]) -> list[str]:
    return [f"{ms(r[f'predicted_{k}'])} / {ms(r[f'measured_{k}'])} ({r[f'error_{k}']:+.0%})" for k in METRICS]


def print_table(rows: list[dict[str, Any]]) -> None:
    harness.rich_table("simulator vs real engine: predicted / measured (ms), relative error",
                       ["system", "rate", "P50 TTFT", "P90 TTFT", "P50 TPOT", "P90 TPOT", "attainment"],
                       [[r["system"], f"{r['rate']:g}", *_errors(r), f"{r['predicted_attainment']:.0%} / {r['measured_attainment']:.0%}"]
                        for r in rows])


def write_outputs(out: Outputs, rows: list[dict[str, Any]], figures: dict[str, Any]) -> None:
    out.json(figures)
    lines = [
        f"# Simulator vs real engine ({figures['model']}, {figures['dtype']}, this machine)",
        "",
        f"Profile fit MAPE: prefill {figures['fit_mape']['prefill_mape']:.1%}, decode {figures['fit_mape']['decode_mape']:.1%}. "
        "Solo-request calibration: "
        + "; ".join(f"{k}: step time x{c['step_time_scale']:.3f} (prefill x{c['prefill_time_scale'] or c['step_time_scale']:.3f}), runtime overhead {1e3 * c['step_overhead_s']:.1f} ms/step, "
                    f"migration overhead {1e3 * c['migration_overhead_s']:.1f} ms" for k, c in figures["calibration"].items()) + ". "
        f"Concurrent slowdown (both workers computing): {figures['concurrent_slowdown']:.2f}. "
        f"Prompt tokens served by the prefix cache: {figures['num_cached_prompt_tokens']}. "
        f"{figures['num_requests_per_rate']} requests per rate. Max |error| of P90 TTFT/TPOT: "
        f"{figures['max_abs_p90_error']:.1%} (mean {figures['mean_abs_p90_error']:.1%}; target 10%).",
        "",
        "| system | rate (req/s) | P50 TTFT ms pred/meas | P90 TTFT ms pred/meas | P50 TPOT ms pred/meas | P90 TPOT ms pred/meas "
        "| attainment pred/meas | others' CPU (cores) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['system']} | {r['rate']:g} | " + " | ".join(_errors(r))
                     + f" | {r['predicted_attainment']:.0%} / {r['measured_attainment']:.0%} | {r.get('other_cores', math.nan):.2f} |")
    lines += ["", "Real step time / the profile's, medians (step trace; new shape = a token count the instance had not run):", "",
              "| system | kind | steps | real/profile | new shape | seen shape | real cycle / simulated step |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for system, kinds in figures["step_times"].items():
        for kind, v in kinds.items():
            if v["num_steps"]:
                lines.append(f"| {system} | {kind} | {v['num_steps']} | {v['median_step_over_profile']:.2f} "
                             f"| {v['median_step_over_profile_new_shape']:.2f} | {v['median_step_over_profile_seen_shape']:.2f} "
                             f"| {v['median_cycle_over_simulated']:.2f} |")
    out.markdown(lines)
    fig, axes = harness.pyplot().subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft_p90_s", "tpot_p90_s")):
        for system, marker in (("colocated", "o"), ("1p1d", "s")):
            sel = [r for r in rows if r["system"] == system]
            rates = [r["rate"] for r in sel]
            ax.plot(rates, [1e3 * r[f"measured_{metric}"] for r in sel], marker=marker, label=f"{system} measured")
            ax.plot(rates, [1e3 * r[f"predicted_{metric}"] for r in sel], marker=marker, linestyle="--", label=f"{system} simulated")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"{metric[:4].upper()} P90 (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.png(fig, dpi=100)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
