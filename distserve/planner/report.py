"""What ``distserve plan`` does once its flags are parsed: build the request, search, render, write."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from distserve.errors import InvalidConfigError
from distserve.planner.classes import ClassComparison, pools_label
from distserve.planner.plan import Candidate, Cluster, PlanOption, PlanRequest, PlanResult
from distserve.planner.search import Planner
from distserve.slo import SLO, SLOSpec, attainment
from simulator.hardware import get_hardware
from simulator.latency import get_latency_model
from simulator.simulation import SimConfig, simulate, with_rate
from simulator.workload import MIX_PREFIX, generate_requests, load_trace, mixed_workload, rescale


@dataclass(frozen=True)
class PlanArgs:
    model: str
    gpu: str
    nodes: int
    gpus_per_node: int
    workload: str
    ttft_s: float | None  # None: the strictest of the class SLOs
    tpot_s: float | None
    attainment: float = 0.9
    attainment_mode: str = "joint"
    rate: float | None = None
    gpus: int | None = None
    profile: str | None = None
    affinity: str = "auto"
    num_requests: int = 300
    seed: int = 0
    intra_node_gbps: float | None = None  # GB/s, one direction
    inter_node_gbps: float | None = None
    workers: int = 1
    sim_config: SimConfig = SimConfig()
    class_slos: dict[str, SLO] = field(default_factory=dict)  # objective -> SLO (``--class-slo``)


def default_slo(a: PlanArgs) -> SLO:
    """``--ttft``/``--tpot``; where not given, the strictest of the class SLOs."""
    ttft = a.ttft_s if a.ttft_s is not None else min((s.ttft_s for s in a.class_slos.values()), default=None)
    tpot = a.tpot_s if a.tpot_s is not None else min((s.tpot_s for s in a.class_slos.values()), default=None)
    if ttft is None or tpot is None:
        raise InvalidConfigError("give --ttft and --tpot, or an SLO per class (--class-slo OBJECTIVE=TTFT:TPOT)", "ttft")
    return SLO(ttft, tpot, a.attainment)


def build_request(a: PlanArgs) -> PlanRequest:
    gpu = get_hardware(a.gpu)
    cluster = Cluster.of(
        a.nodes, a.gpus_per_node, gpu,
        None if a.intra_node_gbps is None else a.intra_node_gbps * 1e9,
        None if a.inter_node_gbps is None else a.inter_node_gbps * 1e9,
    )
    latency = get_latency_model(a.model, hardware=cluster.gpu, profile=a.profile)
    max_len = a.sim_config.max_model_len or latency.model.max_position_embeddings
    if a.workload.endswith(".jsonl"):
        unit = rescale(load_trace(a.workload), 1.0)
    elif a.workload.startswith(MIX_PREFIX):
        unit = mixed_workload(a.workload, 1.0, a.num_requests, seed=a.seed, max_total_len=max_len)
    else:
        unit = generate_requests(a.workload, 1.0, a.num_requests, seed=a.seed, max_total_len=max_len)
    slo = SLOSpec(default_slo(a), mode=a.attainment_mode)
    class_slos = {o: replace(s, attainment=a.attainment) for o, s in a.class_slos.items()}
    return PlanRequest(latency, cluster, tuple(unit), slo, rate=a.rate, gpu_budget=a.gpus, affinity=a.affinity,
                       sim_config=a.sim_config, max_workers=a.workers, class_slos=class_slos)


def run_plan(a: PlanArgs, show_progress: bool = True) -> tuple[PlanRequest, PlanResult]:
    req = build_request(a)
    if not show_progress:
        return req, Planner(req).plan()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)

        return req, Planner(req, progress).plan()


def _layout(option: PlanOption) -> tuple[str, str, str]:
    p = option.placement
    if p.colocated:
        s = p.colocated[0]
        return f"tp{s.tp} pp{s.pp}", "-", f"{len(p.colocated)}x colocated"
    sp, sd = p.prefill[0], p.decode[0]
    pools = pools_label(p)
    return f"tp{sp.tp} pp{sp.pp}", f"tp{sd.tp} pp{sd.pp}", f"{len(p.prefill)}P{len(p.decode)}D" + ("" if pools == "shared" else f" ({pools})")


def render_classes(classes: ClassComparison) -> Table:
    """Per-class goodput per GPU (of the rate of the whole mix) and attainment at the plan's rate, the shared plan vs each variant."""
    slos = ", ".join(f"{o}: TTFT <= {s.ttft_s} s, TPOT <= {s.tpot_s} s" for o, s in classes.slos.items())
    t = Table(title=f"per-class goodput of the shared plan, larger batch caps and class pools (attainment at {classes.rate:.3g} req/s)",
              caption=f"SLO per class at {next(iter(classes.slos.values())).attainment:.0%}: {slos}. Rule: {classes.rule}")
    t.add_column("decode instances", justify="left")
    for o in classes.slos:
        t.add_column(f"{o} goodput/GPU", justify="right")
        t.add_column(f"{o} attainment", justify="right")
    for f in classes.plans:
        cells = []
        for o in classes.slos:
            cells += ["-" if o not in f.goodput else f"{f.per_gpu(o):.3g}", f"{f.attainment.get(o, math.nan):.1%}"]
        mark = "* " if f is classes.chosen or (classes.chosen is None and f is classes.shared) else ""
        t.add_row(mark + f.name, *cells)
    return t


