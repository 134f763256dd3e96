"""Simulator speed: simulated requests per wall-clock second, through our real schedulers.

``simulator.simulation`` runs the real ``Scheduler``/``PrefillScheduler``/``DecodeScheduler`` over
real ``BlockManager``s, one ``schedule()``/``update_from_output()`` per simulated step, so every
generated token of every request is one trip through the scheduler. This times it on 10k
ShareGPT-like requests (``chatbot`` lengths, Poisson arrivals, prompt + output <= 2048 tokens) on a
1P1D and a 4P2D deployment of OPT-13B, plus one colocated instance for reference, at 3 req/s per
prefill (or colocated) instance, near what such a deployment sustains. Step times come from
DistServe's fitted OPT-13B profile (A100-80G) if the file is there, else from our roofline model
(the JSON says which).

Figures per deployment: simulated requests, steps (``schedule()`` calls) and token-steps (one
scheduled sequence, one sampled token) per wall-clock second, the same per CPU second of the
simulating process (steadier on a shared machine), and the ratio to issue 18's target of 10k
requests/s. With ``--jobs N`` (N > 1) it also runs N simulations of each deployment at once, one
process each, as a sweep on N cores does, all starting together once each has imported and built its workload, and
reports their simulated requests per wall second together (all requests over the span from the first
start to the last end). With ``--baseline-ref REF`` it also times the packages (``distserve``, ``simulator``,
``kernels``) as they were at git ``REF`` (extracted into a temporary tree), interleaved with the
current code, and reports the speed-up; with
``--baseline-step-by-step`` the baseline is the current code with ``SimConfig(fast_forward=False)``
(every decode step through the scheduler, no jumps over steady stretches); with
``--baseline-interpreted`` the baseline is the current code interpreted (``DISTSERVE_COMPILED=0``)
against its mypyc build (``make sim-fast``, ``distserve.compiled``; each row records which ran).
Every measurement runs in its own subprocess. Writes JSON + markdown + PNG under --out-dir; the last
stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import Outputs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = ROOT / "simulator" / "data" / "distserve-a100-80g-profile.json"  # shipped with the package
MODEL, HARDWARE = "facebook/opt-13b", "a100-80g"
TARGET_REQUESTS_PER_S = 10_000  # issue 18
# name -> (num_prefill, num_decode); (n, 0) is n colocated instances
DEPLOYMENTS = {"1p1d": (1, 1), "4p2d": (4, 2), "colocated1": (1, 0)}
PACKAGES = ("distserve", "simulator", "kernels")  # what --baseline-ref takes from git


# ---- one measurement (runs in a subprocess whose PYTHONPATH picks the code under test) ----------
def measure(deployment: str, num_requests: int, rate_per_entry: float, profile: str | None, seed: int,
            fast_forward: bool = True, wait_go: bool = False) -> dict[str, Any]:
    import simulator  # noqa: F401 - first: the modules it drives load compiled, if built (distserve.compiled)
    from distserve.engine import scheduler as scheduler_module
    from distserve.placement import Placement
    from simulator.latency import FittedLatencyModel, LatencyModel, RooflineLatencyModel
    from simulator.sim_config import SimConfig
    from simulator.simulation import Simulation
    from simulator.workload import generate_requests

    num_prefill, num_decode = DEPLOYMENTS[deployment]
    placement = (
        Placement.disaggregated(num_prefill, num_decode) if num_decode else Placement.colocated_instances(num_prefill)
    )
    latency: LatencyModel = (
        FittedLatencyModel.from_profile(profile, model=MODEL) if profile else RooflineLatencyModel(MODEL, HARDWARE)
    )
    rate = rate_per_entry * num_prefill
    requests = generate_requests("chatbot", rate, num_requests, seed=seed, max_total_len=2048)
    if wait_go:  # --jobs: ready (imports done, workload built); start when the parent says go, with the others
        print("ready", flush=True)
        sys.stdin.readline()
    started = time.monotonic()  # system-wide clock: the parent compares the processes' spans
    wall0, cpu0 = time.perf_counter(), time.process_time()
    # An older tree (--baseline-ref) may not know the field: only pass it to turn fast-forward off.
    sim = Simulation(placement, latency, None if fast_forward else SimConfig(fast_forward=False))
    result = sim.run(requests)
    wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    records = result.records
    return {
        "deployment": deployment, "rate_rps": rate, "num_requests": num_requests,
        "num_completed": sum(r.finish_s is not None for r in records),
        "num_steps": sum(i["num_steps"] for i in result.instances.values()),
        # Each scheduled sequence samples one token (no chunked prefill here), preemption recomputes included.
        "num_token_steps": sum(r.num_output_tokens for r in records),
        "num_preemptions": sum(i["num_preemptions"] for i in result.instances.values()),
        "simulated_s": result.duration_s, "wall_s": wall_s, "cpu_s": cpu_s, "started": started, "ended": time.monotonic(),
        "num_fast_forward_steps": getattr(sim, "num_fast_forward_steps", 0),  # steps whose decodes were lazy
        "latency_model": repr(latency), "scheduler_source": scheduler_module.__file__,
        "simulator_mode": simulator_mode(),
    }


def simulator_mode() -> str:
    try:
        from distserve.compiled import mode
    except ImportError:  # a tree from before the compiled simulator (--baseline-ref)
        return "interpreted"
    return mode()


def worker_cmd(args: argparse.Namespace, deployment: str, profile: str | None, fast_forward: bool = True) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--worker", deployment, "--num-requests", str(args.num_requests),
        "--rate-per-prefill", str(args.rate_per_prefill), "--seed", str(args.seed), "--profile", profile or "",
    ] + ([] if fast_forward else ["--step-by-step"])


def worker_row(proc: subprocess.Popen[str], src_root: Path, deployment: str) -> dict[str, Any]:
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"worker {deployment} ({src_root}) failed:\n{stderr[-3000:]}")
    row: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    if not row["scheduler_source"].startswith(str(src_root)):  # the editable install must not win
        raise RuntimeError(f"worker imported {row['scheduler_source']}, expected code under {src_root}")
    return row


def start_worker(src_root: Path, cmd: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(src_root), **(env_extra or {})}
    return subprocess.Popen(cmd, cwd=src_root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run_worker(src_root: Path, args: argparse.Namespace, deployment: str, profile: str | None,
               fast_forward: bool = True, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """``measure`` in a fresh interpreter importing ``distserve``/``simulator`` from ``src_root``."""
    return worker_row(start_worker(src_root, worker_cmd(args, deployment, profile, fast_forward), env_extra), src_root, deployment)


def run_parallel(args: argparse.Namespace, deployment: str, profile: str | None) -> dict[str, Any]:
    """``args.jobs`` measurements of ``deployment`` at once; their requests over the span they took together."""
    cmd = worker_cmd(args, deployment, profile) + ["--wait-go"]
    procs = [start_worker(ROOT, cmd) for _ in range(args.jobs)]
    for p in procs:  # every process has imported and built its workload
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"worker {deployment} failed before it was ready:\n{p.communicate()[1][-3000:]}")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    rows = [worker_row(p, ROOT, deployment) for p in procs]
    span = max(r["ended"] for r in rows) - min(r["started"] for r in rows)
    late = max(r["started"] for r in rows) - min(r["started"] for r in rows)
    total = sum(r["num_requests"] for r in rows)
    return {"deployment": deployment, "jobs": args.jobs, "num_requests": total, "span_s": span, "start_spread_s": late,
            "requests_per_s": total / span, "cpu_s": sum(r["cpu_s"] for r in rows)}


def baseline_tree(ref: str, dest: Path) -> Path:
    """``PACKAGES`` as they were at git ``ref``, extracted into ``dest``."""
    archive = subprocess.run(["git", "archive", "--format=tar", ref, *PACKAGES], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {ref} failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


# ---- report ---------------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]], variant: str, deployment: str) -> dict[str, Any]:
    """Median rates over the repeats of one (variant, deployment)."""
    mine = [r for r in rows if r["variant"] == variant and r["deployment"] == deployment]
    first = mine[0]
    wall = statistics.median(r["wall_s"] for r in mine)
    cpu = statistics.median(r["cpu_s"] for r in mine)
    return {
        "rate_rps": first["rate_rps"], "num_requests": first["num_requests"], "num_completed": first["num_completed"],
        "num_steps": first["num_steps"], "num_token_steps": first["num_token_steps"],
        "num_preemptions": first["num_preemptions"], "simulated_s": first["simulated_s"], "wall_s": wall, "cpu_s": cpu,
        "requests_per_s": first["num_requests"] / wall, "cpu_requests_per_s": first["num_requests"] / cpu,
        "steps_per_s": first["num_steps"] / wall, "token_steps_per_s": first["num_token_steps"] / wall,
        "us_per_token_step": wall / first["num_token_steps"] * 1e6,
        "fast_forward_steps_fraction": first.get("num_fast_forward_steps", 0) / first["num_steps"],
    }


def write_outputs(out: Outputs, rows: list[dict[str, Any]], figures: dict[str, Any]) -> None:
    out.json({"figures": figures, "rows": rows})
    deployments = figures["deployments"]
    has_baseline = figures["baseline_ref"] is not None
    md = [
        f"Simulator speed: {figures['num_requests']} ShareGPT-like requests (`chatbot`, prompt + output <= 2048), "
        f"{figures['rate_per_prefill']:g} req/s per prefill (or colocated) instance, latency model "
        f"`{figures['latency_model']}`; median of {figures['repeats']} run(s), each in its own process. "
        f"Target: {TARGET_REQUESTS_PER_S:,} simulated requests per wall-clock second. Token-steps = scheduled "
        "sequences summed over steps (one sampled token each). The machine is shared: load average "
        f"{figures['load_average_start']} at the start, {figures['load_average_end']} at the end "
        f"({figures['num_cpus']} CPUs); CPU-time rates are steadier than wall-clock ones. This VM's Python speed at the start "
        f"(`harness.python_loop_ns`: one iteration of a pure-Python `s += i` loop): {figures['python_loop_ns']:.1f} ns; it has "
        "differed by 1.7x between sessions, and this benchmark's absolute rates with it.",
        "",
        "| deployment | rate (req/s) | simulated s | steps | token-steps | wall s | req/s | steps/s | token-steps/s "
        "| µs / token-step | req / CPU s | of target |" + (f" req/s at {figures['baseline_ref']} | speed-up (wall) "
                                                          "| speed-up (CPU) |" if has_baseline else ""),
        "|---" * (12 + 3 * has_baseline) + "|",
    ]
    for d in deployments:
        f = {k.removeprefix(f"{d}_"): v for k, v in figures.items() if k.startswith(f"{d}_")}
        line = (
            f"| {d} | {f['rate_rps']:g} | {f['simulated_s']:.0f} | {f['num_steps']} | {f['num_token_steps']} | "
            f"{f['wall_s']:.1f} | {f['requests_per_s']:.0f} | {f['steps_per_s']:.0f} | {f['token_steps_per_s']:.0f} | "
            f"{f['us_per_token_step']:.1f} | {f['cpu_requests_per_s']:.0f} | {f['fraction_of_target']:.2%} |"
        )
        if has_baseline:
            line += f" {f['baseline_requests_per_s']:.0f} | {f['speedup']:.2f}x | {f['cpu_speedup']:.2f}x |"
        md.append(line)
    md.append("\nSteps whose decodes the scheduler did not plan one by one (lazy decodes, `simulator.fast_forward`): " + ", ".join(
        f"{d} {figures[f'{d}_fast_forward_steps_fraction']:.0%}" for d in deployments) + ".")
    par = [d for d in deployments if f"{d}_parallel_requests_per_s" in figures]
    if par:
        jobs = figures[f"{par[0]}_parallel_jobs"]
        md.append(f"\n{jobs} simulations at once (one process each, as a sweep on {jobs} cores runs them; all simulated "
                  "requests over the span from the first start to the last end): " + ", ".join(
                      f"{d} {figures[f'{d}_parallel_requests_per_s']:.0f} req/s "
                      f"({figures[f'{d}_parallel_fraction_of_target']:.0%} of target)" for d in par) + ".")
    if figures["baseline_ref"] == "step-by-step":
        md.append("\nBaseline: the same code with `SimConfig(fast_forward=False)` (every decode step through the "
                  "scheduler); the same workloads and results (steps, tokens, simulated time), interleaved with the "
                  "fast-forward runs.")
    elif figures["baseline_ref"] == "interpreted":
        md.append(f"\nBaseline: the same code interpreted (`DISTSERVE_COMPILED=0`); the current code ran "
                  f"{figures['simulator_mode']} (`make sim-fast`, `distserve.compiled`). The same workloads and results, "
                  "interleaved.")
    elif has_baseline:
        md.append(f"\nBaseline: {', '.join(f'`{p}`' for p in PACKAGES)} as of `{figures['baseline_ref']}`; "
                  "same workloads and results, interleaved with the current code.")
    out.markdown(md)

    fig, ax = harness.pyplot().subplots(figsize=(8, 3.6))
    ys = range(len(deployments))
    height = 0.38 if has_baseline else 0.6
    ax.barh([y + (height / 2 if has_baseline else 0) for y in ys],
            [figures[f"{d}_requests_per_s"] for d in deployments], height, label="current", color="C0")
    if has_baseline:
        ax.barh([y - height / 2 for y in ys], [figures[f"{d}_baseline_requests_per_s"] for d in deployments], height,
                label=f"at {figures['baseline_ref']}", color="C7")
    ax.axvline(TARGET_REQUESTS_PER_S, color="C3", linestyle="--", label=f"target {TARGET_REQUESTS_PER_S:,}/s")
    ax.set_yticks(list(ys), deployments)
    ax.set_xscale("log")
    ax.set_xlabel("simulated requests per wall-clock second")
    ax.set_title(f"Simulator speed, {figures['num_requests']} chatbot requests, OPT-13B")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="center")
    fig.tight_layout()
    out.png(fig)


def main() -> None:
    if "--worker" in sys.argv:  # ``run_worker``'s: flags the parent checked, and maybe an older tree (--baseline-ref) on
        count, positive = int, float  # PYTHONPATH, which may not have ``distserve.cli.arg_types``
    else:
        from distserve.cli.arg_types import positive_float, positive_int

        count, positive = positive_int, positive_float
    ap = harness.parser(__doc__, "200 requests per deployment")
    ap.add_argument("--num-requests", type=count, default=10_000)
    ap.add_argument("--rate-per-prefill", type=positive, default=3.0, help="req/s per prefill (or colocated) instance")
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS), help=f"subset of {', '.join(DEPLOYMENTS)}")
    ap.add_argument("--repeats", type=count, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE),
                    help="DistServe's fitted coefficients; if the file is absent (or ''), the roofline model")
    ap.add_argument("--baseline-ref", default=None,
                    help="also time the hot-path files as of this git ref (e.g. the commit before the speed-up)")
    ap.add_argument("--baseline-step-by-step", action="store_true",
                    help="the baseline is the current code with fast-forward off (SimConfig(fast_forward=False))")
    ap.add_argument("--baseline-interpreted", action="store_true",
                    help="the baseline is the current code interpreted (DISTSERVE_COMPILED=0), against its mypyc build")
    ap.add_argument("--jobs", type=count, default=2, help="also run this many simulations at once (a sweep's view; 1: off)")
    ap.add_argument("--step-by-step", action="store_true", help=argparse.SUPPRESS)  # worker: fast-forward off
    ap.add_argument("--wait-go", action="store_true", help=argparse.SUPPRESS)  # worker: start on "go" from stdin
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one measurement, JSON out
    args = ap.parse_args()
    if sum(map(bool, (args.baseline_ref, args.baseline_step_by_step, args.baseline_interpreted))) > 1:
        ap.error("--baseline-ref, --baseline-step-by-step and --baseline-interpreted are three baselines: pick one")
    profile = args.profile if args.profile and Path(args.profile).is_file() else None
    if args.worker:
        harness.finish(measure(args.worker, args.num_requests, args.rate_per_prefill, profile, args.seed,
                               fast_forward=not args.step_by_step, wait_go=args.wait_go))
        return
    if args.quick:
        args.num_requests = 200
    deployments = [d for d in args.deployments.split(",") if d]
    for d in deployments:
        if d not in DEPLOYMENTS:
            ap.error(f"unknown deployment {d!r}; choose from {', '.join(DEPLOYMENTS)}")
    if profile is None:
        print(f"profile {args.profile} not found: using the roofline model", flush=True)

    load_start = [round(x, 2) for x in os.getloadavg()]
    loop_ns = harness.python_loop_ns()
    rows: list[dict[str, Any]] = []
    parallel: list[dict[str, Any]] = []  # --jobs: simulations run at once
    with tempfile.TemporaryDirectory(prefix="bench_simulator_") as tmp:
        variants: list[tuple[str, Path, bool, dict[str, str]]] = [("current", ROOT, True, {})]
        if args.baseline_ref:
            variants.append(("baseline", baseline_tree(args.baseline_ref, Path(tmp)), True, {}))
        elif args.baseline_step_by_step:
            variants.append(("baseline", ROOT, False, {}))
        elif args.baseline_interpreted:
            variants.append(("baseline", ROOT, True, {"DISTSERVE_COMPILED": "0"}))
        for _ in range(args.repeats):  # interleaved, so every variant sees the same machine state
            for d in deployments:
                for variant, src_root, fast_forward, env_extra in variants:
                    row = {"variant": variant, "fast_forward": fast_forward,
                           **run_worker(src_root, args, d, profile, fast_forward, env_extra)}
                    rows.append(row)
                    print(f"{variant:<8} {row['simulator_mode']:<11} {d:<10} {row['num_requests'] / row['wall_s']:8.0f} req/s "
                          f"({row['wall_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU)", flush=True)
                if args.jobs > 1:
                    prow = run_parallel(args, d, profile)
                    parallel.append(prow)
                    print(f"{args.jobs} at once {d:<10} {prow['requests_per_s']:8.0f} req/s together "
                          f"({prow['span_s']:.1f} s wall, starts {prow['start_spread_s']:.2f} s apart)", flush=True)
    for d in deployments:  # the plans are identical, so both variants must agree on every count
        counts = {(r["num_completed"], r["num_steps"], r["num_token_steps"], r["simulated_s"]) for r in rows
                  if r["deployment"] == d}
        if len(counts) != 1:
            raise RuntimeError(f"{d}: runs disagree on what was simulated: {counts}")

    figures: dict[str, Any] = {
        "num_requests": args.num_requests, "rate_per_prefill": args.rate_per_prefill, "repeats": args.repeats,
        "latency_model": rows[0]["latency_model"], "profile_used": profile is not None,
        "baseline_ref": args.baseline_ref or ("step-by-step" if args.baseline_step_by_step else None)
        or ("interpreted" if args.baseline_interpreted else None), "deployments": deployments,
        "simulator_mode": next(r["simulator_mode"] for r in rows if r["variant"] == "current"),
        "target_requests_per_s": TARGET_REQUESTS_PER_S, "num_cpus": os.cpu_count(),
        "load_average_start": load_start, "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "python_loop_ns": round(loop_ns, 2),
    }
    for d in deployments:
        cur = summarize(rows, "current", d)
        figures.update({f"{d}_{k}": (round(v, 3) if isinstance(v, float) else v) for k, v in cur.items()})
        figures[f"{d}_fraction_of_target"] = round(cur["requests_per_s"] / TARGET_REQUESTS_PER_S, 5)
        mine = [r for r in parallel if r["deployment"] == d]
        if mine:
            figures[f"{d}_parallel_jobs"] = args.jobs
            figures[f"{d}_parallel_requests_per_s"] = round(statistics.median(r["requests_per_s"] for r in mine), 3)
            figures[f"{d}_parallel_fraction_of_target"] = round(figures[f"{d}_parallel_requests_per_s"] / TARGET_REQUESTS_PER_S, 5)
        if figures["baseline_ref"]:
            base = summarize(rows, "baseline", d)
            figures[f"{d}_baseline_requests_per_s"] = round(base["requests_per_s"], 3)
            figures[f"{d}_baseline_cpu_requests_per_s"] = round(base["cpu_requests_per_s"], 3)
            figures[f"{d}_speedup"] = round(base["wall_s"] / cur["wall_s"], 3)
            figures[f"{d}_cpu_speedup"] = round(base["cpu_s"] / cur["cpu_s"], 3)

    print(f"latency model: {figures['latency_model']}; target {TARGET_REQUESTS_PER_S:,} req/s")
    for d in deployments:
        line = (f"{d:<10} {figures[f'{d}_requests_per_s']:8.0f} req/s  {figures[f'{d}_steps_per_s']:8.0f} steps/s  "
                f"{figures[f'{d}_token_steps_per_s']:9.0f} token-steps/s  "
                f"({figures[f'{d}_fraction_of_target']:.2%} of target)")
        if figures["baseline_ref"]:
            line += f"  speed-up {figures[f'{d}_speedup']:.2f}x (CPU {figures[f'{d}_cpu_speedup']:.2f}x)"
        if f"{d}_parallel_requests_per_s" in figures:
            line += f"  {args.jobs} at once: {figures[f'{d}_parallel_requests_per_s']:.0f} req/s"
        print(line)
    write_outputs(Outputs.for_run(args, "bench_simulator"), rows + [{"variant": "parallel", **r} for r in parallel], figures)
    harness.finish(figures)


if __name__ == "__main__":
    main()
