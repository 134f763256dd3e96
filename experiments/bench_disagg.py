"""Goodput over HTTP: disaggregated 1P1D on Ray vs the colocated baseline, on the same cores.

Two servers, one after the other, each a `distserve serve` subprocess on a free loopback port:
  * colocated: `--colocated 1 --runtime local` — one engine using all torch threads (2 here);
  * disagg:    `--prefill 1 --decode 1 --runtime ray` — a prefill and a decode instance, each a Ray
    actor process with one torch thread, KV migrating over gloo.
Same model and dtype. Each is driven with `distserve.measure.loadgen` (streamed `/v1/completions`, Poisson
arrivals, fixed input length, `max_tokens` = `min_tokens` = output length with `ignore_eos`, so every
request has the same shape) at several rates. Every rate replays the same seeded arrival pattern,
scaled to the rate (so the curves are not shaped by one rate's lucky or bursty draw), with its own
prompts (so no rate profits from another's prefix cache); both systems get identical workloads.
Each row also records where the CPU went during the run: the server's busiest processes, the load
generator, and every other process on the machine (it is shared: a busy neighbour shows up there).

SLOs come from a short calibration on the colocated server: the median TTFT and TPOT of a few
requests sent one at a time. The TPOT SLO is `--tpot-slo-factor` (2.5) x that TPOT, which is tight:
a colocated decode step that also runs a 256-token prefill is several decode steps long. The TTFT
SLO is generous, `--ttft-slo-factor` (10) x the single-request TTFT, so the TPOT SLO is the one that
binds. `--ttft-slo`/`--tpot-slo` override them.

A system's goodput is the best goodput (requests meeting both SLOs per second, first arrival to last
completion) among rates where attainment >= 90%, or its best goodput at any rate if no rate gets
there. Both systems use the same 2 cores, so no per-device normalisation is needed.

`--base-url-a`/`--base-url-b` point at already-running servers instead of starting ours (e.g. vLLM
or SGLang; `--request-model` names the model they serve). Started servers always get SIGINT, then
SIGKILL for anything left in their session, and the run checks that no process it started (Ray's
included) survives. Writes JSON + markdown + PNG under --out-dir; the last stdout line is the JSON
of figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from typing import Any

import harness
from distserve.cli.arg_types import positive_float, positive_int
from distserve.cli.args import latency_type
from distserve.measure.benchserve import ServerProcess, cpu_usage, distserve_serve_argv, process_cpu
from distserve.slo import SLO
from distserve.measure.load_summary import LoadResult, summarize
from distserve.measure.loadgen import run_load, single_stream
from distserve.measure.workload import Workload
from harness import Outputs, ms

SYSTEM_FLAGS = {
    "colocated": ["--colocated", "1", "--runtime", "local"],
    "disagg": ["--prefill", "1", "--decode", "1", "--runtime", "ray"],
}
ATTAINMENT_TARGET = 0.9
SENSITIVITY_FACTORS = (2.0, 2.5, 3.0, 4.0)  # TPOT SLO as multiples of the colocated single-request TPOT
NUM_SINGLE_REQUESTS = 3
MIN_BASE_TPOT_S = 1e-4  # a single-request TPOT below this means the tokens arrived together


def serve_argv(system: str, model: str, dtype: str) -> list[str]:
    return distserve_serve_argv(model, dtype, SYSTEM_FLAGS[system])


# ---- measurements ----------------------------------------------------------------------------
def workload(args: argparse.Namespace, num_requests: int, rate: float, seed: int, prompt_seed: int | None = None) -> Workload:
    return Workload(
        num_requests=num_requests, rate=rate, input_len=args.input_len, output_len=args.output_len,
        seed=seed, prompt_seed=prompt_seed, ignore_eos=True, min_tokens=True,
    )


def sweep(
    args: argparse.Namespace, url: str, slo: SLO, calibration: tuple[float, float], server_sid: int | None
) -> list[tuple[dict[str, Any], LoadResult]]:
    """One load run per rate: the same arrival pattern (scaled) at every rate, fresh prompts each
    time; each row is the summary plus where the CPU went during the run."""
    out = []
    for i, rate in enumerate(args.rates):
        w = workload(args, args.num_requests, rate, args.seed, prompt_seed=args.seed + 1 + i)
        cpu0, t0 = process_cpu(), time.monotonic()
        result = run_load(url, args.request_model, w, slo, tokens_per_word=calibration, request_timeout_s=args.request_timeout)
        cpu = cpu_usage(cpu0, process_cpu(), time.monotonic() - t0, server_sid)
        s = result.summary
        out.append(({"rate": rate, **s.to_dict(), **cpu}, result))
        print(
            f"  rate {rate:g}/s: {s.num_completed}/{s.num_requests} done, TTFT p50 {s.ttft_p50_s or 0:.3f} s, "
            f"TPOT p50 {s.tpot_p50_s or 0:.3f} s, attainment {s.slo_attainment:.0%}, goodput {s.goodput_rps:.2f}/s; "
            f"cores: server {' '.join(f'{n.split()[0]}={c:.2f}' for n, c in cpu['server_cores'])}, "
            f"loadgen {cpu['loadgen_cores']:.2f}, others {cpu['other_cores']:.2f}",
            flush=True,
        )
    return out


def system_goodput(rows: list[dict[str, Any]]) -> tuple[float, float | None, bool]:
    """(goodput, the rate it came from, whether that rate met the attainment target)."""
    passing = [r for r in rows if r["slo_attainment"] >= ATTAINMENT_TARGET]
    pool = passing or rows
    if not pool:
        return 0.0, None, False
    best = max(pool, key=lambda r: r["goodput_rps"])
    return best["goodput_rps"], best["rate"], bool(passing)


def slo_sensitivity(
    results: list[tuple[str, float, LoadResult]], slo: SLO, base_tpot_s: float, labels: list[str]
) -> dict[str, list[float | None]]:
    """Both systems' goodput and their ratio re-scored from the same requests at other TPOT SLOs."""
    out: dict[str, list[float | None]] = {"tpot_slo_factor": list(SENSITIVITY_FACTORS)}
    for label in labels:
        out[f"{label}_goodput_rps"] = []
    out["goodput_ratio"] = []
    for factor in SENSITIVITY_FACTORS:
        other = SLO(ttft_s=slo.ttft_s, tpot_s=factor * base_tpot_s)
        goodputs = []
        for label in labels:
            rows = [{"rate": rate, **summarize(r.requests, other).to_dict()} for lab, rate, r in results if lab == label]
            goodputs.append(round(system_goodput(rows)[0], 3))
            out[f"{label}_goodput_rps"].append(goodputs[-1])
        out["goodput_ratio"].append(round(goodputs[1] / goodputs[0], 3) if goodputs[0] > 0 else None)
    return out


