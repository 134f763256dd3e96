"""Goodput at the SLO over HTTP, side by side: vLLM (CPU build) vs distserve colocated vs distserve as deployed.

Servers, started one after the other, each in its own session on a free loopback port, all loading
the same SmolLM2-135M folder (``load_model("smollm2-135m")``'s cache) in bfloat16:
  * vllm:      ``python -m vllm.entrypoints.openai.api_server --enforce-eager --max-model-len 2048``
               from the peers venv (``make peers``: ``.peers/vllm-venv``; ``vllm_peer.py``), with ``VLLM_CPU_KVCACHE_SPACE=2``
               and vLLM's default CPU threading (one OpenMP thread on core 0, the other core left to its
               API server). Skipped, and reported as skipped, when that venv does not exist;
  * colocated: ``distserve serve --colocated 1 --runtime local`` (one engine, both cores);
  * deployed:  what ``make serve`` deploys, ``--prefill 1 --decode 1 --runtime ray``, or ``--placement FILE``
               (the planner's output).
Every server is driven by the same client (``distserve.measure.loadgen``: streamed ``/v1/completions``) with the
same seeded workloads; ``ignore_eos`` + ``min_tokens`` make every request full length:
  * short: ~256-token prompts, 64 output tokens; SLO TTFT 2 s, TPOT 150 ms;
  * long:  ~1024-token prompts, 32 output tokens; SLO TTFT 3 s, TPOT 150 ms. An unloaded 1024-token
           prefill takes 1.1-2.2 s here (vLLM 1.5 s), so the TTFT SLO is about 2x of it: queueing
           behind one other prefill already misses it. In the last full run no server reached 90% at
           0.25 req/s (the README); a looser TTFT SLO or a lower --min-rate resolves goodputs there.

Goodput of a server on a workload = the highest Poisson rate at which >= 90% of the requests meet
both SLOs, found by ``simulator.goodput.search_rate`` (the planner's search: double/halve from the
start rate until one rate passes and one fails, then bisect) with ``--max-probes`` probes (4).
Each probe sends max(``--min-requests`` (30), rate x ``--probe-seconds`` (40 s)) requests: the same
seeded arrival pattern scaled to the rate, prompts seeded by (workload, rate), so two servers probed
at one rate get identical requests. A probe ends as soon as its failure is certain (more requests
are known to miss than 10% allows: ``loadgen`` ``stop_below``); its attainment is then a lower
bound (marked). Rates below ``--min-rate`` (0.25 req/s) are not probed (a probe there takes minutes):
such a goodput is reported as 0, "below the minimum rate". Between probes the harness waits until
the server's queue gauges read zero.

Also measured: each server's single-stream TTFT/TPOT per workload (requests one at a time, medians),
and one cross-check of the client: vLLM's own benchmark client (``vllm.benchmarks.serve``, run from
the vLLM venv, random dataset of the same lengths, ``--ignore-eos``, ``--goodput ttft:.. tpot:..``)
against OUR colocated server at the short workload's goodput rate, next to ``distserve.measure.loadgen`` at
the same rate and request count. vLLM's client counts TPOT as (E2E - TTFT) / (tokens - 1), ours as
(last token - first token) / (tokens - 1).

Writes ``bench_serving.{json,md,png}`` (and ``_raw.json``) under ``--out-dir``; every server process (Ray's and vLLM's
engine processes included) is stopped and checked gone. ``--quick``: our colocated server only,
tiny model, 2 rates x 8 requests per workload (the test suite runs it). The last stdout line is
one JSON object of figures.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import harness
from distserve.cli.arg_types import non_negative_float, positive_float, positive_int
import vllm_peer
from distserve.measure.benchserve import (
    ServerProcess, cpu_usage, distserve_serve_argv, metric_sums, process_cpu, wait_until_idle,
)
from distserve.slo import SLO
from distserve.measure.load_summary import LoadResult
from distserve.measure.loadgen import run_load, single_stream
from distserve.measure.workload import Workload
from harness import Outputs, ms
from simulator.goodput import search_rate

ATTAINMENT_TARGET = 0.9
NUM_SINGLE_REQUESTS = 3
# Server-side counters read around the vLLM client's run: its random token-id prompts are decoded to
# text and re-tokenized by the server, so only the server knows the prompt lengths it really served.
SERVER_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "request_success_total")
REL_TOL = 0.1

@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    input_len: int
    output_len: int
    ttft_slo_s: float
    tpot_slo_s: float
    start_rate: float  # where the goodput search starts (req/s)

    @property
    def slo(self) -> SLO:
        return SLO(ttft_s=self.ttft_slo_s, tpot_s=self.tpot_slo_s)


WORKLOADS = (
    WorkloadSpec("short", 256, 64, ttft_slo_s=2.0, tpot_slo_s=0.15, start_rate=1.0),
    WorkloadSpec("long", 1024, 32, ttft_slo_s=3.0, tpot_slo_s=0.15, start_rate=0.5),
)
QUICK_WORKLOADS = (  # the tiny model (context 1024), 2 probes each
    WorkloadSpec("short", 64, 16, ttft_slo_s=2.0, tpot_slo_s=0.15, start_rate=8.0),
    WorkloadSpec("long", 256, 8, ttft_slo_s=3.0, tpot_slo_s=0.15, start_rate=2.0),
)


# ---- servers -------------------------------------------------------------------------------
def distserve_server(args: argparse.Namespace, name: str) -> ServerProcess:
    if name == "colocated":
        flags = ["--colocated", "1", "--runtime", "local"]
    elif args.placement:
        flags = ["--placement", str(Path(args.placement).resolve())]
    else:
        flags = ["--prefill", "1", "--decode", "1", "--runtime", "ray"]  # make serve's deployment
    argv = distserve_serve_argv(args.model, args.dtype, flags + shlex.split(args.serve_args))
    return ServerProcess(name, argv, args.startup_timeout)


# ---- measurements ----------------------------------------------------------------------------
def probe_size(args: argparse.Namespace, rate: float) -> int:
    return max(args.min_requests, math.ceil(rate * args.probe_seconds))


def prompt_seed(args: argparse.Namespace, spec: WorkloadSpec, rate: float) -> int:
    """The same prompts at the same (workload, rate) for every server; other prompts elsewhere."""
    entropy = [args.seed, spec.input_len, spec.output_len, int(round(rate * 1000))]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def probe_workload(args: argparse.Namespace, spec: WorkloadSpec, rate: float) -> Workload:
    return Workload(
        num_requests=probe_size(args, rate), rate=rate, input_len=spec.input_len, output_len=spec.output_len,
        seed=args.seed, prompt_seed=prompt_seed(args, spec, rate), ignore_eos=True, min_tokens=True,
    )


def run_probe(
    args: argparse.Namespace, server: ServerProcess, spec: WorkloadSpec, rate: float,
    calibration: tuple[float, float], stop_early: bool = True,
) -> tuple[dict[str, Any], LoadResult]:
    """One load run at ``rate``; the row is its summary plus where the CPU went."""
    waited = wait_until_idle(server.base_url)
    cpu0, t0 = process_cpu(), time.monotonic()
    result = run_load(
        server.base_url, args.model, probe_workload(args, spec, rate), spec.slo, tokens_per_word=calibration,
        request_timeout_s=args.request_timeout, stop_below=ATTAINMENT_TARGET if stop_early else None,
    )
    cpu = cpu_usage(cpu0, process_cpu(), time.monotonic() - t0, server.sid)
    s = result.summary
    row = {
        "server": server.name, "workload": spec.name, "rate": rate, "passed": s.slo_attainment >= ATTAINMENT_TARGET,
        "stopped_early": result.stopped_early, "idle_wait_s": round(waited, 1), "wall_s": round(time.monotonic() - t0, 1),
        **s.to_dict(), **cpu,
        "requests": result.to_dict(include_requests=True)["requests"],  # only in the _raw file
    }
    print(
        f"  {server.name}/{spec.name} rate {rate:g}/s: {s.num_completed}/{s.num_requests} done"
        + (f" (stopped early, {s.num_cancelled} cancelled)" if result.stopped_early else "")
        + f", TTFT p50/p90 {ms(s.ttft_p50_s)}/{ms(s.ttft_p90_s)} ms, TPOT p50/p90 {ms(s.tpot_p50_s)}/{ms(s.tpot_p90_s)} ms, "
        f"attainment {s.slo_attainment:.0%} -> {'pass' if row['passed'] else 'fail'} ({row['wall_s']:.0f} s); "
        f"cores: server {' '.join(f'{n.split()[0]}={c:.2f}' for n, c in cpu['server_cores'][:3])}, others {cpu['other_cores']:.2f}",
        flush=True,
    )
    return row, result


def find_goodput(
    args: argparse.Namespace, server: ServerProcess, spec: WorkloadSpec, calibration: tuple[float, float],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The search over real probes; rates below ``--min-rate`` count as failing without a probe."""
    rows: list[dict[str, Any]] = []
    went_below = False

    def passes(rate: float) -> bool:
        nonlocal went_below
        rate = round(rate, 4)
        if rate < args.min_rate - 1e-9:
            went_below = True
            return False
        row, _ = run_probe(args, server, spec, rate, calibration)
        rows.append(row)
        return bool(row["passed"])

    lo, hi = search_rate(passes, spec.start_rate, args.max_rate, REL_TOL, args.max_probes)
    best = next((r for r in rows if r["rate"] == round(lo, 4)), None)
    return {
        "goodput_rps": round(lo, 4),
        "first_failing_rate": None if math.isinf(hi) else round(hi, 4),
        "below_min_rate": lo == 0.0 and went_below,
        "attainment_at_goodput": None if best is None else round(best["slo_attainment"], 3),
        "num_probes": len(rows),
        "probe_wall_s": round(sum(r["wall_s"] for r in rows), 1),
        "num_requests": sum(r["num_requests"] for r in rows),
        "num_completed": sum(r["num_completed"] for r in rows),
        "num_cancelled": sum(r["num_cancelled"] for r in rows),
        "num_errors": sum(r["num_errors"] for r in rows),
        "error_kinds": dict(sum((Counter(r.get("error_kinds", {})) for r in rows), Counter())),
        # every completed request had exactly this many tokens when it equals the output length
        "min_mean_output_tokens": min((r["mean_output_tokens"] for r in rows if r["num_completed"]), default=None),
        "max_mean_output_tokens": max((r["mean_output_tokens"] for r in rows if r["num_completed"]), default=None),
    }, rows