def class_summary(classes: ClassComparison) -> dict[str, Any]:
    return {
        "rule": classes.rule,
        "rate": classes.rate,
        "slos": {o: {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s, "attainment": s.attainment} for o, s in classes.slos.items()},
        "chosen": None if classes.chosen is None else classes.chosen.name,
        "larger_cap": None if classes.larger_cap is None else classes.larger_cap.name,
        "plans": [{"name": f.name, "pools": pools_label(f.placement), "num_gpus": f.num_gpus, "goodput": f.goodput,
                   "goodput_per_gpu": {o: f.per_gpu(o) for o in f.goodput}, "attainment": f.attainment}
                  for f in classes.plans],
    }


def render(req: PlanRequest, result: PlanResult) -> list[Table]:
    colo = result.colocated
    slo = req.slo.default
    target = f"TTFT <= {slo.ttft_s} s, TPOT <= {slo.tpot_s} s at {slo.attainment:.0%} ({req.slo.mode})"
    t = Table(title=f"placements for {req.latency.model.name} on {req.cluster.num_nodes} x {req.cluster.gpus_per_node} {req.cluster.gpu.name}",
              caption=f"SLO: {target}; {result.num_simulated} configurations simulated")
    for col in ("plan", "prefill", "decode", "layout", "GPUs", "rate (req/s)", "goodput/GPU", "vs colocated", "predicted attainment"):
        t.add_column(col, justify="left" if col in ("plan", "layout") else "right")
    for o in result.options:
        pre, dec, layout = _layout(o)
        vs = f"{o.per_gpu / colo.per_gpu:.2f}x" if colo is not None and colo.per_gpu > 0 else "-"
        att = o.predicted.get("attainment", {})
        t.add_row(("* " if o is result.best else "") + o.name, pre, dec, layout, str(o.num_gpus), f"{o.rate:.3g}",
                  f"{o.per_gpu:.3g}", vs, f"joint {att.get('joint', math.nan):.1%}")
    tables = [t]
    c = Table(title="per-configuration goodput (simulated; prefill/decode phases searched alone)")
    for col in ("kind", "configuration", "GPUs", "goodput (req/s)", "per GPU", "binding SLO", "note"):
        c.add_column(col, justify="left" if col in ("kind", "configuration", "note") else "right")
    # (the best first; of those stopped or skipped, the ones that came closest: the most they may still find, their bound)
    top = sorted(result.candidates, key=lambda x: (x.kind, -x.per_gpu, -(x.goodput_below or 0.0) / x.num_gpus,
                                                   -x.bound_rate / x.num_gpus if x.skipped else 0.0))
    shown: dict[str, int] = {}
    for cand in top:
        if shown.get(cand.kind, 0) >= 5:
            continue
        shown[cand.kind] = shown.get(cand.kind, 0) + 1
        if cand.goodput_below is not None:
            goodput, per_gpu = f"<= {cand.goodput_below:.3g}", f"<= {cand.goodput_below / cand.num_gpus:.3g}"
            note = "search stopped: cannot beat the best"
        elif cand.skipped is not None:  # never simulated
            goodput, per_gpu, note = "-", "-", cand.skipped
        else:
            goodput, per_gpu, note = f"{cand.goodput:.3g}", f"{cand.per_gpu:.3g}", ""
        c.add_row(cand.kind, cand.label(), str(cand.num_gpus), goodput, per_gpu, cand.binding or "-", note)
    tables.append(c)
    if result.classes is not None:
        tables.append(render_classes(result.classes))
    return tables