# ---- outputs ---------------------------------------------------------------------------------
def write_outputs(out: Outputs, rows: list[dict[str, Any]], figures: dict[str, Any], labels: list[str]) -> None:
    out.json({"figures": figures, "rows": rows})
    md = [
        f"SLOs: TTFT {figures['ttft_slo_s'] * 1000:.0f} ms, TPOT {figures['tpot_slo_s'] * 1000:.0f} ms "
        f"({figures['model']}, input ~{figures['input_len']} tokens, output {figures['output_len']} tokens, "
        f"{figures['num_requests']} requests per rate)",
        "",
        "| system | rate (req/s) | done | errors | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | attainment | goodput (req/s) | busiest server processes (cores) | loadgen / other (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['system']} | {r['rate']:g} | {r['num_completed']}/{r['num_requests']} | {r['num_errors']} | "
        f"{ms(r['ttft_p50_s'])} / {ms(r['ttft_p90_s'])} | {ms(r['tpot_p50_s'])} / {ms(r['tpot_p90_s'])} | "
        f"{r['slo_attainment']:.0%} | {r['goodput_rps']:.2f} | "
        + ", ".join(f"{n.split()[0]} {c:.2f}" for n, c in r["server_cores"][:3])
        + f" | {r['loadgen_cores']:.2f} / {r['other_cores']:.2f} |"
        for r in rows
    ]
    md += ["", "| system | goodput (req/s) | at rate | attainment >= 90% there |", "|---|---|---|---|"]
    md += [
        f"| {s} | {figures[f'{s}_goodput_rps']:.2f} | {figures[f'{s}_goodput_rate']} | {figures[f'{s}_goodput_meets_target']} |"
        for s in labels
    ]
    ratio = figures["goodput_ratio"]
    md += ["", f"goodput ratio {labels[1]} / {labels[0]}: " + ("-" if ratio is None else f"{ratio:.2f}x")]
    sens = figures["sensitivity"]
    md += [
        "", "Same requests re-scored at other TPOT SLOs (x the colocated single-request TPOT):", "",
        "| TPOT SLO factor | TPOT SLO (ms) | " + " | ".join(f"{s} goodput" for s in labels) + " | ratio |",
        "|---|---|" + "---|" * len(labels) + "---|",
    ]
    for i, factor in enumerate(sens["tpot_slo_factor"]):
        r = sens["goodput_ratio"][i]
        md.append(
            f"| {factor:g} | {factor * figures[f'{labels[0]}_single_tpot_s'] * 1000:.3g} | "
            + " | ".join(f"{sens[f'{s}_goodput_rps'][i]:.2f}" for s in labels)
            + f" | {'-' if r is None else f'{r:.2f}x'} |"
        )
    out.markdown(md)

    fig, (ax1, ax2) = harness.pyplot().subplots(1, 2, figsize=(10, 4))
    for label in labels:
        mine = [r for r in rows if r["system"] == label]
        ax1.plot([r["rate"] for r in mine], [r["slo_attainment"] * 100 for r in mine], marker="o", label=label)
        ax2.plot([r["rate"] for r in mine], [r["goodput_rps"] for r in mine], marker="o", label=label)
    ax1.axhline(ATTAINMENT_TARGET * 100, color="grey", linestyle="--", linewidth=1)
    ax1.set(xlabel="rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105), title="attainment vs rate")
    ax2.set(xlabel="rate (req/s)", ylabel="goodput (req/s)", title="goodput vs rate")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{figures['model']}: TTFT SLO {figures['ttft_slo_s'] * 1000:.0f} ms, TPOT SLO {figures['tpot_slo_s'] * 1000:.0f} ms"
    )
    fig.tight_layout()
    out.png(fig)


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    harness.rich_table(
        title, ["system", "rate", "done", "err", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "attain", "goodput"],
        [[r["system"], f"{r['rate']:g}", f"{r['num_completed']}/{r['num_requests']}", str(r["num_errors"]),
          ms(r["ttft_p50_s"]), ms(r["ttft_p90_s"]), ms(r["tpot_p50_s"]), ms(r["tpot_p90_s"]),
          f"{r['slo_attainment']:.0%}", f"{r['goodput_rps']:.2f}"] for r in rows],
        width=140,
    )


