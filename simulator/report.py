"""What ``distserve simulate`` does once its flags are parsed: build the pieces, run, summarise, render."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from distserve.config import SchedulerConfig, slo_scheduler_config
from distserve.errors import InvalidConfigError
from distserve.placement import Placement
from distserve.slo import SLO, SLOSpec
from simulator.goodput import GoodputResult, find_goodput
from simulator.latency import LatencyModel, get_latency_model
from simulator.simulation import SimConfig, simulate
from simulator.multi_tenant import flood_workload, is_flood_spec, parse_flood_spec
from simulator.workload import MIX_PREFIX, Request, describe, generate_requests, load_trace, mixed_workload, rescale


@dataclass(frozen=True)
class SimulateRequest:
    """Everything one ``distserve simulate`` run needs."""

    model: str
    placement: Placement
    workload: str  # a synthetic workload name, fixed:P:O, or a .jsonl trace to replay
    slo: SLOSpec
    rate: float | None = None  # None: replay a trace at its own rate (required for synthetic workloads)
    num_requests: int = 1000
    arrival: str = "poisson"
    cv: float = 1.0
    seed: int = 0
    profile: str | None = None
    hardware: str | None = None
    goodput: bool = False
    config: SimConfig = SimConfig()


def _is_trace(workload: str) -> bool:
    return workload.endswith(".jsonl") or os.path.isfile(workload)


def build_latency_model(model: str, profile: str | None, hardware: str | None) -> LatencyModel:
    return get_latency_model(model, hardware=hardware, profile=profile)


def build_requests(req: SimulateRequest, max_total_len: int, unit_rate: bool = False) -> list[Request]:
    """The workload: a replayed (optionally rescaled) trace, or synthetic lengths with seeded arrivals."""
    if _is_trace(req.workload):
        trace = load_trace(req.workload)
        if unit_rate:
            return rescale(trace, 1.0)
        return rescale(trace, req.rate) if req.rate is not None else trace
    if req.rate is None and not unit_rate:
        raise InvalidConfigError("--rate is required for a synthetic workload (or pass --goodput to search it)")
    rate = 1.0 if unit_rate else req.rate
    if is_flood_spec(req.workload):
        num_light, factor = parse_flood_spec(req.workload)
        return flood_workload(rate, req.num_requests, num_light=num_light, factor=factor, seed=req.seed,  # type: ignore[arg-type]
                              max_total_len=max_total_len, arrival=req.arrival, cv=req.cv)
    if req.workload.startswith(MIX_PREFIX):
        return mixed_workload(req.workload, rate, req.num_requests, arrival=req.arrival, cv=req.cv, seed=req.seed,
                              max_total_len=max_total_len)
    return generate_requests(
        req.workload, rate, req.num_requests, arrival=req.arrival, cv=req.cv, seed=req.seed, max_total_len=max_total_len  # type: ignore[arg-type]
    )


def run(req: SimulateRequest) -> dict[str, Any]:
    """Simulate at the given rate (and, with ``goodput``, search the best rate); a JSON-able dict."""
    if req.rate is None and not req.goodput and not _is_trace(req.workload):
        raise InvalidConfigError("--rate is required for a synthetic workload (or pass --goodput to search it)")
    latency = build_latency_model(req.model, req.profile, req.hardware)
    max_len = req.config.max_model_len or latency.model.max_position_embeddings
    out: dict[str, Any] = {
        "model": latency.model.name,
        "latency_model": repr(latency),
        "hardware": latency.hardware.name,
        "placement": req.placement.to_dict(),
        "slo": {"ttft_s": req.slo.default.ttft_s, "tpot_s": req.slo.default.tpot_s,
                "attainment": req.slo.default.attainment, "mode": req.slo.mode},
    }
    if req.rate is not None or _is_trace(req.workload):
        requests = build_requests(req, max_len)
        out["workload"] = {"name": req.workload, **describe(requests)}
        out["result"] = simulate(req.placement, latency, requests, req.config).summary(req.slo)
    if req.goodput:
        unit = build_requests(req, max_len, unit_rate=True)
        g = find_goodput(req.placement, latency, unit, req.slo, req.config)
        out["goodput"] = goodput_summary(g, req.slo)
    return out


def goodput_summary(g: GoodputResult, slo: SLOSpec) -> dict[str, Any]:
    return {
        "rate": g.rate,
        "per_gpu": g.per_gpu,
        "num_gpus": g.num_gpus,
        "binding_slo": g.binding,
        "probes": [{"rate": p.rate, "attainment": p.attainment, "meets": p.meets, "stopped_early": p.stopped_early}
                   for p in g.probes],
        "at_rate": g.result.summary(slo) if g.result is not None else None,
    }


def _ms(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{1e3 * value:.1f}"


def render(out: dict[str, Any]) -> list[Table]:
    """Rich tables: latencies and attainment at the simulated rate, and the goodput search."""
    tables: list[Table] = []
    place = out["placement"]
    layout = " + ".join(
        f"{len(v)}x {k} tp{v[0]['tp']}pp{v[0]['pp']}" for k, v in place.items() if isinstance(v, list) and v
    )
    slo = out["slo"]
    target = f"TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s']} s, {slo['attainment']:.0%} ({slo['mode']})"
    res = out.get("result")
    if res is not None:
        wl = out["workload"]
        t = Table(title=f"{out['model']} on {layout}: {wl['name']} at {wl['rate']:.3g} req/s ({wl['num']:.0f} requests)",
                  caption=f"SLO: {target}; latency model: {out['latency_model']}")
        for col in ("metric", "mean", "P50", "P90", "P99"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for name in ("ttft", "tpot", "e2e"):
            t.add_row(f"{name.upper()} (ms)", *(_ms(res[f"{name}_{q}_s"]) for q in ("mean", "p50", "p90", "p99")))
        att = res["attainment"]
        t.add_row("attainment", f"joint {att['joint']:.1%}", f"TTFT {att['ttft']:.1%}", f"TPOT {att['tpot']:.1%}",
                  "meets" if res["meets_slo"] else "misses")
        t.add_row("throughput", f"{res['throughput_rps']:.3g} req/s", f"{res['num_gpus']} GPUs",
                  f"{res['num_preemptions']} preempt.", f"{res['num_migrations']} migr.")
        tables.append(t)
        if "tenants" in res:
            tables.append(_tenant_table(res, target))
    g = out.get("goodput")
    if g is not None:
        t = Table(title=f"goodput of {layout}: {g['per_gpu']:.3g} req/s per GPU ({g['rate']:.3g} req/s in all; "
                        f"binding SLO above it: {g['binding_slo']})",
                  caption=f"SLO: {target}" + ("; ≤: the probe stopped once it could not pass (a lower bound)"
                                              if any(p["stopped_early"] for p in g["probes"]) else ""))
        for col in ("rate (req/s)", "joint", "TTFT", "TPOT", "meets"):
            t.add_column(col, justify="right")
        for p in sorted(g["probes"], key=lambda p: p["rate"]):
            a, le = p["attainment"], "≤ " if p["stopped_early"] else ""
            t.add_row(f"{p['rate']:.4g}", *(f"{le}{a[k]:.1%}" for k in ("joint", "ttft", "tpot")), "yes" if p["meets"] else "no")
        tables.append(t)
    return tables


def _tenant_table(res: dict[str, Any], target: str) -> Table:
    """One row per tenant: its requests, latencies, attainment and admission wait."""
    adm = res.get("admission", {})
    t = Table(title=f"per tenant (admission policy: {adm.get('policy', '-')})",
              caption=f"SLO: {target}; wait: mean time in the admission queue; dropped: rejected + expired")
    for col in ("tenant", "requests", "TTFT P50", "TTFT P99", "TPOT P99", "wait (ms)", "attainment", "dropped"):
        t.add_column(col, justify="left" if col == "tenant" else "right")
    for name, row in res["tenants"].items():
        att = row.get("attainment", {}).get("joint")
        t.add_row(name, str(row["num_requests"]), *(_ms(row[k]) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s")),
                  _ms(row["admission_wait_mean_s"]), "-" if att is None else f"{att:.1%}",
                  str(row["num_rejected"] + row["num_expired"]))
    return t


def scheduler_configs(
    max_num_seqs: int | None, max_batched_tokens: int | None, tpot_slo_s: float | None = None
) -> dict[str, SchedulerConfig]:
    """The same limits for every phase (what ``distserve serve`` uses), overridden where given; with
    ``tpot_slo_s``, colocated and decode instances use the "slo" step budget (``serve --tpot-slo``)."""
    base = SchedulerConfig()
    kwargs = {
        "max_num_seqs": max_num_seqs or base.max_num_seqs,
        "max_num_batched_tokens": max_batched_tokens or base.max_num_batched_tokens,
    }
    cfg = SchedulerConfig(**kwargs)
    decoding = slo_scheduler_config(tpot_slo_s, cfg)
    return {"scheduler": decoding, "prefill_scheduler": cfg, "decode_scheduler": decoding}


def slo_spec(ttft_s: float, tpot_s: float, attainment: float, mode: str) -> SLOSpec:
    return SLOSpec(SLO(ttft_s, tpot_s, attainment), mode=mode)