def summary(req: PlanRequest, result: PlanResult) -> dict[str, Any]:
    best = result.best
    colo = result.colocated
    return {
        "model": req.latency.model.name,
        "latency_model": repr(req.latency),
        "cluster": {"nodes": req.cluster.num_nodes, "gpus_per_node": req.cluster.gpus_per_node, "gpu": req.cluster.gpu.name},
        "feasible": result.feasible,
        "closest": result.closest,
        "notes": result.notes,
        "num_simulated": result.num_simulated,
        "best": None if best is None else {"name": best.name, "placement": best.placement.to_dict(), "rate": best.rate,
                                            "per_gpu": best.per_gpu, "num_gpus": best.num_gpus},
        "vs_colocated": (best.per_gpu / colo.per_gpu) if best is not None and colo is not None and colo.per_gpu > 0 else None,
        "options": [{"name": o.name, "placement": o.placement.to_dict(), "rate": o.rate, "per_gpu": o.per_gpu} for o in result.options],
        "candidates": [{"kind": c.kind, "configuration": c.label(), "num_gpus": c.num_gpus, "goodput": c.goodput,
                        "per_gpu": c.per_gpu, "bound": c.bound_rate, "binding": c.binding, "skipped": c.skipped,
                        "goodput_below": c.goodput_below}
                       for c in result.candidates],
        "classes": None if result.classes is None else class_summary(result.classes),
    }


def plot(req: PlanRequest, result: PlanResult, path: str | Path) -> None:
    """Attainment vs rate per GPU for the best disaggregated and the colocated plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    disagg = next((o for o in result.options if o.name.startswith("disaggregated")), None)
    for option in (disagg, result.colocated):
        if option is None:
            continue
        xs, ys = [], []
        for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0):
            rate = option.rate * f
            res = simulate(option.placement, req.latency, with_rate(req.unit_requests, rate), req.sim_config)
            att = attainment(res.records, req.slo)
            xs.append(rate / option.num_gpus)
            ys.append(att["joint"] if req.slo.mode == "joint" else min(att["ttft"], att["tpot"]))
        ax.plot(xs, ys, marker="o", label=f"{option.name}: {_layout(option)[2]}")
    ax.axhline(req.slo.default.attainment, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("rate per GPU (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_title(req.latency.model.name)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plan(result: PlanResult, path: str | Path) -> None:
    if result.best is None:
        raise InvalidConfigError("no placement meets the SLO; nothing to write")
    result.best.placement.to_json(path)


def print_tables(tables: list[Table]) -> None:
    console = Console()
    for t in tables:
        console.print(t)


# ---- the --save-dir bundle -----------------------------------------------------------------------
BUNDLE_FILES = ("placement.json", "candidates.csv", "attainment.png", "goodput.png", "serve_command.txt", "serve_config.yaml")
CANDIDATE_COLUMNS = (
    "row", "kind", "configuration", "status", "num_gpus", "prefill", "decode", "layout", "bound_rps", "goodput_rps",
    "goodput_per_gpu", "goodput_below_rps", "binding_slo", "probe_rate_rps", "attainment_ttft", "attainment_tpot",
    "attainment_joint", "num_probes", "num_probes_stopped", "step_budget", "note",
)


def _candidate_status(c: Candidate) -> str:
    if c.skipped is not None:
        return "skipped"
    if c.goodput_below is not None:
        return "pruned"
    return "evaluated"


def _probe_attainment(c: Candidate) -> tuple[float | None, dict[str, float]]:
    """The probe a candidate's goodput stands on (the fastest passing rate), else its slowest probe."""
    passed = [p for p in c.probes if p[2]]
    probe = max(passed, key=lambda p: p[0]) if passed else min(c.probes, key=lambda p: p[0], default=None)
    return (None, {}) if probe is None else (probe[0], probe[1])


def candidate_rows(result: PlanResult) -> list[dict[str, Any]]:
    """One row per placement option (``row=plan``; the chosen one ``status=chosen``) and per simulated
    configuration (``row=candidate``: ``evaluated``, ``pruned`` when its search stopped because it could
    not beat the best, ``skipped`` with the reason in ``note``); attainment at the probe its goodput stands on."""
    rows: list[dict[str, Any]] = []
    for o in result.options:
        pre, dec, layout = _layout(o)
        att = o.predicted.get("attainment", {})
        rows.append({"row": "plan", "kind": o.name, "configuration": layout, "status": "chosen" if o is result.best else "option",
                     "num_gpus": o.num_gpus, "prefill": pre, "decode": dec, "layout": layout, "goodput_rps": o.rate,
                     "goodput_per_gpu": o.per_gpu, "probe_rate_rps": o.rate, "attainment_ttft": att.get("ttft"),
                     "attainment_tpot": att.get("tpot"), "attainment_joint": att.get("joint"),
                     "step_budget": o.predicted.get("step_budget", "")})
    for c in result.candidates:
        rate, att = _probe_attainment(c)
        p = c.placement
        specs = {name: f"tp{s[0].tp} pp{s[0].pp}" if s else "-" for name, s in (("prefill", p.prefill), ("decode", p.decode))}
        rows.append({"row": "candidate", "kind": c.kind, "configuration": c.label(), "status": _candidate_status(c),
                     "num_gpus": c.num_gpus, **specs, "layout": c.label(), "bound_rps": c.bound_rate,
                     "goodput_rps": c.goodput, "goodput_per_gpu": c.per_gpu, "goodput_below_rps": c.goodput_below,
                     "binding_slo": c.binding, "probe_rate_rps": rate, "attainment_ttft": att.get("ttft"),
                     "attainment_tpot": att.get("tpot"), "attainment_joint": att.get("joint"), "num_probes": len(c.probes),
                     "num_probes_stopped": c.num_probes_stopped, "step_budget": c.step_budget, "note": c.skipped or ""})
    return rows