def crosscheck(
    args: argparse.Namespace, server: ServerProcess, spec: WorkloadSpec, rate: float, calibration: tuple[float, float],
    python: Path, folder: str,
) -> dict[str, Any]:
    """Both clients at one (rate, lengths, request count) against the same server, back to back."""
    row, _ = run_probe(args, server, spec, rate, calibration, stop_early=False)
    wait_until_idle(server.base_url)
    before = metric_sums(server.base_url, SERVER_COUNTERS) or {}
    num = probe_size(args, rate)
    theirs = vllm_peer.client_run(
        python, folder, args.model, server.base_url, input_len=spec.input_len, output_len=spec.output_len, num_prompts=num,
        rate=rate, seed=args.seed, ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s,
        timeout_s=args.request_timeout + 3 * num / rate + 300,
    )
    after = metric_sums(server.base_url, SERVER_COUNTERS) or {}
    num_served = after.get("request_success_total", 0.0) - before.get("request_success_total", 0.0)
    if num_served > 0 and "prompt_tokens_total" in after:
        theirs["server_mean_prompt_tokens"] = round((after["prompt_tokens_total"] - before["prompt_tokens_total"]) / num_served, 1)
        theirs["server_num_requests"] = int(num_served)  # includes the client's ready-check request
    ours = {k: row[k] for k in ("num_requests", "num_completed", "num_errors", "duration_s", "goodput_rps", "slo_attainment",
                                "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "mean_output_tokens", "mean_prompt_tokens")}
    print(f"  cross-check at {rate:g}/s on {server.name}/{spec.name}: loadgen goodput {ours['goodput_rps']:.3f}/s "
          f"(attainment {ours['slo_attainment']:.0%}), vLLM client {theirs.get('goodput_rps', '-')}/s "
          f"(attainment {theirs.get('slo_attainment', '-')}) {theirs.get('error', '')}", flush=True)
    return {"server": server.name, "workload": spec.name, "rate": rate, "loadgen": ours, "vllm_client": theirs}


def measure_server(
    args: argparse.Namespace, server: ServerProcess, workloads: tuple[WorkloadSpec, ...], report: dict[str, Any],
    rows: list[dict[str, Any]], crosscheck_with: tuple[Path, str] | None,
) -> None:
    """Start, time single requests, search each workload's goodput (and cross-check), always stop."""
    try:
        server.start()
        report["startup_s"] = round(server.startup_s, 1)
        print(f"{server.name}: started `{' '.join(server.argv[1:])}` at {server.base_url} in {server.startup_s:.1f} s", flush=True)
        for spec in workloads:
            single = single_stream(server.base_url, args.model, spec.input_len, spec.output_len,
                                   1 if args.quick else NUM_SINGLE_REQUESTS, request_timeout_s=args.request_timeout)
            report["single"][spec.name] = {"ttft_s": round(single.ttft_s, 4), "tpot_s": round(single.tpot_s, 4),
                                           "prompt_tokens": single.num_prompt_tokens}
            print(f"{server.name}/{spec.name}: one request at a time: TTFT {single.ttft_s * 1000:.0f} ms, "
                  f"TPOT {single.tpot_s * 1000:.1f} ms ({single.num_prompt_tokens} prompt tokens)", flush=True)
            goodput, probe_rows = find_goodput(args, server, spec, single.calibration)
            rows += probe_rows
            report["goodput"][spec.name] = goodput
            print(f"{server.name}/{spec.name}: goodput {goodput['goodput_rps']:g} req/s"
                  + (" (below the minimum rate probed)" if goodput["below_min_rate"] else ""), flush=True)
            if crosscheck_with is not None and spec is workloads[0]:
                rate = goodput["goodput_rps"] or args.min_rate
                report["crosscheck"] = crosscheck(args, server, spec, rate, single.calibration, *crosscheck_with)
    finally:
        report.update(harness.stop_server(server))


# ---- outputs ---------------------------------------------------------------------------------
def _ratio(ours: float, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if theirs else None


def write_outputs(out: Outputs, figures: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    out.json(rows, "_raw", indent=None)
    rows = [{k: v for k, v in r.items() if k != "requests"} for r in rows]
    out.json({"figures": figures, "rows": rows})
    servers, workloads = figures["servers"], figures["workloads"]
    md = [
        f"{figures['model']} ({figures['dtype']}), {figures['cpu_count']} cores; goodput = highest Poisson rate with "
        f">= {ATTAINMENT_TARGET:.0%} of requests within both SLOs; probes of max({figures['min_requests']}, "
        f"rate x {figures['probe_seconds']:g} s) requests, at most {figures['max_probes']} per search, none below "
        f"{figures['min_rate']:g} req/s.",
        "",
        "| workload | SLO TTFT / TPOT | " + " | ".join(f"{s} goodput (req/s)" for s in servers) + " | "
        + " | ".join(f"{s} / vllm" for s in servers if s != "vllm") + " |",
        "|---|---|" + "---|" * (len(servers) + len(servers) - 1),
    ]
    for w, spec in workloads.items():
        cells = []
        for s, rep in servers.items():
            g = rep["goodput"].get(w)
            cells.append("skipped" if rep.get("skipped") else "failed" if g is None and rep.get("error") else "-" if g is None else
                         f"{g['goodput_rps']:g}" + (f" (< {figures['min_rate']:g})" if g["below_min_rate"] else ""))
        ratios = [figures["ratios"].get(w, {}).get(s) for s in servers if s != "vllm"]
        md.append(f"| {w} (~{spec['input_len']} in / {spec['output_len']} out) | {spec['ttft_slo_s']:g} s / "
                  f"{spec['tpot_slo_s'] * 1000:g} ms | " + " | ".join(cells) + " | "
                  + " | ".join("-" if r is None else f"{r:.2f}x" for r in ratios) + " |")
    md += ["", "Single stream (one request at a time, medians): TTFT / TPOT in ms", "",
           "| server | " + " | ".join(workloads) + " |", "|---|" + "---|" * len(workloads)]
    for s, rep in servers.items():
        md.append(f"| {s} | " + " | ".join(
            f"{ms(rep['single'][w]['ttft_s'])} / {ms(rep['single'][w]['tpot_s'])}" if w in rep["single"] else "-"
            for w in workloads) + " |")
    md += ["", "Every probe (attainment of an early-stopped probe is a lower bound):", "",
           "| server | workload | rate (req/s) | requests | done | cancelled | errors | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) "
           "| attainment | verdict | busiest server processes (cores) | others (cores) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [
        f"| {r['server']} | {r['workload']} | {r['rate']:g} | {r['num_requests']} | {r['num_completed']} | {r['num_cancelled']} | "
        f"{r['num_errors']} | {ms(r['ttft_p50_s'])} / {ms(r['ttft_p90_s'])} | {ms(r['tpot_p50_s'])} / {ms(r['tpot_p90_s'])} | "
        f"{'>= ' if r['stopped_early'] else ''}{r['slo_attainment']:.0%} | {'pass' if r['passed'] else 'fail'} | "
        + ", ".join(f"{n.split()[0]} {c:.2f}" for n, c in r["server_cores"][:3]) + f" | {r['other_cores']:.2f} |"
        for r in rows
    ]
    cc = figures.get("crosscheck") or {}
    if cc.get("loadgen"):
        ours, theirs = cc["loadgen"], cc["vllm_client"]
        md += ["", f"Client cross-check: {cc['server']} server, {cc['workload']} workload at {cc['rate']:g} req/s, "
               f"{ours['num_requests']} requests:", "",
               "| client | goodput (req/s) | attainment | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | duration (s) "
               "| prompt tokens as served |",
               "|---|---|---|---|---|---|---|"]
        for name, m in (("distserve.measure.loadgen", ours), ("vllm.benchmarks.serve", theirs)):
            if "error" in m:
                md.append(f"| {name} | error: {m['error'][:200]} | | | | | |")
            else:
                tokens = m.get("mean_prompt_tokens", m.get("server_mean_prompt_tokens"))
                md.append(f"| {name} | {m['goodput_rps']:.3f} | {m['slo_attainment']:.0%} | {ms(m['ttft_p50_s'])} / "
                          f"{ms(m['ttft_p99_s'])} | {ms(m['tpot_p50_s'])} / {ms(m['tpot_p99_s'])} | {m['duration_s']:.1f} "
                          f"| {'-' if tokens is None else f'{tokens:.0f}'} |")
    elif cc:
        md += ["", f"Client cross-check skipped: {cc.get('skipped')}"]
    out.markdown(md)

    fig, axes = harness.pyplot().subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, (w, spec) in zip(axes[0], workloads.items()):
        for s in servers:
            mine = sorted((r for r in rows if r["server"] == s and r["workload"] == w), key=lambda r: r["rate"])
            if not mine:
                continue
            line, = ax.plot([r["rate"] for r in mine], [r["slo_attainment"] * 100 for r in mine], marker="o", label=s)
            early = [r for r in mine if r["stopped_early"]]
            ax.scatter([r["rate"] for r in early], [r["slo_attainment"] * 100 for r in early], marker="^", s=60,
                       facecolors="none", edgecolors=line.get_color())
        ax.axhline(ATTAINMENT_TARGET * 100, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="Poisson rate (req/s)", ylabel="SLO attainment (%)", ylim=(-3, 105),
               title=f"{w}: ~{spec['input_len']} in / {spec['output_len']} out, TTFT {spec['ttft_slo_s']:g} s, "
                     f"TPOT {spec['tpot_slo_s'] * 1000:g} ms")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{figures['model']}: attainment vs rate (triangles: probe stopped early, a lower bound)", fontsize=10)
    fig.tight_layout()
    out.png(fig)


def print_summary(figures: dict[str, Any]) -> None:
    for w in figures["workloads"]:
        parts = []
        for s, rep in figures["servers"].items():
            g = rep["goodput"].get(w)
            parts.append(f"{s} {'skipped' if rep.get('skipped') else '-' if g is None else g['goodput_rps']}")
        ratios = figures["ratios"].get(w, {})
        print(f"{w}: goodput (req/s) " + ", ".join(parts)
              + "".join(f"; {s}/vllm {'-' if r is None else f'{r:.2f}x'}" for s, r in ratios.items()))
    for s, rep in figures["servers"].items():
        if rep["single"]:
            print(f"{s}: single-stream TPOT " + ", ".join(f"{w} {v['tpot_s'] * 1000:.1f} ms" for w, v in rep["single"].items()))


# ---- main ------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__, "our colocated server only, tiny model, 2 probes x 8 requests per workload")
    ap.add_argument("--model", default="smollm2-135m", help="what our servers load; vLLM loads its folder")
    ap.add_argument("--dtype", default="auto", type=harness.model_dtype, help="auto: bfloat16 on a CPU with native bf16, else float32")
    ap.add_argument("--placement", default=None, help="deploy this Placement JSON as the 'deployed' server (default: 1P1D on Ray)")
    ap.add_argument("--vllm-venv", default=str(vllm_peer.DEFAULT_VENV), help="the venv `make peers` built")
    ap.add_argument("--servers", default="vllm,colocated,deployed", help="comma-separated subset, in this order")
    ap.add_argument("--workloads", default="short,long", help="comma-separated subset of short,long")
    ap.add_argument("--max-probes", type=positive_int, default=4, help="per server and workload")
    ap.add_argument("--min-requests", type=positive_int, default=30, help="per probe")
    ap.add_argument("--probe-seconds", type=positive_float, default=40.0, help="a probe sends max(min-requests, rate x this) requests")
    ap.add_argument("--min-rate", type=non_negative_float, default=0.25, help="req/s; lower rates are not probed")
    ap.add_argument("--max-rate", type=positive_float, default=16.0, help="req/s; the search stops passing there")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="more `distserve serve` flags for our servers, e.g. '--tpot-slo 0.15'")
    ap.add_argument("--tag", default="", help="suffix of the result files' names (bench_serving_TAG.*), to keep several runs")
    ap.add_argument("--no-crosscheck", action="store_true", help="skip the vLLM-client cross-check")
    ap.add_argument("--startup-timeout", type=positive_float, default=300.0, help="seconds for a server to become healthy")
    ap.add_argument("--request-timeout", type=positive_float, default=120.0, help="seconds, per request")
    args = ap.parse_args()
    if args.quick:
        args.model, args.servers, args.max_probes, args.min_requests, args.probe_seconds = "tiny", "colocated", 2, 8, 1.0
        args.min_rate, args.startup_timeout, args.no_crosscheck = 0.5, min(args.startup_timeout, 120.0), True
    args.servers = [s for s in args.servers.split(",") if s]
    unknown = set(args.servers) - {"vllm", "colocated", "deployed"}
    if unknown:
        ap.error(f"unknown servers: {sorted(unknown)}")
    if args.max_rate <= args.min_rate:
        ap.error("--max-rate must be above --min-rate")
    return args


def main() -> None:
    args = parse_args()
    # A SIGTERM (e.g. a test timeout) unwinds through the finally blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()
    workloads = tuple(w for w in (QUICK_WORKLOADS if args.quick else WORKLOADS) if w.name in args.workloads.split(","))
    python = vllm_peer.python(args.vllm_venv)
    folder = None if args.quick else vllm_peer.model_folder(args.model)
    if folder:
        print(f"model folder (both servers load it): {folder}", flush=True)
    figures: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "quick": args.quick, "cpu_count": os.cpu_count(),
        "attainment_target": ATTAINMENT_TARGET, "max_probes": args.max_probes, "min_requests": args.min_requests,
        "probe_seconds": args.probe_seconds, "min_rate": args.min_rate, "placement": args.placement,
        "workloads": {w.name: {k: v for k, v in asdict(w).items() if k != "name"} for w in workloads},
        "servers": {}, "ratios": {},
    }
    crosscheck_with = None
    if args.no_crosscheck or python is None or folder is None or "colocated" not in args.servers:
        figures["crosscheck"] = {"skipped": "quick run" if args.quick else "no vLLM venv" if python is None
                                 else "--no-crosscheck or no colocated server"}
    else:
        crosscheck_with = (python, folder)
    rows: list[dict[str, Any]] = []
    for name in args.servers:
        report: dict[str, Any] = {"single": {}, "goodput": {}}
        figures["servers"][name] = report
        if name == "vllm":
            if python is None or folder is None:
                report["skipped"] = f"no vLLM venv at {args.vllm_venv} (run `make peers`)" if python is None else "quick run"
                print(f"vllm: skipped ({report['skipped']})", flush=True)
                continue
            server = vllm_peer.server(python, folder, args.model, args.dtype, args.startup_timeout)
            report["env"] = vllm_peer.SERVER_ENV
        else:
            server = distserve_server(args, name)
        report["command"] = " ".join(server.argv[1:])
        try:
            measure_server(args, server, workloads, report, rows, crosscheck_with if name == "colocated" else None)
        except RuntimeError as exc:  # a server that does not start or answer: reported, the others still run
            report["error"] = str(exc)[-3000:]
            print(f"{name}: FAILED: {exc}", file=sys.stderr, flush=True)
        if "crosscheck" in report:
            figures["crosscheck"] = report.pop("crosscheck")
    vllm_report = figures["servers"].get("vllm", {})
    for w in workloads:
        theirs = vllm_report.get("goodput", {}).get(w.name, {}).get("goodput_rps")
        figures["ratios"][w.name] = {
            s: _ratio(rep["goodput"][w.name]["goodput_rps"], theirs)
            for s, rep in figures["servers"].items() if s != "vllm" and w.name in rep["goodput"]
        }
    figures["num_errors"] = sum(r["num_errors"] for r in rows)
    figures["num_probes"] = len(rows)
    figures["max_other_cores"] = max((r["other_cores"] for r in rows), default=0.0)
    figures["wall_s"] = round(time.monotonic() - t_start, 1)
    print_summary(figures)
    figures["serve_args"] = args.serve_args
    write_outputs(Outputs.for_run(args, "bench_serving", args.tag), figures, rows)
    harness.finish(figures)


if __name__ == "__main__":
    main()
