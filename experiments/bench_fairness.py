"""Fair queueing under a flood, measured: one tenant floods, light tenants chat (issue 17).

One run, real engine on CPU, the same client for every scenario (``distserve.measure.loadgen``,
streaming, one ``Authorization: Bearer`` key per tenant, tenants from an ``--api-keys`` file; each
tenant a client process of its own, as separate users are; the same arrivals and prompt lengths in
every scenario, fresh prompt words in each, so none is in the server's prefix cache already):

* ``light alone``: three light tenants (chat: short prompts) at ``--light-rate`` each;
* ``flood + light``: the same light requests (same seeds) while ``flood`` sends long prompts at
  ``--flood-factor`` (10) times a light tenant's rate — once against a server with
  ``--admission-policy fcfs``, once with ``fair`` (the default);
* ``interactive alone`` and ``interactive + batch``: an interactive-tier tenant alone, then next
  to a batch-tier tenant flooding (``fair``: batch work is dispatched only when no other waits).

It reports each tenant's P99 TTFT, the light tenants' P99 TTFT under each policy over their P99
alone (target: fair <= 1.5x, goal 1.2x), total throughput fair vs fcfs (target: drop < 5%),
interactive P99 TTFT with batch over alone (target <= 1.2x), per-tenant TTFT CDFs (PNG), and the
simulator's per-tenant prediction for the flood scenarios: the measured requests (send times,
prompt and output tokens, tenants) simulated on the same placement with the same admission
settings and the CPU latency profile (``--profile``, default the committed SmolLM2 profile of
this machine). ``--quick``: the tiny model, about a second of arrivals per scenario, no verdicts (its simulated
figures use the SmolLM2 profile, so only the code path is meaningful). The JSON keeps every request
as the client recorded it; ``--predict-from FILE.json`` re-runs only the simulator's prediction on
them (no server), to check a change to the simulator against a measured run.

The last stdout line is one JSON object of the measured figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import multiprocessing
import secrets
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import harness
from distserve.cli.arg_types import positive_float, positive_int
from distserve.measure.benchserve import ServerProcess, distserve_serve_argv, wait_until_idle
from distserve.measure.loadgen import run_load_async
from distserve.measure.stream_client import RequestResult, calibrate_tokens_per_word
from distserve.measure.workload import Workload
from harness import Outputs, ms

LIGHT = ("light-1", "light-2", "light-3")
FLOOD, VIP, NIGHTLY = "flood", "vip", "nightly"
TIERS = {VIP: "interactive", NIGHTLY: "batch"}
DEFAULT_PROFILE = harness.RESULTS_DIR / "validate_simulator_profile.json"
# The scenario the same server ran just before: its fair-queue shares carry over into the prediction.
BEFORE = {"flood+light fair": "light alone"}


@dataclass(frozen=True)
class Load:
    """What one tenant sends in a scenario."""

    tenant: str
    rate: float  # requests/s
    input_len: int
    seed: int  # arrivals and prompt lengths: the same in every scenario the tenant is in
    prompt_seed: int | None = None  # the prompt words: each scenario's own, so no prompt is in the prefix cache already


def parse_args() -> Any:
    p = harness.parser(__doc__, "tiny model, about a second of arrivals per scenario (the test suite's run)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", type=harness.model_dtype, help="auto: bfloat16 on a CPU with native bf16, else float32")
    p.add_argument("--runtime", default="local", choices=["local", "ray"], help="`distserve serve --runtime`")
    p.add_argument("--serve-flag", action="append", default=[],
                   help="extra `distserve serve` flag (repeatable, FLAG=VALUE form), e.g. --prefill-chunk=128 (the simulator's prediction follows it)")
    p.add_argument("--duration", type=positive_float, default=120.0, help="seconds each scenario sends for")
    p.add_argument("--light-rate", type=positive_float, default=0.1, help="requests/s of each light tenant (and of the interactive one)")
    p.add_argument("--flood-factor", type=positive_float, default=10.0, help="the flooding (and batch) tenant's rate over a light tenant's")
    p.add_argument("--light-input", type=positive_int, default=64, help="prompt tokens of a light (chat) request")
    p.add_argument("--flood-input", type=positive_int, default=512, help="prompt tokens of a flood (and batch) request")
    p.add_argument("--output-len", type=positive_int, default=32)
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="latency profile for the simulator's prediction ('' : none)")
    p.add_argument("--tag", default="", help="suffix of the result files' names (bench_fairness_TAG.*)")
    p.add_argument("--predict-from", default="",
                   help="a bench_fairness JSON of an earlier run: only re-run the simulator's prediction on its recorded requests (no server)")
    args = p.parse_args()
    if args.quick:
        # One second per scenario at twice the light rate: each tenant sends as many requests as in 2 s at 1 req/s.
        args.model, args.dtype, args.duration, args.light_rate = "tiny", "float32", 1.0, 2.0
        args.flood_factor, args.light_input, args.flood_input, args.output_len = 4.0, 16, 96, 8
        # The simulator's prediction still runs (on the committed SmolLM2 profile): the code path, not the figure, is checked.
    return args


def key_file(path: Path) -> dict[str, str]:
    """Write the tenants' key file; returns tenant -> key."""
    keys = {t: f"sk-{t}-{secrets.token_hex(12)}" for t in (*LIGHT, FLOOD, VIP, NIGHTLY)}
    tenants = {t: ({"tier": TIERS[t]} if t in TIERS else {}) for t in keys}
    path.write_text(json.dumps({"tenants": tenants, "keys": {k: t for t, k in keys.items()}}))
    return keys


