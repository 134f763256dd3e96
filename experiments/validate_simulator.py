"""Does the simulator predict the real engine? Measured vs simulated TTFT/TPOT/attainment on this machine.

1. Profile the real engine here (``distserve.profiler.profile_engine``: ``ModelRunner.execute`` on
   real scheduler plans, one thread, as the Ray workers run) and fit DistServe's latency form.
2. Deploy each system on the Ray runtime (colocated: 1 instance; 1P1D: one prefill and one decode
   instance, KV over gloo), and replay the same seeded open-loop workload at three arrival rates:
   token-id prompts of the generated lengths, exactly ``output_len`` tokens each (ignore_eos).
3. Simulate the same requests (their actual submission times) on the same placement, with the
   same scheduler limits and KV blocks, and the fitted profile.
4. Print predicted vs measured P50/P90 TTFT and TPOT and SLO attainment, and the relative errors.
   Target: <= 10% error on P90 TTFT and TPOT (goal <= 5%).

No calibration against the validation runs: the simulator sees only the profile, the placement,
the scheduler settings, the requests, and one runtime constant measured beforehand on each
deployment with a single request running alone: its TPOT minus the profile's batch-1 decode step,
i.e. what the Ray runtime adds to every step (controller → instance actor → worker round trips).
``--step-overhead-ms`` sets that constant instead.

Writes JSON + markdown + PNG under --out-dir; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from distserve.config import SLO, CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from distserve.placement.placement import Placement  # noqa: E402
from simulator.latency import FittedLatencyModel  # noqa: E402
from simulator.metrics import RequestRecord, SLOSpec, attainment, latency_summary  # noqa: E402
from simulator.simulation import SimConfig, simulate, with_rate  # noqa: E402
from simulator.workload import Request, chatbot_lengths, generate_requests  # noqa: E402

SYSTEMS = {"colocated": Placement.colocated_instances(1), "1p1d": Placement.disaggregated(1, 1)}
METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")
CALIBRATION_PROMPT, CALIBRATION_OUTPUT = 32, 24


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--profile", default=None, help="reuse a profile JSON from `distserve profile` (default: measure now)")
    p.add_argument("--profile-grid", default="full", choices=["quick", "full"])
    p.add_argument("--rates", default="0.4,0.8,1.2", help="arrival rates, requests/s")
    p.add_argument("--num-requests", type=int, default=60, help="requests per rate")
    p.add_argument("--ttft", type=float, default=1.0, help="TTFT SLO (s) for attainment")
    p.add_argument("--tpot", type=float, default=0.15, help="TPOT SLO (s) for attainment")
    p.add_argument("--step-overhead-ms", type=float, default=None,
                   help="runtime cost per step for the simulator (default: calibrated with one solo request)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, few requests (the test suite's run)")
    p.add_argument("--out-dir", default=str(REPO / "experiments" / "results"))
    args = p.parse_args()
    if args.quick:
        args.model, args.dtype, args.profile_grid = "tiny", "float32", "quick"
        args.rates, args.num_requests = "2,4,8", 12
        args.ttft, args.tpot = 0.5, 0.05
    args.rate_list = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in args.rate_list) or args.num_requests < 1:
        p.error("--rates must be positive and --num-requests >= 1")
    return args


def lengths(quick: bool) -> Any:
    """ShareGPT's shape (chatbot) scaled to what one CPU core serves: prompts / 2, outputs / 8."""
    if quick:
        return chatbot_lengths(prompt_mean=24, prompt_median=16, prompt_max=64, prompt_min=4,
                               output_mean=8, output_median=6, output_max=24, output_min=2)
    return chatbot_lengths(prompt_mean=114, prompt_median=52, prompt_max=512, prompt_min=4,
                           output_mean=28, output_median=20, output_max=128, output_min=2)


def make_profile(args: argparse.Namespace) -> dict[str, Any]:
    if args.profile:
        return json.loads(Path(args.profile).read_text())
    from distserve.profiler import profile_engine

    return profile_engine(args.model, (1,), dtype=args.dtype, threads=1, quick=args.profile_grid == "quick")