# ---- main ------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__, "tiny model, 2 rates x 8 requests, input 64, output 16")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rates", default="1,1.25,1.5,1.75,2", help="comma-separated Poisson rates (req/s)")
    ap.add_argument("--num-requests", type=positive_int, default=40, help="per rate")
    ap.add_argument("--input-len", type=positive_int, default=256)
    ap.add_argument("--output-len", type=positive_int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tpot-slo-factor", type=positive_float, default=2.5, help="x the colocated single-request TPOT")
    ap.add_argument("--ttft-slo-factor", type=positive_float, default=10.0, help="x the colocated single-request TTFT")
    ap.add_argument("--ttft-slo", type=latency_type("--ttft-slo"), default=None, help="seconds (overrides the factor)")
    ap.add_argument("--tpot-slo", type=latency_type("--tpot-slo"), default=None, help="seconds (overrides the factor)")
    ap.add_argument("--base-url-a", default=None, help="use this running server as system A instead of our colocated one")
    ap.add_argument("--base-url-b", default=None, help="use this running server as system B instead of our 1P1D one")
    ap.add_argument("--label-a", default="colocated")
    ap.add_argument("--label-b", default="disagg")
    ap.add_argument("--request-model", default=None, help="model name sent in requests (default: --model)")
    ap.add_argument("--startup-timeout", type=positive_float, default=300.0, help="seconds for a server to become healthy")
    ap.add_argument("--request-timeout", type=positive_float, default=120.0, help="seconds, per request")
    args = ap.parse_args()
    if args.quick:
        args.model, args.rates, args.num_requests, args.input_len, args.output_len = "tiny", "8,32", 8, 64, 16
        args.startup_timeout = min(args.startup_timeout, 120.0)
    args.rates = [float(r) for r in str(args.rates).split(",") if r]
    args.request_model = args.request_model or args.model
    return args


def measure_system(
    args: argparse.Namespace, kind: str, label: str, url: str | None, slo: SLO | None, figures: dict[str, Any]
) -> tuple[SLO, list[tuple[dict[str, Any], LoadResult]]]:
    """Start the server (unless ``url`` is given), time single requests, fix the SLOs if not yet
    fixed, sweep the rates, and always stop what was started."""
    server = None if url else ServerProcess(label, serve_argv(kind, args.model, args.dtype), args.startup_timeout)
    try:
        if server is not None:
            url = server.start()
            figures[f"{label}_startup_s"] = round(server.startup_s, 1)
            print(f"{label}: started `{' '.join(server.argv[2:])}` at {url} in {server.startup_s:.1f} s", flush=True)
        assert url is not None
        # Also probes this server's tokenizer.
        single = single_stream(url, args.request_model, args.input_len, args.output_len, NUM_SINGLE_REQUESTS)
        figures[f"{label}_single_ttft_s"] = round(single.ttft_s, 4)
        # A tiny model's tokens can reach the client in one burst (TPOT ~0): the SLO then scales from
        # MIN_BASE_TPOT_S, never from 0 (significant digits, not decimals, for the same reason).
        base_tpot_s = max(single.tpot_s, MIN_BASE_TPOT_S)
        figures[f"{label}_single_tpot_s"] = float(f"{base_tpot_s:.4g}")
        print(
            f"{label}: one request at a time: TTFT {single.ttft_s * 1000:.0f} ms, TPOT {single.tpot_s * 1000:.1f} ms "
            f"({single.num_prompt_tokens} prompt tokens)",
            flush=True,
        )
        if slo is None:
            slo = SLO(
                ttft_s=args.ttft_slo if args.ttft_slo is not None else args.ttft_slo_factor * single.ttft_s,
                tpot_s=args.tpot_slo if args.tpot_slo is not None else args.tpot_slo_factor * base_tpot_s,
            )
            figures["ttft_slo_s"] = round(slo.ttft_s or 0.0, 4)
            figures["tpot_slo_s"] = round(slo.tpot_s or 0.0, 4)
            print(f"SLOs: TTFT {figures['ttft_slo_s'] * 1000:.0f} ms, TPOT {figures['tpot_slo_s'] * 1000:.1f} ms", flush=True)
        sid = server.sid if server is not None else None
        return slo, sweep(args, url, slo, single.calibration, sid)
    finally:
        if server is not None:
            figures.update({f"{label}_{k}": v for k, v in harness.stop_server(server).items()})


def summarize_systems(rows: list[dict[str, Any]], labels: list[str], figures: dict[str, Any]) -> None:
    for label in labels:
        mine = [r for r in rows if r["system"] == label]
        goodput, rate, meets = system_goodput(mine)
        figures[f"{label}_goodput_rps"] = round(goodput, 3)
        figures[f"{label}_goodput_rate"] = rate
        figures[f"{label}_goodput_meets_target"] = meets
        figures[f"{label}_num_requests"] = sum(r["num_requests"] for r in mine)
        figures[f"{label}_num_completed"] = sum(r["num_completed"] for r in mine)
        figures[f"{label}_num_errors"] = sum(r["num_errors"] for r in mine)
        figures[f"{label}_mean_output_tokens"] = round(statistics.fmean(r["mean_output_tokens"] or 0.0 for r in mine), 2)
        figures[f"{label}_max_attainment"] = max(r["slo_attainment"] for r in mine)
        figures[f"{label}_attainment_by_rate"] = [round(r["slo_attainment"], 3) for r in mine]
    base = figures[f"{labels[0]}_goodput_rps"]
    figures["goodput_ratio"] = round(figures[f"{labels[1]}_goodput_rps"] / base, 3) if base > 0 else None
    figures["max_other_cores"] = max((r["other_cores"] for r in rows), default=0.0)


def main() -> None:
    args = parse_args()
    # A SIGTERM (e.g. a test timeout) unwinds through the finally blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()
    systems = [("colocated", args.label_a, args.base_url_a), ("disagg", args.label_b, args.base_url_b)]
    labels = [label for _, label, _ in systems]
    figures: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "num_requests": args.num_requests, "input_len": args.input_len,
        "output_len": args.output_len, "rates": args.rates, "cpu_count": os.cpu_count(),
    }
    rows: list[dict[str, Any]] = []
    results: list[tuple[str, float, LoadResult]] = []
    slo: SLO | None = None
    for kind, label, url in systems:  # the SLOs come from the first system, the colocated baseline
        slo, measured = measure_system(args, kind, label, url, slo, figures)
        rows += [{"system": label, **row} for row, _ in measured]
        results += [(label, row["rate"], result) for row, result in measured]
    assert slo is not None
    summarize_systems(rows, labels, figures)
    figures["sensitivity"] = slo_sensitivity(results, slo, figures[f"{labels[0]}_single_tpot_s"], labels)
    figures["wall_s"] = round(time.monotonic() - t_start, 1)

    print_table(rows, f"{args.model}: {args.num_requests} requests/rate, input ~{args.input_len}, output {args.output_len}")
    for label in labels:
        print(f"{label}: goodput {figures[f'{label}_goodput_rps']:.2f} req/s (rate {figures[f'{label}_goodput_rate']}, "
              f"attainment >= 90%: {figures[f'{label}_goodput_meets_target']})")
    ratio = figures["goodput_ratio"]
    print(f"goodput ratio {labels[1]} / {labels[0]}: " + ("-" if ratio is None else f"{ratio:.2f}x (goal >= 1.5x)"))
    sens = figures["sensitivity"]
    print("at other TPOT SLOs (x colocated single TPOT): " + ", ".join(
        f"{f:g}x -> ratio {'-' if r is None else f'{r:.2f}'}" for f, r in zip(sens["tpot_slo_factor"], sens["goodput_ratio"])
    ))
    write_outputs(Outputs.for_run(args, "bench_disagg"), rows, figures, labels)
    harness.finish(figures)


if __name__ == "__main__":
    main()