def start_server(args: Any, policy: str, keys_path: Path) -> ServerProcess:
    flags = ["--api-keys", str(keys_path), "--admission-policy", policy, "--runtime", args.runtime, *args.serve_flag]
    server = ServerProcess(f"distserve-{policy}", distserve_serve_argv(args.model, args.dtype, flags), startup_timeout_s=600)
    server.start()
    print(f"{server.name}: up at {server.base_url} in {server.startup_s:.0f} s", flush=True)
    return server


def run_tenant(base_url: str, model: str, load: Load, api_key: str, args: Any, calibration: tuple[float, float],
               start_s: float) -> list[RequestResult]:
    """One tenant's load, in a process of its own (``run_scenario``): its results with times from
    ``start_s`` (a ``time.perf_counter`` reading, which is system-wide on Linux, taken by the parent)."""
    n = max(1, round(load.rate * args.duration))
    workload = Workload(n, load.rate, load.input_len, args.output_len, input_len_dist="uniform", input_len_spread=0.25,
                        seed=load.seed, prompt_seed=load.prompt_seed, ignore_eos=True)
    # Each tenant is a Poisson stream of its own from the scenario's start: its first request
    # comes an exponential gap in, as every later one (the load generator sends its first at 0,
    # which would line every tenant's first request up at the same instant).
    offset_s = float(np.random.default_rng(load.seed).exponential(1.0 / load.rate))
    time.sleep(max(0.0, start_s + offset_s - time.perf_counter()))
    began = time.perf_counter() - start_s
    result = asyncio.run(run_load_async(base_url, model, workload, api_key=api_key, tokens_per_word=calibration,
                                        request_timeout_s=max(600.0, 4 * args.duration)))
    return [shifted(r, began) for r in result.requests]


