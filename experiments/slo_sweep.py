"""SLO sweeps, one line per system: attainment and goodput vs request rate, attainment vs SLO scale.

Systems (targets), each named, as many as wanted in one run:
  * ``--sim NAME=SPEC``: a simulated deployment (our real schedulers, ``simulator``) of ``--model`` on
    ``--hardware``. SPEC is ``distserve simulate``'s placement flags (``--colocated 4``, ``--prefill 1
    --decode 2 --prefill-tp 2``, ``--router least-loaded``), a Placement JSON file, or ``plan:disagg`` /
    ``plan:colocated`` (the planner's best plan of that kind on ``--plan-gpus`` GPUs, for this
    workload and SLO); then any ``[PHASE.]FIELD=VALUE`` words set ``SchedulerConfig`` fields of that
    target (PHASE: colocated, prefill or decode; default all), e.g. ``policy=vllm-2023`` or
    ``decode.max_num_seqs=128``. ``--scheduler FIELD=VALUE`` does the same for every target.
    Step times: ``--profile auto`` (DistServe's fitted A100 coefficients when they cover the model,
    else the roofline), ``roofline``, or a profile JSON (``distserve profile``'s, a CPU profile).
  * ``--endpoint NAME=URL``: any OpenAI-compatible server (``/v1`` base URL; ours, vLLM, SGLang),
    asked for ``--model-name``, driven by ``distserve.measure.loadgen`` (streamed completions,
    client-side TTFT/TPOT, ``ignore_eos`` + ``min_tokens`` so each request has its output length).

Every system gets the same seeded workload (``--workload``: any name ``distserve simulate`` takes, or a
.jsonl trace; ``--arrival poisson|gamma --cv``; ``--num-requests``), generated at 1 req/s and replayed
at each rate by scaling its arrival times. Attainment is ``distserve.slo``'s: ``joint`` (both SLOs
on the same request) and ``separate`` (TTFT and TPOT each reach the target).

Sweeps (``--sweeps rate,slo-scale``):
  * rate: goodput (the highest rate whose attainment reaches ``--attainment``), per attainment
    mode. Simulated: ``simulator.goodput.find_goodput``'s bisection, then a grid of full simulations
    for the curve. Endpoint: ``search_rate`` (the same bracket-and-bisect) over real probes of
    ``--probe-requests`` requests each, at most ``--max-probes`` per mode (probes are shared
    between modes; with ``joint`` alone a probe ends once its failure is certain, a lower bound;
    rates below ``--min-rate`` count as failing unprobed; an endpoint that completes nothing is an error).
    The knee is the bracket [goodput, first failing rate).
  * slo-scale: at ``--scale-rate`` req/s per GPU (default: the lowest goodput per GPU found), the
    attainment with both SLOs multiplied by each of ``--scales``, from ONE run per system re-scored.
    A simulated target whose scheduling depends on the SLO (``--step-budget slo``) is simulated
    again at each scale. ``min_scale``: the tightest scale that still reaches the target, exactly.

Writes slo_sweep.{json,md,png} under --out-dir (DistServe-style figures); the last stdout line is
one JSON object of figures. ``--quick``: two simulated OPT-13B targets, 40 requests, coarse search.
``--render-apps FILE.json`` instead draws Parrot's application figures (``app_figures``) from a
``bench_apps.py --figures`` run, as ``FILE.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import harness
import simulator  # noqa: F401 - first of ours: the simulator's modules load compiled (distserve.compiled)
from distserve.cli.arg_types import fraction, non_negative_float, positive_float, positive_int
from distserve.cli.args import latency_type
from distserve.errors import DistServeError, InvalidConfigError
from distserve.placement import Placement
from distserve.slo import SLO, SLOSpec
from simulator.latency import LatencyModel
from simulator.report import SimulateRequest, build_requests, scheduler_configs
from simulator.simulation import SimConfig, Simulation
from simulator.workload import ARRIVAL_PROCESSES, Request, describe
from sweep_systems import (
    MODES, EndpointTarget, SimTarget, latency_model, name_and_spec, parse_sim, planner, with_overrides,
)
from sweeper import Sweeper

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCALES = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)
QUICK_SIMS = ("colocated=--colocated 2", "1p1d=--prefill 1 --decode 1")


# ---- outputs ---------------------------------------------------------------------------------
def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"


def table_rows(systems: dict[str, dict[str, Any]], modes: list[str]) -> tuple[list[str], list[list[str]]]:
    cols = ["system", "kind", "GPUs"]
    for m in modes:
        cols += [f"goodput {m} (req/s)", f"per GPU {m}", f"binding SLO {m}", f"knee {m} (req/s/GPU)"]
    cols += [f"vs {next(iter(systems))} ({modes[0]})", "SLO-scale rate (req/s/GPU)", *(f"min SLO scale {m}" for m in modes)]
    first = next(iter(systems.values())).get("rate_sweep")
    rows = []
    for name, s in systems.items():
        row = [name, s["kind"], str(s["num_gpus"])]
        r = s.get("rate_sweep")
        for m in modes:
            if r is None:
                row += ["-"] * 4
                continue
            lo, hi = r["knee_per_gpu"][m]
            row += [_num(r["goodput_rps"][m]), _num(r["per_gpu"][m]), r["binding"][m] or "-", f"[{_num(lo)}, {_num(hi)})"]
        sc = s.get("scale_sweep")
        ratio = r["per_gpu"][modes[0]] / first["per_gpu"][modes[0]] if r and first and first["per_gpu"][modes[0]] else None
        row += [f"{ratio:.2f}x" if ratio is not None else "-",_num(sc["per_gpu"]) if sc else "-", *(_num(sc["min_scale"][m]) if sc else "-" for m in modes)]
        rows.append(row)
    return cols, rows


def write_outputs(out: harness.Outputs, figures: dict[str, Any], systems: dict[str, dict[str, Any]]) -> None:
    out.json({"figures": figures, "systems": systems})
    cols, rows = table_rows(systems, figures["modes"])
    slo = figures["slo"]
    md = [f"{figures['model']} ({figures['latency_model']}); workload `{figures['workload']}` ({figures['arrival']} arrivals, "
          f"{figures['num_requests']} requests, seed {figures['seed']}: prompt mean {figures['workload_stats']['prompt_mean']:.0f}, "
          f"output mean {figures['workload_stats']['output_mean']:.0f} tokens); SLO TTFT {slo['ttft_s']:g} s, TPOT "
          f"{slo['tpot_s']:g} s, {slo['attainment']:.0%} of requests (`joint`: both on the same request; `separate`: "
          "each). Knee: [goodput, first failing rate probed). Min SLO scale: the tightest multiple of both SLOs "
          "that still reaches the target at the SLO-scale rate.", "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ["", "Systems: " + "; ".join(f"**{n}** {s['describe']}" for n, s in systems.items()), "",
           f"Command: `python experiments/slo_sweep.py {figures['command']}` ({figures['wall_s']:.0f} s)."]
    out.markdown(md)

    plt = harness.pyplot()
    panels = [k for k in ("rate_sweep", "scale_sweep") if any(k in s for s in systems.values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    target = slo["attainment"] * 100
    for ax, panel in zip(axes[0], panels):
        for i, (name, s) in enumerate(systems.items()):
            if panel not in s:
                continue
            c = colors[i % len(colors)]
            pts = sorted(s[panel]["points"], key=lambda p: p["per_gpu" if panel == "rate_sweep" else "scale"])
            xs = [p["per_gpu" if panel == "rate_sweep" else "scale"] for p in pts]
            ax.plot(xs, [p["joint"] * 100 for p in pts], marker="o", color=c, label=f"{name} (joint)")
            ax.plot(xs, [p["separate"] * 100 for p in pts], linestyle=":", color=c, label=f"{name} (separate)")
            if panel == "rate_sweep" and s[panel]["per_gpu"].get(figures["modes"][0]):
                ax.axvline(s[panel]["per_gpu"][figures["modes"][0]], color=c, linestyle="--", linewidth=1)
        ax.axhline(target, color="grey", linewidth=1)
        if panel == "rate_sweep":
            ax.set(xlabel="rate per GPU (req/s/GPU)", title=f"attainment vs rate (dashed: {figures['modes'][0]} goodput)")
        else:
            ax.set_xscale("log", base=2)
            ax.set_xticks(figures["scales"], [f"{x:g}" for x in figures["scales"]])
            ax.set(xlabel="SLO scale (x TTFT and TPOT SLO)", title="attainment vs SLO scale at a fixed rate")
        ax.set(ylabel="SLO attainment (%)", ylim=(-3, 105))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{figures['model']}, {figures['workload']}: TTFT {slo['ttft_s']:g} s / TPOT {slo['tpot_s']:g} s", fontsize=10)
    fig.tight_layout()
    out.png(fig)
    harness.rich_table("SLO sweep", cols, rows, width=220, left=("system", "kind"))


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, "two simulated OPT-13B targets (colocated 2 and 1P1D), 40 requests, coarse search (< 20 s)")
    ap.add_argument("--sim", action="append", default=[], metavar="NAME=SPEC", help="a simulated system (repeatable)")
    ap.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL", help="an OpenAI-compatible /v1 base URL (repeatable)")
    ap.add_argument("--model", default="facebook/opt-13b", help="the simulated model (simulator.models)")
    ap.add_argument("--hardware", default=None, help="a100-80g | h100-sxm | ... (default: the profile's, else a100-80g)")
    ap.add_argument("--profile", default="auto", help="auto | roofline | a profile JSON")
    ap.add_argument("--model-name", default="tiny", help="the model name endpoints are asked for")
    ap.add_argument("--endpoint-gpus", type=positive_int, default=1, help="accelerators behind each endpoint (for per-GPU rates)")
    ap.add_argument("--workload", default="chatbot", help="any workload `distserve simulate` takes, or a .jsonl trace")
    ap.add_argument("--arrival", default="poisson", choices=list(ARRIVAL_PROCESSES))
    ap.add_argument("--cv", type=positive_float, default=1.0, help="gamma arrivals: coefficient of variation")
    ap.add_argument("--num-requests", type=positive_int, default=600)
    ap.add_argument("--max-total-len", type=positive_int, default=None, help="prompt + output cap (default: the model's context)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo", type=latency_type("--ttft-slo", allow_inf=True), default=0.25, help="seconds")
    ap.add_argument("--tpot-slo", type=latency_type("--tpot-slo", allow_inf=True), default=0.1, help="seconds")
    ap.add_argument("--attainment", type=fraction, default=0.9)
    ap.add_argument("--modes", default="joint,separate", help="attainment modes whose goodput is searched")
    ap.add_argument("--sweeps", default="rate,slo-scale")
    ap.add_argument("--max-num-seqs", type=positive_int, default=None)
    ap.add_argument("--max-batched-tokens", type=positive_int, default=None)
    ap.add_argument("--step-budget", default="static", choices=["static", "slo"], help="as `distserve simulate`")
    ap.add_argument("--scheduler", action="append", default=[], metavar="[PHASE.]FIELD=VALUE", help="for every simulated target")
    ap.add_argument("--plan-gpus", type=positive_int, default=4, help="GPUs plan:disagg / plan:colocated may use (one node)")
    ap.add_argument("--plan-mode", default="joint", choices=list(MODES), help="the attainment mode the planner optimises")
    ap.add_argument("--rel-tol", type=positive_float, default=0.02, help="bisection stops at (hi - lo) / hi <= this")
    ap.add_argument("--start-per-gpu", type=positive_float, default=1.0, help="first probed rate, req/s per GPU")
    ap.add_argument("--grid-points", type=positive_int, default=10, help="simulated rates on each curve")
    ap.add_argument("--scales", default=",".join(map(str, DEFAULT_SCALES)))
    ap.add_argument("--scale-rate", type=positive_float, default=None, help="req/s per GPU of the SLO-scale sweep (default: lowest goodput/GPU)")
    ap.add_argument("--probe-requests", type=positive_int, default=40, help="endpoint: requests per probe")
    ap.add_argument("--max-probes", type=positive_int, default=5, help="endpoint: probes per goodput search")
    ap.add_argument("--max-rate", type=positive_float, default=None, help="endpoint: highest rate probed, req/s")
    ap.add_argument("--min-rate", type=non_negative_float, default=0.25, help="endpoint: lower rates count as failing, unprobed, req/s")
    ap.add_argument("--request-timeout", type=positive_float, default=120.0, help="endpoint: seconds per request")
    ap.add_argument("--render-apps", default=None, metavar="FILE.json",
                    help="draw Parrot's application figures from a `bench_apps.py --figures` JSON (next to it, as FILE.png) "
                         "instead of sweeping")
    args = ap.parse_args(argv)
    if args.quick:
        args.sim = args.sim or list(QUICK_SIMS)
        args.num_requests, args.rel_tol, args.grid_points, args.scales = min(args.num_requests, 40), 0.2, 3, "0.5,1,2"
    args.modes = [m for m in args.modes.split(",") if m]
    args.sweeps = [s for s in args.sweeps.split(",") if s]
    try:
        args.scales = sorted(float(x) for x in args.scales.split(","))
    except ValueError:
        ap.error(f"--scales: comma-separated numbers, got {args.scales!r}")
    checks = [(not args.sim and not args.endpoint and not args.render_apps, "give at least one --sim or --endpoint"),
              (bool(set(args.modes) - set(MODES)) or not args.modes, f"--modes: a subset of {MODES}"),
              (bool(set(args.sweeps) - {"rate", "slo-scale"}) or not args.sweeps, "--sweeps: a subset of rate,slo-scale"),
              (not all(0 < x < math.inf for x in args.scales), "--scales must be finite numbers > 0"),
              (args.rel_tol >= 1, "--rel-tol must be in (0, 1)"),
              (args.max_rate is not None and args.max_rate <= args.min_rate, "--max-rate must be above --min-rate"),
              ("slo-scale" in args.sweeps and "rate" not in args.sweeps and args.scale_rate is None,
               "--sweeps slo-scale alone needs --scale-rate")]
    for bad, message in checks:
        if bad:
            ap.error(message)
    return args


def build(args: argparse.Namespace) -> tuple[list[SimTarget | EndpointTarget], LatencyModel | None, str | None, list[Request], SLO]:
    slo = SLO(args.ttft_slo, args.tpot_slo, args.attainment)
    latency, profile = latency_model(args) if args.sim else (None, None)
    base = SimConfig(**scheduler_configs(args.max_num_seqs, args.max_batched_tokens,
                                         args.tpot_slo if args.step_budget == "slo" else None))
    base = with_overrides(base, args.scheduler)
    plan = planner(args, profile, base)
    targets: list[SimTarget | EndpointTarget] = [parse_sim(t, base, plan) for t in args.sim]
    for text in args.endpoint:
        name, url = name_and_spec(text, "--endpoint")
        targets.append(EndpointTarget(name, url.rstrip("/"), args.endpoint_gpus))
    for t in targets:
        if isinstance(t, SimTarget):
            try:  # builds its instances: their schedulers check the policy names, the latency model their tp/pp
                Simulation(t.placement, latency, t.config)  # type: ignore[arg-type]
            except ValueError as exc:
                raise InvalidConfigError(f"--sim {t.name}: {exc}", "sim") from exc
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise InvalidConfigError(f"system names must differ, got {names}", "sim")
    max_len = args.max_total_len or (latency.model.max_position_embeddings if latency is not None else 2048)
    if isinstance(targets[0], SimTarget):
        some = targets[0].placement
    else:
        some = Placement.colocated_instances(1)
    req = SimulateRequest(args.model, some, args.workload, SLOSpec(slo), num_requests=args.num_requests, arrival=args.arrival,
                          cv=args.cv, seed=args.seed)
    unit = build_requests(req, max_len, unit_rate=True)
    return targets, latency, profile, unit, slo


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        render_apps(args.render_apps) if args.render_apps else run(args)
    except DistServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def render_apps(path: str) -> None:
    """``--render-apps``: Parrot's figures from a ``bench_apps.py --figures`` run, as ``FILE.png``."""
    import app_figures  # only here: it imports the example apps (and their HTTP clients)

    try:
        data = json.loads(Path(path).read_text())
        figures = data["figures"]
        summary = figures["figures"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidConfigError(f"--render-apps {path}: not a `bench_apps.py --figures` JSON ({type(exc).__name__}: {exc})",
                                 "render_apps") from None
    png = Path(path).with_suffix(".png")
    fig = app_figures.render(summary, f"{figures.get('model')}, {figures.get('serve_flags')}, round trip {figures.get('figure_delay_ms')} ms")
    fig.savefig(png, dpi=120)
    harness.pyplot().close(fig)
    harness.finish({"render_apps": path, "png": str(png), "figures": sorted(summary)})


def run(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    targets, latency, profile, unit, slo = build(args)
    sweeper = Sweeper(args, latency, unit, slo)
    systems: dict[str, dict[str, Any]] = {}
    for t in targets:
        sim = isinstance(t, SimTarget)
        systems[t.name] = {"kind": "simulated" if sim else "endpoint", "num_gpus": t.num_gpus,
                           "describe": (f"simulated {harness.layout(t.placement)} (`{t.spec}`)" if sim else f"endpoint {t.url}"),
                           **({"placement": t.placement.to_dict()} if sim else {"url": t.url})}
        if "rate" in args.sweeps:
            systems[t.name]["rate_sweep"] = sweeper.rate_sweep(t)
    if "rate" in args.sweeps:
        top = max((s["rate_sweep"]["per_gpu"][args.modes[0]] for s in systems.values()), default=0.0) or args.start_per_gpu
        grid = [float(x) for x in np.linspace(1.5 * top / args.grid_points, 1.5 * top, args.grid_points)]
        for t in targets:
            if isinstance(t, SimTarget):  # the grid, and the goodput of each mode (where the curve crosses the target)
                knees = [x for x in systems[t.name]["rate_sweep"]["per_gpu"].values() if x > 0]
                systems[t.name]["rate_sweep"]["points"] = sweeper.curve(t, sorted({*grid, *knees}))
    if "slo-scale" in args.sweeps:
        found = [s["rate_sweep"]["per_gpu"][args.modes[0]] for s in systems.values() if "rate_sweep" in s]
        per_gpu = args.scale_rate or min((x for x in found if x > 0), default=args.start_per_gpu)
        for t in targets:
            systems[t.name]["scale_sweep"] = sweeper.scale_sweep(t, per_gpu, args.scales)
    stats = describe(unit)
    figures: dict[str, Any] = {
        "model": args.model, "latency_model": repr(latency).replace(f"{ROOT}/", "") if latency is not None else "-",
        "profile": profile and profile.replace(f"{ROOT}/", ""),
        "workload": args.workload, "arrival": args.arrival, "num_requests": args.num_requests, "seed": args.seed,
        "workload_stats": {k: round(v, 2) for k, v in stats.items()},
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
        "modes": args.modes, "sweeps": args.sweeps, "scales": args.scales, "command": shlex.join(sys.argv[1:]),
        "systems": {n: {k: s[k] for k in ("kind", "num_gpus")}
                    | ({"per_gpu": s["rate_sweep"]["per_gpu"], "binding": s["rate_sweep"]["binding"]} if "rate_sweep" in s else {})
                    | ({"min_slo_scale": s["scale_sweep"]["min_scale"], "scale_rate_per_gpu": s["scale_sweep"]["per_gpu"]}
                       if "scale_sweep" in s else {})
                    for n, s in systems.items()},
    }
    first = next((s["rate_sweep"]["per_gpu"] for s in systems.values() if "rate_sweep" in s), None)
    if first is not None:  # goodput per GPU relative to the first system's, per mode
        names = list(systems)
        figures["vs_first"] = {"first": names[0], **{n: {m: s["rate_sweep"]["per_gpu"][m] / first[m] if first[m] else None
                                                         for m in args.modes}
                                                     for n, s in systems.items() if "rate_sweep" in s}}
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    write_outputs(harness.Outputs.for_run(args, "slo_sweep"), figures, systems)
    harness.finish(figures)


if __name__ == "__main__":
    sys.exit(main())