async def replay(controller: Any, requests: list[Request], prompts: dict[int, list[int]], tag: str) -> list[RequestRecord]:
    """Open loop: submit each request at its arrival time; record what the client observes."""
    t0 = time.monotonic() + 0.2

    async def one(r: Request) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
        sp = SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        last = None
        async for out in controller.generate(prompts[r.req_id], sp, f"{tag}-{r.req_id}"):
            last = out
        assert last is not None
        m = last.metrics
        return RequestRecord(
            r.req_id, m.arrival_time - t0, r.prompt_len, r.output_len,
            first_token_s=None if m.first_token_time is None else m.first_token_time - t0,
            finish_s=None if m.finish_time is None else m.finish_time - t0,
            num_output_tokens=m.num_output_tokens,
        )

    return list(await asyncio.gather(*(one(r) for r in requests)))


def measure(args: argparse.Namespace, name: str, placement: Placement, unit: list[Request], prompts: dict[int, list[int]],
            cache: CacheConfig, sched: SchedulerConfig, latency: FittedLatencyModel,
            ) -> tuple[dict[float, list[RequestRecord]], int, float]:
    from distserve.serving.llm import DisaggLLM

    runs: dict[float, list[RequestRecord]] = {}
    with DisaggLLM(args.model, placement, dtype=args.dtype, cache_config=cache, scheduler_config=sched) as llm:
        num_blocks = llm.controller.num_blocks
        # Warm-up: first steps pay one-off costs (allocator, oneDNN primitives) the profile excluded.
        llm.generate([prompts[r.req_id] for r in unit[:2]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        # Calibration, separate from the validation runs: one request alone; its TPOT minus the
        # profile's batch-1 decode step is what the runtime adds per step (Ray round trips).
        solo = [Request(-1, 0.0, CALIBRATION_PROMPT, CALIBRATION_OUTPUT)]
        solo_prompt = {-1: prompts[unit[0].req_id][:1] * CALIBRATION_PROMPT}
        tpots = []
        for i in range(3):
            rec = llm._run(replay(llm.controller, solo, solo_prompt, f"{name}-cal{i}"))[0]
            tpots.append(rec.tpot_s)
        ctx = CALIBRATION_PROMPT + CALIBRATION_OUTPUT // 2
        overhead = max(0.0, float(np.median(tpots)) - latency.decode_time([ctx]))
        print(f"  {name}: solo TPOT {1e3 * float(np.median(tpots)):.1f} ms, profile decode step "
              f"{1e3 * latency.decode_time([ctx]):.1f} ms -> runtime overhead {1e3 * overhead:.1f} ms/step", flush=True)
        for rate in args.rate_list:
            reqs = with_rate(unit, rate)
            t = time.perf_counter()
            runs[rate] = llm._run(replay(llm.controller, reqs, prompts, f"{name}-{rate}"))
            print(f"  {name} at {rate} req/s: {len(reqs)} requests in {time.perf_counter() - t:.1f} s", flush=True)
    return runs, num_blocks, overhead


def rel_err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas > 0 else math.nan


def main() -> None:
    args = parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wall0 = time.perf_counter()
    t = time.perf_counter()
    profile = make_profile(args)
    profile_s = time.perf_counter() - t
    if not args.profile:
        stem = "validate_simulator_profile" + ("_quick" if args.quick else "")
        (out_dir / f"{stem}.json").write_text(json.dumps(profile, indent=1) + "\n")  # reusable: --profile
    latency = FittedLatencyModel.from_profile(profile)
    fit = profile["tp"]["1"]["fit_error"]
    print(f"profile: {latency!r} fit MAPE prefill {fit['prefill_mape']:.1%} decode {fit['decode_mape']:.1%} ({profile_s:.0f} s)", flush=True)

    unit = generate_requests(lengths(args.quick), 1.0, args.num_requests, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    vocab = latency.model.vocab_size
    prompts = {r.req_id: rng.integers(3, vocab - 3, r.prompt_len).tolist() for r in unit}  # no shared prefixes
    cache = CacheConfig(block_size=16, kv_cache_memory_gb=0.5)
    sched = SchedulerConfig()
    slo = SLOSpec(SLO(args.ttft, args.tpot, 0.9))

    rows: list[dict[str, Any]] = []
    overheads: dict[str, float] = {}
    for name, placement in SYSTEMS.items():
        runs, num_blocks, overhead = measure(args, name, placement, unit, prompts, cache, sched, latency)
        if args.step_overhead_ms is not None:
            overhead = args.step_overhead_ms / 1e3
        overheads[name] = overhead
        config = SimConfig(block_size=cache.block_size, scheduler=sched, prefill_scheduler=sched, decode_scheduler=sched,
                           num_blocks=num_blocks, step_overhead_s=overhead)
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
            rows.append(row)

    p90_errors = [abs(r[f"error_{k}"]) for r in rows for k in ("ttft_p90_s", "tpot_p90_s") if not math.isnan(r[f"error_{k}"])]
    figures = {
        "model": args.model,
        "dtype": profile["meta"].get("dtype"),
        "fit_mape": fit,
        "rates": args.rate_list,
        "num_requests_per_rate": args.num_requests,
        "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot},
        "runtime_overhead_s_per_step": overheads,
        "max_abs_p90_error": max(p90_errors) if p90_errors else math.nan,
        "mean_abs_p90_error": float(np.mean(p90_errors)) if p90_errors else math.nan,
        "target_p90_error": 0.10,
        "rows": rows,
        "wall_s": time.perf_counter() - wall0,
    }
    write_outputs(out_dir, rows, figures, quick=args.quick)
    print_table(rows)
    print(json.dumps(figures, default=float))


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{1e3 * x:.0f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="simulator vs real engine: predicted / measured (ms), relative error")
    for col in ("system", "rate", "P50 TTFT", "P90 TTFT", "P50 TPOT", "P90 TPOT", "attainment"):
        t.add_column(col, justify="right")
    for r in rows:
        cells = [f"{_ms(r[f'predicted_{k}'])} / {_ms(r[f'measured_{k}'])} ({r[f'error_{k}']:+.0%})" for k in METRICS]
        t.add_row(r["system"], f"{r['rate']:g}", *cells, f"{r['predicted_attainment']:.0%} / {r['measured_attainment']:.0%}")
    Console().print(t)


def write_outputs(out_dir: Path, rows: list[dict[str, Any]], figures: dict[str, Any], quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = "validate_simulator" + ("_quick" if quick else "")
    (out_dir / f"{stem}.json").write_text(json.dumps(figures, indent=2, default=float) + "\n")
    lines = [
        f"# Simulator vs real engine ({figures['model']}, {figures['dtype']}, this machine)",
        "",
        f"Profile fit MAPE: prefill {figures['fit_mape']['prefill_mape']:.1%}, decode {figures['fit_mape']['decode_mape']:.1%}. "
        f"Runtime overhead per step (solo-request calibration): "
        + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in figures["runtime_overhead_s_per_step"].items()) + ". "
        f"{figures['num_requests_per_rate']} requests per rate. Max |error| of P90 TTFT/TPOT: "
        f"{figures['max_abs_p90_error']:.1%} (mean {figures['mean_abs_p90_error']:.1%}; target 10%).",
        "",
        "| system | rate (req/s) | P50 TTFT ms pred/meas | P90 TTFT ms pred/meas | P50 TPOT ms pred/meas | P90 TPOT ms pred/meas | attainment pred/meas |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [f"{_ms(r[f'predicted_{k}'])} / {_ms(r[f'measured_{k}'])} ({r[f'error_{k}']:+.0%})" for k in METRICS]
        lines.append(f"| {r['system']} | {r['rate']:g} | " + " | ".join(cells)
                     + f" | {r['predicted_attainment']:.0%} / {r['measured_attainment']:.0%} |")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
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
    fig.savefig(out_dir / f"{stem}.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