def run_scenario(clients: ProcessPoolExecutor, base_url: str, model: str, loads: list[Load], keys: dict[str, str], args: Any,
                 calibration: tuple[float, float]) -> dict[str, list[RequestResult]]:
    """Every tenant's load at once, each through its own key and from a client process of its own
    (``clients`` has a worker per tenant), as separate users are: in one event loop, a light tenant's
    first token would wait while the loop parses a flood's streams. Results per tenant, times from
    the scenario's start."""
    t0 = time.perf_counter()
    start_s = t0 + 0.5  # every client has its task by then
    futures = {load.tenant: clients.submit(run_tenant, base_url, model, load, keys[load.tenant], args, calibration, start_s)
               for load in loads}
    out = {tenant: f.result() for tenant, f in futures.items()}
    print(f"  {', '.join(f'{t}:{len(r)}' for t, r in out.items())} requests in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def shifted(r: RequestResult, offset_s: float) -> RequestResult:
    """``r`` with its times counted from the scenario's start instead of its tenant's first request."""
    times = ("arrival_s", "sent_s", "first_token_s", "last_token_s", "finish_s")
    return dataclasses.replace(r, **{f: getattr(r, f) + offset_s for f in times if getattr(r, f) is not None})


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else math.nan


def ttfts(results: list[RequestResult]) -> list[float]:
    return [r.ttft_s for r in results if r.completed and r.ttft_s is not None]


def scenario_figures(results: dict[str, list[RequestResult]]) -> dict[str, Any]:
    """Per tenant P50/P99 TTFT and counts; overall throughput over the scenario's span."""
    every = [r for rs in results.values() for r in rs]
    done = [r for r in every if r.completed]
    start = min((r.sent_s for r in every if r.sent_s is not None), default=0.0)
    end = max((r.finish_s for r in done if r.finish_s is not None), default=start)
    span = max(end - start, 1e-9)
    tokens = sum((r.num_prompt_tokens or 0) + r.num_output_tokens for r in done)
    return {
        "tenants": {t: {"num_requests": len(rs), "num_completed": sum(r.completed for r in rs),
                        "num_errors": sum(r.error is not None for r in rs),
                        "errors": sorted({(r.error or "")[:120] for r in rs if r.error})[:3],
                        "ttft_p50_s": float(np.percentile(ttfts(rs), 50)) if ttfts(rs) else math.nan,
                        "ttft_p99_s": p99(ttfts(rs))} for t, rs in results.items()},
        "span_s": span,
        "throughput_tokens_per_s": tokens / span,
        "throughput_requests_per_s": len(done) / span,
        "output_tokens_per_s": sum(r.num_output_tokens for r in done) / span,
    }


def pooled_p99(results: dict[str, list[RequestResult]], tenants: tuple[str, ...]) -> float:
    return p99([x for t in tenants for x in ttfts(results.get(t, []))])


def simulate_prediction(args: Any, policy: str, results: dict[str, list[RequestResult]],
                        before: dict[str, list[RequestResult]] | None = None) -> dict[str, Any] | None:
    """Per-tenant P99 TTFT the simulator predicts for these very requests (None: no profile).

    ``before``: a scenario the same server ran just before (``light alone`` before ``flood+light fair``),
    simulated first: the fair queue's recent shares, decayed per dispatched token and not per second,
    carry over, so tenants busy then start this scenario backlogged and a newcomer (the flood) sparse.
    """
    if not args.profile or not Path(args.profile).exists():
        return None
    from distserve.cli.args import build_parser
    from distserve.cluster.admission import AdmissionConfig
    from distserve.cluster.tenants import TenantSpec
    from distserve.config import SchedulerConfig
    from distserve.placement import Placement
    from simulator.latency import FittedLatencyModel
    from simulator.simulation import SimConfig, simulate
    from simulator.workload import Request

    sent: list[tuple[float, int, int, str, bool]] = []  # (arrival, prompt, output, tenant, measured here)
    start = 0.0
    for run, counted in ((before or {}, False), (results, True)):
        rs = [(tenant, r) for tenant, tenant_rs in run.items() for r in tenant_rs if r.sent_s is not None and r.completed]
        sent += [(start + r.sent_s, int(r.num_prompt_tokens or r.input_len), max(1, r.num_output_tokens), tenant, counted)  # type: ignore[operator]
                 for tenant, r in rs]
        start += max((r.finish_s or r.sent_s or 0.0 for _, r in rs), default=0.0) + 60.0  # the server went idle in between
    sent.sort(key=lambda x: x[0])
    requests = [Request(k, a, p, o, tenant=t, tier=TIERS.get(t, "default")) for k, (a, p, o, t, _) in enumerate(sent)]
    placement = Placement.colocated_instances(1) if any("colocated" in f for f in args.serve_flag) else Placement.disaggregated(1, 1)
    tenants = tuple(TenantSpec(t, tier=TIERS.get(t, "default")) for t in sorted({x[3] for x in sent}))
    chunk = next((int(f.split("=", 1)[1]) for f in args.serve_flag if f.startswith("--prefill-chunk=")), None)
    prefill = SchedulerConfig() if chunk is None else SchedulerConfig(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    # Each instance's KV as the server sizes it (``serve --kv-cache-gb``): admission ranks keep a
    # reserve of the prefill instance's (``engine.rank_order``), which binds only once it fills.
    serve = build_parser().parse_args(["serve", *args.serve_flag])
    latency = FittedLatencyModel.from_profile(args.profile)
    num_blocks = int(serve.kv_cache_gb * (1 << 30) // (latency.model.kv_bytes_per_token * serve.block_size))
    config = SimConfig(block_size=serve.block_size, num_blocks=num_blocks, admission=AdmissionConfig(policy, tenants), prefill_scheduler=prefill)
    sim = simulate(placement, latency, requests, config)
    by_tenant: dict[str, list[float]] = {}
    for rec in sim.records:
        if rec.ttft_s is not None and sent[rec.req_id][4]:
            by_tenant.setdefault(rec.tenant, []).append(rec.ttft_s)
    return {t: p99(v) for t, v in by_tenant.items()}


def plot(out: Outputs, runs: dict[str, dict[str, list[RequestResult]]]) -> None:
    plt = harness.pyplot()
    panels = [("fcfs: flood + light", "flood+light fcfs"), ("fair: flood + light", "flood+light fair"),
              ("light alone", "light alone"), ("interactive vs batch (fair)", "interactive+batch")]
    panels = [(title, key) for title, key in panels if key in runs]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True)
    for ax, (title, key) in zip(np.atleast_1d(axes), panels):
        for tenant, rs in runs[key].items():
            xs = sorted(ttfts(rs))
            if xs:
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=tenant)
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("TTFT (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("fraction of requests")
    fig.tight_layout()
    out.png(fig)


def ratio(a: float, b: float) -> float | None:
    return a / b if b and math.isfinite(a) and math.isfinite(b) and b > 0 else None


def predict(args: Any, runs: dict[str, dict[str, list[RequestResult]]]) -> dict[str, dict[str, Any] | None]:
    """The simulator's per-tenant P99 TTFT for each flood scenario (after the one its server ran before)."""
    return {name: simulate_prediction(args, name.split()[-1], runs[name], before=runs.get(BEFORE.get(name, "")))
            for name in ("flood+light fcfs", "flood+light fair")}


def save_requests(runs: dict[str, dict[str, list[RequestResult]]]) -> dict[str, Any]:
    """Every request of every scenario as the client recorded it (so a prediction can be re-run offline)."""
    return {name: {t: [dataclasses.asdict(r) for r in rs] for t, rs in results.items()} for name, results in runs.items()}


def load_requests(path: str) -> dict[str, dict[str, list[RequestResult]]]:
    data = json.loads(Path(path).read_text())
    if "requests" not in data:
        raise SystemExit(f"--predict-from: {path} has no recorded requests (written by an older bench_fairness)")
    return {name: {t: [RequestResult(**r) for r in rs] for t, rs in results.items()} for name, results in data["requests"].items()}


def predict_only(args: Any) -> None:
    """``--predict-from``: the simulator's per-tenant P99 TTFT next to the measured one, for a recorded run."""
    runs = load_requests(args.predict_from)
    figures: dict[str, Any] = {}
    for name, pred in predict(args, runs).items():
        figures[name] = {t: {"measured_p99_ttft_s": p99(ttfts(rs)), "simulated_p99_ttft_s": (pred or {}).get(t)} for t, rs in runs[name].items()}
        for t, f in figures[name].items():
            print(f"{name:18s} {t:8s} measured P99 {ms(f['measured_p99_ttft_s']):>8s} ms  simulated {ms(f['simulated_p99_ttft_s']):>8s} ms")
    light = {name: {"measured": pooled_p99(runs[name], LIGHT),
                    "simulated": max((f["simulated_p99_ttft_s"] or math.nan) for t, f in figures[name].items() if t in LIGHT)}
             for name in figures}
    harness.finish({"predict_from": args.predict_from, "light_p99_ttft_s": light, "tenants": figures})


def main() -> None:
    args = parse_args()
    if args.predict_from:
        predict_only(args)
        return
    out = Outputs.for_run(args, "bench_fairness", args.tag)
    keys_path = out.out_dir / f"{out.stem}_keys.json"
    keys = key_file(keys_path)
    light = [Load(t, args.light_rate, args.light_input, 100 + i) for i, t in enumerate(LIGHT)]
    flood = Load(FLOOD, args.light_rate * args.flood_factor, args.flood_input, 200)
    vip = Load(VIP, args.light_rate, args.light_input, 300)
    nightly = Load(NIGHTLY, args.light_rate * args.flood_factor, args.flood_input, 400)
    scenarios = {"fcfs": [("flood+light fcfs", [flood, *light])],
                 "fair": [("light alone", light), ("flood+light fair", [flood, *light]), ("interactive alone", [vip]),
                          ("interactive+batch", [vip, nightly])]}
    # The same arrivals and lengths in every scenario, fresh prompt words in each: a server that ran
    # "light alone" just before "flood+light fair" would otherwise find the light prompts in its
    # prefix cache and skip most of their prefill.
    names = [name for named in scenarios.values() for name, _ in named]
    scenarios = {policy: [(name, [dataclasses.replace(load, prompt_seed=load.seed + 1000 * (names.index(name) + 1)) for load in loads])
                          for name, loads in named] for policy, named in scenarios.items()}
    runs: dict[str, dict[str, list[RequestResult]]] = {}
    servers: dict[str, Any] = {}
    calibration: tuple[float, float] | None = None
    watch = harness.LoadWatch()
    # One client process per tenant of the largest scenario, started (spawned) once for the whole run.
    num_clients = max(len(loads) for named in scenarios.values() for _, loads in named)
    clients = ProcessPoolExecutor(num_clients, mp_context=multiprocessing.get_context("spawn"))
    with watch, clients:
        list(clients.map(time.sleep, [0.5] * num_clients))  # every worker up before the first scenario
        for policy in ("fcfs", "fair"):
            server = start_server(args, policy, keys_path)
            try:
                model = args.model

                async def calibrate() -> tuple[float, float]:
                    import httpx

                    async with httpx.AsyncClient(trust_env=False, timeout=120) as client:
                        return await calibrate_tokens_per_word(client, server.base_url + "/completions", model,
                                                               {"Authorization": f"Bearer {keys[VIP]}"})

                calibration = calibration or asyncio.run(calibrate())
                # Warm-up: one uncounted light round so one-off costs land in no scenario.
                run_scenario(clients, server.base_url, model, [Load(VIP, 2.0, args.light_input, 1)], keys,
                             _with(args, duration=min(2.0, args.duration)), calibration)
                for name, loads in scenarios[policy]:
                    wait_until_idle(server.base_url.removesuffix("/v1"), timeout_s=600)
                    print(f"{name} ...", flush=True)
                    runs[name] = run_scenario(clients, server.base_url, model, loads, keys, args, calibration)
            finally:
                servers[policy] = harness.stop_server(server)
    figures = {name: scenario_figures(rs) for name, rs in runs.items()}
    alone = pooled_p99(runs["light alone"], LIGHT)
    fcfs, fair = pooled_p99(runs["flood+light fcfs"], LIGHT), pooled_p99(runs["flood+light fair"], LIGHT)
    vip_alone, vip_batch = pooled_p99(runs["interactive alone"], (VIP,)), pooled_p99(runs["interactive+batch"], (VIP,))
    thr_fcfs = figures["flood+light fcfs"]["throughput_tokens_per_s"]
    thr_fair = figures["flood+light fair"]["throughput_tokens_per_s"]
    predicted = predict(args, runs)
    summary = {
        "model": args.model, "runtime": args.runtime, "serve_flags": args.serve_flag, "duration_s": args.duration,
        "light_rate": args.light_rate, "flood_factor": args.flood_factor, "quick": args.quick,
        "light_p99_ttft_alone_s": alone, "light_p99_ttft_fcfs_s": fcfs, "light_p99_ttft_fair_s": fair,
        "light_fcfs_over_alone": ratio(fcfs, alone), "light_fair_over_alone": ratio(fair, alone),
        "throughput_fair_over_fcfs": ratio(thr_fair, thr_fcfs),
        "interactive_p99_ttft_alone_s": vip_alone, "interactive_p99_ttft_with_batch_s": vip_batch,
        "interactive_with_batch_over_alone": ratio(vip_batch, vip_alone),
        "num_errors": sum(t["num_errors"] for f in figures.values() for t in f["tenants"].values()),
        "processes_left": sum(s["processes_left"] for s in servers.values()),
        "other_cores": round(watch.other_cores, 2),
    }
    if predicted["flood+light fair"] is not None:
        for name, pred in predicted.items():
            light_pred = [pred[t] for t in LIGHT if t in pred]
            summary[f"sim_light_p99_ttft_{name.split()[-1]}_s"] = max(light_pred) if light_pred else None
    if not args.quick:
        summary["verdicts"] = {
            "light_fair_within_1.5x_alone": (summary["light_fair_over_alone"] or math.inf) <= 1.5,
            "throughput_drop_below_5pct": (summary["throughput_fair_over_fcfs"] or 0) >= 0.95,
            "interactive_within_1.2x_alone": (summary["interactive_with_batch_over_alone"] or math.inf) <= 1.2,
        }
    out.json({"summary": summary, "scenarios": figures, "predicted_p99_ttft_s": predicted, "requests": save_requests(runs)})
    write_markdown(out, summary, figures, predicted)
    plot(out, runs)
    harness.finish(summary)


def _with(args: Any, **changes: Any) -> Any:
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})


