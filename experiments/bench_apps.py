"""Whole LLM applications on one server, two ways: as dataflow programs vs request by request (Parrot's comparison).

Starts ``distserve serve`` (SmolLM2-135M deployed as ``make serve`` does: 1 prefill + 1 decode
instance on Ray; ``--quick``: the tiny model on one in-process colocated engine) and runs the five
apps of ``experiments/apps`` (chain and map-reduce summarisation, multi-agent coding, a copilot with
one long shared system prompt, chat mixed with map-reduce jobs) both ways in one run, at each
simulated client↔server delay (``--delays-ms``, default 0 and 250 ms, a round trip added to every
HTTP request of both clients; Parrot used 200-300 ms):

* **dataflow**: our frontend; the whole DAG submitted with the app's objective in two rounds of
  concurrent requests whatever its depth (the calls reading no other call together with the
  creation of the variables the others pass on, then every other call with its output bound to
  its variable), only the final variables read; the server runs the DAG;
* **request-centric**: the OpenAI completions API; the client awaits each call before issuing its
  dependents and sends independent calls concurrently.

Every output has a fixed length (greedy, ``max_tokens`` with EOS ignored), so both ways do the
same work. Each (app, delay, way) runs ``--reps`` times (the ways alternate which goes first) with
fresh texts each time (so no run reuses another's KV); the figure is the median end-to-end latency
(for ``mixed``: the median chat request latency) and the ratio request-centric / dataflow.

What each ratio measures:

* ``chain``: round trips saved. Both ways run the same calls one after another; request by
  request, each call also waits for the client to receive the previous output and send the next
  request (one delay and one HTTP hop per call), while the server starts a dependent call as soon
  as its input is produced. At delay 0 the ratio is ~1; it grows with the delay (Parrot: 1.38x).
* ``map_reduce``: round trips saved plus dispatch: the maps go out in parallel both ways, but the
  reduce waits for the client to collect every map output and send it back (Parrot: 2.37x, most of
  it from batching the maps together with a throughput-aware scheduler).
* ``multi_agent``: round trips on the critical path (architect → coders → reviewer: two hops) and
  prefix reuse of the shared, growing context (Parrot: 2.45x over vLLM's throughput configuration).
* ``copilot``: no dependent calls, so no round trips to save; each user's dataflow program makes
  two requests (submit, then read) where a completion makes one, but the read goes out while the
  call runs, so it costs nothing extra when the call takes longer than a round trip. A ratio above 1 would be prefix reuse of the shared system prompt by one way and not the other
  (with prefix caching on both paths, ~1 at delay 0). Its runs vary most: whether the users'
  prefills find the system prompt already cached depends on how they land in prefill batches.
* ``mixed``: the chat latency while map-reduce jobs run; what the objective (``throughput`` for the
  jobs) buys through scheduling classes (Parrot: 5.5x, by keeping batch work off the chat's
  instance). Without scheduling classes in the cluster core the ratio only reflects load timing.

Prefill tokens computed vs reused come from the server's ``/metrics`` counters
``distserve:prefill_tokens_computed`` and ``distserve:prefix_cache_hits`` (summed over the
instances), read before and after every run; a server that does not export them gives ``null``.

``--figures`` measures Parrot's figures instead (``experiments/app_figures.py``: chain latency vs
output length, multi-agent latency vs programs at once, copilot latency per output token vs users at
once; both ways at ``--figure-delay-ms``) and writes ``bench_apps_figures.{json,md,png}``;
``slo_sweep.py --render-apps`` redraws them from the JSON.

Writes ``bench_apps.{json,md}`` under ``--out-dir`` (``experiments/results/`` by default; a new
temporary directory with ``--quick``, which the test suite runs). The last stdout line is one JSON
object of figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

import harness
from distserve.cli.arg_types import non_negative_float, positive_float, positive_int
from app_figures import FIGURES, markdown_lines, render, summarize_figures
from apps import App, AppResult, DataflowClient, RequestClient, make_apps
from distserve.measure.benchserve import ServerProcess, distserve_serve_argv, wait_until_idle
from harness import Outputs

WAYS = ("request_centric", "dataflow")
COUNTERS = {"prefill_computed": "distserve:prefill_tokens_computed", "prefix_reused": "distserve:prefix_cache_hits"}
# name, labels, value of a Prometheus text sample
_SAMPLE = re.compile(r"^([\w:]+)(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


def read_counters(base_url: str) -> dict[str, float | None]:
    """The prefill counters now: per counter the sum over its samples (``NAME`` or ``NAME_total``; one
    per instance, or the runtime's total alone); None for a counter the server does not export."""
    root = base_url.rstrip("/").removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", timeout=10.0, trust_env=False).text
    out: dict[str, float | None] = {}
    for key, name in COUNTERS.items():
        samples = [float(v) for n, _, v in _SAMPLE.findall(text) if n in (name, name + "_total")]
        out[key] = sum(samples) if samples else None
    return out


def counter_delta(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if before[k] is None or after[k] is None else after[k] - before[k] for k in COUNTERS}  # type: ignore[operator]


async def run_once(app: App, way: str, base_url: str, delay_s: float) -> AppResult:
    rc = RequestClient(base_url, delay_s)
    try:
        if way == "dataflow":
            return await app.dataflow(DataflowClient(base_url, delay_s), rc)
        return await app.request_centric(rc)
    finally:
        await rc.aclose()


async def warm_up(base_url: str) -> None:
    rc = RequestClient(base_url)
    try:
        await rc.completion("Warm up.", max_tokens=2, temperature=0)
    finally:
        await rc.aclose()


Cell = tuple[dict[str, Any], Callable[[int], App]]  # a row's fixed fields (with "app" and "delay_ms"), the app for a seed


def table_cells(args: argparse.Namespace) -> list[Cell]:
    """The table: every app of ``make_apps`` (or ``--apps``) at every delay."""
    names = [app.name for app in make_apps(args.quick, 0)]
    return [({"app": name, "delay_ms": delay_ms}, lambda seed, i=index: make_apps(args.quick, seed)[i])
            for delay_ms in args.delays_ms for index, name in enumerate(names) if not args.apps or name in args.apps]


def figure_cells(args: argparse.Namespace) -> list[Cell]:
    """``--figures``: every point of Parrot's figures (``app_figures.FIGURES``) at ``--figure-delay-ms``."""
    return [({"app": fig.app, "delay_ms": args.figure_delay_ms, fig.param: value},
             lambda seed, fig=fig, value=value: fig.make(value, seed, args.quick))
            for fig in FIGURES if not args.apps or fig.app in args.apps
            for value in (fig.quick_values if args.quick else fig.values)]


def measure(args: argparse.Namespace, base_url: str, cells: list[Cell]) -> list[dict[str, Any]]:
    """Every (cell, rep, way) once; one row each."""
    rows = []
    for fields, make in cells:
        for rep in range(args.reps):
            for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                seed = args.seed + 1 + len(rows)  # fresh texts every run
                app = make(seed)
                delay_ms = fields["delay_ms"]
                wait_until_idle(base_url)
                before = read_counters(base_url)
                result, other_cores = harness.watched(lambda: asyncio.run(run_once(app, way, base_url, delay_ms / 1000)))
                row = {**fields, "rep": rep, "way": way, "seed": seed,
                       "latency_s": round(result.latency_s, 4), "other_cores": round(other_cores, 2),
                       "num_outputs": len(result.outputs), "output_chars": sum(len(o) for o in result.outputs),
                       **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.extra.items()},
                       **counter_delta(before, read_counters(base_url))}
                rows.append(row)
                point = " ".join(f"{k} {v}" for k, v in fields.items() if k not in ("app", "delay_ms"))
                print(f"  {app.name:<11} {point} delay {delay_ms:>4g} ms  rep {rep}  {way:<15} {result.latency_s * 1000:8.0f} ms  "
                      f"prefill computed {row['prefill_computed']}, reused {row['prefix_reused']}  "
                      f"(others {other_cores:.2f} cores)", flush=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per app and delay: each way's median latency and counters (summed over reps), and the ratio."""
    table: dict[str, Any] = {}
    for row in rows:
        cell = table.setdefault(row["app"], {}).setdefault(str(row["delay_ms"]), {w: [] for w in WAYS})
        cell[row["way"]].append(row)
    for app, by_delay in table.items():
        for delay, cell in by_delay.items():
            out: dict[str, Any] = {}
            for way in WAYS:
                runs = cell[way]
                out[way] = {
                    "latency_s": round(statistics.median(r["latency_s"] for r in runs), 4), "num_runs": len(runs),
                    "other_cores": round(statistics.fmean(r["other_cores"] for r in runs), 2),
                    **{k: None if any(r[k] is None for r in runs) else sum(r[k] for r in runs) for k in COUNTERS},
                    **({"jobs_s": round(statistics.median(r["jobs_s"] for r in runs), 4)} if "jobs_s" in runs[0] else {}),
                }
            df, rc = out["dataflow"]["latency_s"], out["request_centric"]["latency_s"]
            out["ratio"] = round(rc / df, 3) if df > 0 else None
            by_delay[delay] = out
    return table


def markdown(figures: dict[str, Any]) -> list[str]:
    md = [f"{figures['model']} on `distserve serve {figures['serve_flags']}`, {figures['cpu_count']} cores; median of "
          f"{figures['reps']} runs per cell; latency = end-to-end (mixed: median chat request latency); ratio = request-centric / "
          "dataflow; prefill tokens summed over the runs (computed / reused from the prefix cache; - when the server does not "
          "export the counters); others = mean CPU the rest of this shared machine used during the runs (cores).", "",
          "| app | delay (ms) | request-centric (ms) | dataflow (ms) | ratio | prefill computed RC / DF | prefix reused RC / DF "
          "| others RC / DF |",
          "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for app, by_delay in figures["apps"].items():
        for delay, c in by_delay.items():
            rc, df, ratio = c["request_centric"], c["dataflow"], c["ratio"]
            md.append(f"| {app} | {delay} | {harness.ms(rc['latency_s'])} | {harness.ms(df['latency_s'])} | "
                      f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
                      f"{fmt(rc['prefill_computed'])} / {fmt(df['prefill_computed'])} | {fmt(rc['prefix_reused'])} / {fmt(df['prefix_reused'])} | "
                      f"{rc['other_cores']:.2f} / {df['other_cores']:.2f} |")
    mixed = figures["apps"].get("mixed")
    if mixed:
        md += ["", "mixed: map-reduce jobs' completion time (median, ms), request-centric / dataflow: "
               + ", ".join(f"delay {d} ms: {harness.ms(c['request_centric']['jobs_s'])} / {harness.ms(c['dataflow']['jobs_s'])}"
                           for d, c in mixed.items())]
    return md


def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__, "the tiny model on one in-process engine, small apps, one run per cell")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", type=harness.model_dtype, help="auto: bfloat16 on a CPU with native bf16, else float32")
    ap.add_argument("--serve-flags", default="--prefill 1 --decode 1 --runtime ray",
                    help="`distserve serve` deployment flags (default: make serve's; --quick: --colocated 1 --runtime local)")
    ap.add_argument("--delays-ms", default="0,250", help="comma-separated simulated client<->server round-trip delays")
    ap.add_argument("--reps", type=positive_int, default=5, help="runs per (app, delay, way); the median is reported")
    ap.add_argument("--apps", default="", help="comma-separated subset of chain,map_reduce,multi_agent,copilot,mixed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=positive_float, default=300.0)
    ap.add_argument("--figures", action="store_true",
                    help="measure Parrot's figures instead of the table: chain latency vs output length, multi-agent latency vs "
                         "programs at once, copilot latency per token vs users at once (experiments/app_figures.py); writes "
                         "bench_apps_figures.{json,md,png}")
    ap.add_argument("--figure-delay-ms", type=non_negative_float, default=None,
                    help="--figures: the client<->server round trip of every point (default 250; --quick: 50)")
    args = ap.parse_args()
    if args.quick:
        args.model, args.serve_flags, args.reps = "tiny", "--colocated 1 --runtime local", 1
    if args.figure_delay_ms is None:
        args.figure_delay_ms = 50.0 if args.quick else 250.0  # quick: the round trips still count, at a fifth of the wait
    try:
        delays = [non_negative_float(d) for d in args.delays_ms.split(",") if d]
    except argparse.ArgumentTypeError as exc:
        ap.error(f"--delays-ms: each delay {exc}")
    args.delays_ms = [int(d) if d.is_integer() else d for d in delays]
    args.apps = {a for a in args.apps.split(",") if a}
    known = {f.app for f in FIGURES} if args.figures else {a.name for a in make_apps(args.quick, 0)}
    if args.apps - known:
        ap.error(f"--apps: unknown {sorted(args.apps - known)}; known{' with --figures' if args.figures else ''}: {sorted(known)}")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally that stops the server
    t_start = time.monotonic()
    out = Outputs.for_run(args, "bench_apps_figures" if args.figures else "bench_apps")
    server = ServerProcess("distserve", distserve_serve_argv(args.model, args.dtype, shlex.split(args.serve_flags)), args.startup_timeout)
    figures: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "serve_flags": args.serve_flags, "quick": args.quick,
                               "cpu_count": os.cpu_count(), "reps": args.reps, "delays_ms": args.delays_ms}
    try:
        base_url = server.start()
        print(f"server: `{' '.join(server.argv[1:])}` at {base_url} in {server.startup_s:.1f} s", flush=True)
        asyncio.run(warm_up(base_url))
        rows = measure(args, base_url, figure_cells(args) if args.figures else table_cells(args))
    finally:
        figures.update(harness.stop_server(server))
    figures["counters_exported"] = all(r[k] is not None for r in rows for k in ("prefill_computed", "prefix_reused"))
    figures["wall_s"] = round(time.monotonic() - t_start, 1)
    if args.figures:
        figures["figure_delay_ms"] = args.figure_delay_ms
        figures["figures"] = summarize_figures(rows)
        md = [f"{args.model} on `distserve serve {args.serve_flags}`, {figures['cpu_count']} cores; median of {args.reps} runs per "
              f"point; client<->server round trip {args.figure_delay_ms:g} ms; ratio = request-centric / dataflow.", "",
              *markdown_lines(figures["figures"])]
        out.png(render(figures["figures"], f"{args.model}, {args.serve_flags}, round trip {args.figure_delay_ms:g} ms"))
    else:
        figures["apps"] = summarize(rows)
        md = markdown(figures)
    out.json({"figures": figures, "rows": rows})
    out.markdown(md)
    print("\n".join(md), flush=True)
    harness.finish(figures)


if __name__ == "__main__":
    main()