def write_candidates_csv(result: PlanResult, path: str | Path) -> None:
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CANDIDATE_COLUMNS, restval="")
        writer.writeheader()
        for row in candidate_rows(result):
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def plot_goodput(req: PlanRequest, result: PlanResult, path: str | Path, max_bars: int = 40) -> None:
    """Goodput per GPU of the placement options and of the best simulated configurations of each kind (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars: list[tuple[str, float, str]] = [(f"{o.name}: {_layout(o)[2]}", o.per_gpu, "C3" if o is result.best else "C0")
                                          for o in result.options]
    evaluated = sorted((c for c in result.candidates if _candidate_status(c) == "evaluated"), key=lambda c: (c.kind, -c.per_gpu))
    room = max(0, max_bars - len(bars))
    per_kind = max(1, room // max(1, len({c.kind for c in evaluated})))
    shown: dict[str, int] = {}
    for c in evaluated:
        if shown.get(c.kind, 0) < per_kind:
            shown[c.kind] = shown.get(c.kind, 0) + 1
            bars.append((f"{c.kind}: {c.label()}", c.per_gpu, "C2"))
    fig, ax = plt.subplots(figsize=(7, 1.0 + 0.28 * len(bars)))
    ax.barh(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("goodput per GPU (req/s within the SLO)")
    slo = req.slo.default
    ax.set_title(f"{req.latency.model.name}: TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s at {slo.attainment:.0%}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def serve_argv(model: str, placement_path: str | Path) -> list[str]:
    """``distserve serve`` flags that deploy a plan: the model and the Placement JSON, which carries the SLO
    and the batch caps the plan was simulated with."""
    return ["distserve", "serve", "--model", model, "--placement", str(Path(placement_path).resolve())]


def serve_config(model: str, placement_path: str | Path, host: str = "127.0.0.1", port: int = 8000) -> dict[str, Any]:
    """A Ray Serve config (``serve run serve_config.yaml`` / ``serve deploy``) of the plan: the ingress app
    (``distserve.serving.app:build_app``) with the plan's Placement JSON; the proxy on ``host:port`` (loopback, as
    ``distserve serve``: edit ``host`` to serve other machines)."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": host, "port": port},
        "applications": [{
            "name": "distserve",
            "route_prefix": "/",
            "import_path": "distserve.serving.app:build_app",
            # A model folder by its absolute path: `serve run` may start elsewhere.
            "args": {"model": str(Path(model).resolve()) if Path(model).exists() else model,
                     "placement": str(Path(placement_path).resolve())},
        }],
    }


def write_bundle(req: PlanRequest, result: PlanResult, model: str, save_dir: str | Path) -> dict[str, Path]:
    """``distserve plan --save-dir``: the chosen placement, every candidate (CSV), the attainment and
    goodput plots, the ``distserve serve`` command and the Ray Serve config that deploy it."""
    import shlex

    import yaml

    if result.best is None:
        raise InvalidConfigError("no placement meets the SLO; nothing to write")
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in BUNDLE_FILES}
    write_plan(result, paths["placement.json"])
    write_candidates_csv(result, paths["candidates.csv"])
    plot(req, result, paths["attainment.png"])
    plot_goodput(req, result, paths["goodput.png"])
    paths["serve_command.txt"].write_text(shlex.join(serve_argv(model, paths["placement.json"])) + "\n")
    config = serve_config(model, paths["placement.json"])
    header = "# Ray Serve config of the plan: serve run serve_config.yaml (or serve deploy)\n"
    paths["serve_config.yaml"].write_text(header + yaml.safe_dump(config, sort_keys=False))
    return paths