def write_markdown(out: Outputs, summary: dict[str, Any], figures: dict[str, Any], predicted: dict[str, Any]) -> None:
    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    lines = [
        f"{summary['model']} on this machine ({summary['runtime']} runtime{', ' + ' '.join(summary['serve_flags']) if summary['serve_flags'] else ''}); "
        f"light tenants {summary['light_rate']:g} req/s each, flood and batch {summary['flood_factor']:g}x that; "
        f"{summary['duration_s']:g} s per scenario.", "",
        "| figure | value | target |", "|---|---|---|",
        f"| light P99 TTFT alone / fcfs / fair (ms) | {ms(summary['light_p99_ttft_alone_s'])} / {ms(summary['light_p99_ttft_fcfs_s'])} / "
        f"{ms(summary['light_p99_ttft_fair_s'])} | |",
        f"| light P99 TTFT fcfs / alone | {x(summary['light_fcfs_over_alone'])} | |",
        f"| light P99 TTFT fair / alone | {x(summary['light_fair_over_alone'])} | <= 1.5x (goal 1.2x) |",
        f"| throughput (tokens/s) fair / fcfs | {x(summary['throughput_fair_over_fcfs'])} | >= 0.95x |",
        f"| interactive P99 TTFT with batch / alone | {x(summary['interactive_with_batch_over_alone'])} | <= 1.2x |",
        "", "| scenario | tenant | requests | completed | errors | TTFT P50 (ms) | TTFT P99 (ms) | simulated P99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        pred = predicted.get(name) or {}
        for tenant, t in f["tenants"].items():
            lines.append(f"| {name} | {tenant} | {t['num_requests']} | {t['num_completed']} | {t['num_errors']} | {ms(t['ttft_p50_s'])} "
                         f"| {ms(t['ttft_p99_s'])} | {ms(pred.get(tenant))} |")
    lines += ["", "| scenario | span (s) | throughput (tokens/s) | requests/s |", "|---|---|---|---|"]
    lines += [f"| {name} | {f['span_s']:.1f} | {f['throughput_tokens_per_s']:.0f} | {f['throughput_requests_per_s']:.2f} |"
              for name, f in figures.items()]
    out.markdown(lines)


if __name__ == "__main__":
    main()
