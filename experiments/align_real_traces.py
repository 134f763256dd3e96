"""The per-step cost our simulator misses, fitted to DistServe's real measurements (issue 18).

DistServe's repository publishes traces of its real runs on A100s: every request's arrival, prompt
and output length, TTFT and TPOT, for vLLM (OPT-13B, one TP1 GPU, ShareGPT, ``vllm-100-1``,
``vllm-200-2``, ``vllm-300-3``: 100/200/300 requests at 1/2/3 req/s) and for DistServe itself
(prefill TP2 + decode TP1, ``distserve-c21d11-300-3`` and ``-300-6``); transcribed into
``simulator/data/distserve-opt13b-{vllm,distserve}-traces.json``. Fitted step times (DistServe's
profiles) time the model alone; the real servers also spend time per step around it (scheduling,
sampling, the workers' round trip, detokenizing and streaming). This script replays each trace's
exact arrivals and lengths in our simulator — vLLM as ``vllm-2023`` on vLLM's fitted step times under
its launch limits (``--max-num-seqs 1024 --max-num-batched-tokens 16384``, KV at 95%), DistServe's
layout on DistServe's fitted step times under its launch limits — with two overheads on a grid: a
fixed one per step (``SimConfig.step_overhead_s``) and one per sequence in the step
(``SimConfig.seq_overhead_s``: sampling, detokenizing, streaming each request), and compares TTFT and
TPOT (p50 and p90, requests with >= 2 output tokens for TPOT) with the measured ones. A third parameter
scales the profile's prompt steps (``SimConfig.prefill_time_scale``): vLLM's profile times OPT-13B's TP1
prompts at 1.43x DistServe's, and its light-load trace says that is too slow. The fit is the grid point
with the smallest mean |ln(simulated / measured)| over the four statistics of every trace of that
system; ``distserve_setting.ALIGNED_OVERHEADS_S`` and ``ALIGNED_PREFILL_SCALE`` hold the results
(``distserve_table.py``'s ``aligned`` ablations use them).

    python experiments/align_real_traces.py           # 0-20 ms per step x 0-0.5 ms per sequence x 0.7-1.1, both systems
    python experiments/align_real_traces.py --quick   # 6 grid points, the first trace of each
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import harness
import simulator  # noqa: F401 - first of ours: the simulator's modules load compiled (distserve.compiled)
from distserve_setting import ALIGNED_OVERHEADS_S, ALIGNED_PREFILL_SCALE, DATA_DIR, EVAL_MEM_UTILIZATION, ROWS
from distserve_systems import Ablation, distserve_config, distserve_placement, row_latency, vllm_config

from distserve.placement import Placement
from simulator.simulation import simulate
from simulator.workload import Request

ROW = next(r for r in ROWS if r.key == "opt-13b-chatbot")  # OPT-13B: the model of the traces; DistServe's layout P TP2 / D TP1
STATS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
STEP_GRID_MS = [float(i) for i in range(21)]
SEQ_GRID_MS = [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5]
PREFILL_GRID = [0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1]  # the profile's prompt steps x this


@dataclass(frozen=True)
class Trace:
    name: str
    requests: list[Request]
    ttft_s: list[float]  # measured, per request (same order)
    tpot_s: list[float | None]  # measured; None: one output token


def load_traces(system: str) -> list[Trace]:
    data = json.loads((DATA_DIR / f"distserve-opt13b-{system}-traces.json").read_text())
    assert data["fields"] == ["issue_s", "prompt_len", "output_len", "ttft_ms", "tpot_ms"], data["fields"]
    out = []
    for name, rows in data["traces"].items():
        reqs = [Request(i, issue, prompt, max(1, output)) for i, (issue, prompt, output, _, _) in enumerate(rows)]
        out.append(Trace(name, reqs, [t / 1e3 for *_, t, _ in rows], [p / 1e3 if o >= 2 else None for _, _, o, _, p in rows]))
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def stats(ttft: list[float], tpot: list[float | None]) -> dict[str, float]:
    tp = [t for t in tpot if t is not None]
    return {"ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9), "tpot_p50": pct(tp, 0.5), "tpot_p90": pct(tp, 0.9)}


def kv_in_use_peak(trace: Trace, block_size: int = 16, every_s: float = 0.25) -> int:
    """The most KV tokens the measured run held at once (in whole blocks): every request from its first token to its
    last holds its prompt and the tokens generated so far (at its measured TPOT). Once vLLM's cache is full, new
    prompts wait (TTFT climbs) while this stays flat: so it is (a lower bound of) the cache's size."""
    spans = []
    for req, ttft, tpot in zip(trace.requests, trace.ttft_s, trace.tpot_s):
        first = req.arrival_s + ttft
        spans.append((first, first + (tpot or 0.0) * (req.output_len - 1), req.prompt_len, req.output_len))
    peak, t, end = 0, 0.0, max(s[1] for s in spans)
    while t <= end:
        held = 0
        for first, last, prompt, output in spans:
            if first <= t <= last:
                generated = 1 + (output - 1) * ((t - first) / (last - first) if last > first else 1.0)
                held += -(-int(prompt + generated) // block_size) * block_size
        peak, t = max(peak, held), t + every_s
    return peak


def vllm_kv_share(traces: list[Trace]) -> tuple[float, int, int, str]:
    """(share, peak tokens, our memory model's tokens, the trace of the peak): vLLM's cache as its busiest trace shows it,
    over what our memory model gives one TP1 instance at its launch setting (95% of HBM)."""
    peak, name = max((kv_in_use_peak(t), t.name) for t in traces)
    modelled = row_latency(ROW.model, "vllm")[0].max_kv_tokens(ROW.vllm_tp, 1, EVAL_MEM_UTILIZATION)
    return peak / modelled, peak, modelled, name


def system_setup(system: str, step_s: float, seq_s: float, prefill_scale: float = 1.0, kv_share: float | None = None,
                 padding: bool = False) -> tuple[Placement, Any, Any]:
    """(placement, SimConfig, latency model) of ``system`` as DistServe ran it, with ``step_s`` per step and ``seq_s``
    per sequence in a step, its profile's prompt steps x ``prefill_scale`` (vLLM: its cache ``kv_share`` of our memory
    model's, None: all of it; ``padding``: its prompt batches padded to the longest prompt)."""
    if system == "vllm":
        a = Ablation("fit", "", launch_limits=True, vllm_engine=True, vllm_overhead_s=step_s, vllm_seq_overhead_s=seq_s,
                     vllm_kv_share=kv_share, vllm_padding=padding, vllm_prefill_scale=prefill_scale)
        config, engine = vllm_config(a, ROW, (1.0, 1.0))
        return Placement.colocated_instances(1, ROW.vllm_tp), config, row_latency(ROW.model, engine)[0]
    a = Ablation("fit", "", launch_limits=True, distserve_overhead_s=step_s, distserve_seq_overhead_s=seq_s,
                 distserve_prefill_scale=prefill_scale)
    placement, config = distserve_placement(a, ROW, distserve_config(a))
    return placement, config, row_latency(ROW.model)[0]


def simulated_stats(system: str, trace: Trace, step_s: float, seq_s: float, prefill_scale: float = 1.0, kv_share: float | None = None,
                    padding: bool = False) -> dict[str, float]:
    placement, config, latency = system_setup(system, step_s, seq_s, prefill_scale, kv_share, padding)
    records = {r.req_id: r for r in simulate(placement, latency, trace.requests, config).records}
    ttft, tpot = [], []
    for req in trace.requests:
        rec = records[req.req_id]
        if rec.first_token_s is None or rec.finish_s is None:
            raise SystemExit(f"{system} {trace.name}: request {req.req_id} did not finish in the simulation")
        ttft.append(rec.first_token_s - rec.arrival_s)
        tpot.append((rec.finish_s - rec.first_token_s) / (req.output_len - 1) if req.output_len >= 2 else None)
    return stats(ttft, tpot)


def error(sim: dict[str, float], real: dict[str, float]) -> float:
    return sum(abs(math.log(sim[k] / real[k])) for k in STATS) / len(STATS)


def fit(system: str, traces: list[Trace], step_grid_ms: list[float], seq_grid_ms: list[float], prefill_grid: list[float],
        kv_share: float | None = None, padding: bool = False) -> dict[str, Any]:
    """The grid point (per step, per sequence, prompt-step scale) that replays ``traces`` best; also the best with the
    profile's prompt steps as they are (scale 1: ``unscaled``), and the best per step only at scale 1 (``step_only``)."""
    real = {t.name: stats(t.ttft_s, t.tpot_s) for t in traces}
    grid = []
    for scale in prefill_grid:
        for step_ms in step_grid_ms:
            for seq_ms in seq_grid_ms:
                sims = {t.name: simulated_stats(system, t, step_ms / 1e3, seq_ms / 1e3, scale, kv_share, padding) for t in traces}
                grid.append({"prefill_scale": scale, "step_ms": step_ms, "seq_ms": seq_ms,
                             "error": round(sum(error(sims[n], real[n]) for n in sims) / len(sims), 4), "stats": sims})
    best = min(grid, key=lambda c: c["error"])
    unit = [c for c in grid if c["prefill_scale"] == 1.0]
    unscaled = min(unit, key=lambda c: c["error"])
    zero = next(c for c in unit if c["step_ms"] == 0 and c["seq_ms"] == 0)
    step_only = min((c for c in unit if c["seq_ms"] == 0), key=lambda c: c["error"])
    return {"traces": [t.name for t in traces], "num_requests": {t.name: len(t.requests) for t in traces}, "measured": real,
            "best_prefill_scale": best["prefill_scale"], "best_step_ms": best["step_ms"], "best_seq_ms": best["seq_ms"],
            "best_error": best["error"], "error_at_0": zero["error"], "best": best["stats"],
            "unscaled": {"step_ms": unscaled["step_ms"], "seq_ms": unscaled["seq_ms"], "error": unscaled["error"], "stats": unscaled["stats"]},
            "best_step_only_ms": step_only["step_ms"], "step_only_error": step_only["error"], "step_only": step_only["stats"],
            "grid": [{k: c[k] for k in ("prefill_scale", "step_ms", "seq_ms", "error")} for c in grid]}


def main() -> None:
    ap = harness.parser(__doc__, "grid 0, 5, 10 ms per step x 0, 0.2 ms per sequence; the first trace of each system")
    args = ap.parse_args()
    step_grid, seq_grid, prefill_grid = ([0.0, 5.0, 10.0], [0.0, 0.2], [0.8, 1.0]) if args.quick else (STEP_GRID_MS, SEQ_GRID_MS, PREFILL_GRID)
    out = harness.Outputs.for_run(args, "align_real_traces")
    t0 = time.perf_counter()
    figures: dict[str, Any] = {"quick": args.quick, "step_grid_ms": step_grid, "seq_grid_ms": seq_grid, "model": ROW.model, "systems": {}}
    lines = ["# The overheads of DistServe's real runs, fitted in our simulator", "",
             f"OPT-13B on A100 (DistServe's traces); error = mean |ln(simulated / measured)| over TTFT and TPOT p50/p90 of every trace; "
             f"grid {step_grid[0]:g}–{step_grid[-1]:g} ms per step × {seq_grid[0]:g}–{seq_grid[-1]:g} ms per sequence in a step × "
             f"{prefill_grid[0]:g}–{prefill_grid[-1]:g} times the profile's prompt steps.", ""]
    all_traces = {system: load_traces(system) for system in ("vllm", "distserve")}
    share, peak, modelled, busiest = vllm_kv_share(all_traces["vllm"])
    figures["vllm_kv"] = {"peak_tokens_in_use": peak, "trace": busiest, "our_memory_model_tokens": modelled, "share": round(share, 3)}
    lines += [f"vLLM's cache: at most {peak:,} KV tokens in use at once (`{busiest}`, while new prompts wait); our memory model "
              f"gives one TP1 instance {modelled:,} at 95% of HBM: vLLM's cache is **{share:.2f}** of ours. The vLLM fits below use "
              "that cache (the best per-step fit with our memory model's cache instead: `without_kv_share` in the JSON).", ""]
    for system, traces in all_traces.items():
        traces = traces[: 1 if args.quick else None]
        res = fit(system, traces, step_grid, seq_grid, prefill_grid, share if system == "vllm" else None)
        if system == "vllm":
            res["without_kv_share"] = {k: v for k, v in fit(system, traces, step_grid, [0.0], [1.0]).items()
                                       if k in ("best_step_ms", "best_error", "best")}
            # vLLM before 0.4 padded a step's prompts to the longest (``SimConfig.prefill_padding``): does it fit better so?
            res["padded"] = {k: v for k, v in fit(system, traces, step_grid, seq_grid, prefill_grid, share, padding=True).items()
                             if k in ("best_prefill_scale", "best_step_ms", "best_seq_ms", "best_error", "error_at_0", "best")}
        figures["systems"][system] = res
        best = f"prompt steps x{res['best_prefill_scale']:g} +{res['best_step_ms']:g} ms/step +{res['best_seq_ms']:g} ms/seq"
        u = res["unscaled"]
        unscaled = f"+{u['step_ms']:g} ms/step +{u['seq_ms']:g} ms/seq"
        lines += [f"## {system}: best {best} (error {res['best_error']:.3f}; the profile's prompt steps unscaled: {unscaled}, "
                  f"{u['error']:.3f}; per step only: {res['best_step_only_ms']:g} ms, {res['step_only_error']:.3f}; none: {res['error_at_0']:.3f})",
                  "", "| trace | | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 |", "|---|---|---:|---:|---:|---:|"]
        rows = []
        for name in res["traces"]:
            for label, st in (("measured", res["measured"][name]), (f"simulated {best}", res["best"][name]),
                              (f"simulated {unscaled}", u["stats"][name]),
                              (f"simulated +{res['best_step_only_ms']:g} ms/step", res["step_only"][name])):
                cells = [harness.ms(st[k]) for k in STATS]
                lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
                rows.append([name, label, *cells])
        lines.append("")
        harness.rich_table(f"{system}: measured vs simulated (ms)", ["trace", "", *STATS], rows, left=("trace", ""))
        print(f"{system}: best {best}, error {res['best_error']:.3f} (unscaled: {unscaled}, {u['error']:.3f}; per step only: "
              f"{res['best_step_only_ms']:g} ms, {res['step_only_error']:.3f}; none: {res['error_at_0']:.3f})", flush=True)
        if "padded" in res:
            p = res["padded"]
            lines += [f"With vLLM's prompt batches padded to the longest prompt (vLLM before 0.4: `SimConfig.prefill_padding`): best "
                      f"prompt steps x{p['best_prefill_scale']:g} +{p['best_step_ms']:g} ms/step +{p['best_seq_ms']:g} ms/seq, error {p['best_error']:.3f} (none: {p['error_at_0']:.3f}) "
                      f"— against {res['best_error']:.3f} unpadded.", ""]
            print(f"{system} padded: best x{p['best_prefill_scale']:g} +{p['best_step_ms']:g} ms/step +{p['best_seq_ms']:g} ms/seq, error {p['best_error']:.3f}", flush=True)
    figures["aligned_overheads_ms_in_setting"] = {k: [v * 1e3 for v in vs] for k, vs in ALIGNED_OVERHEADS_S.items()}
    figures["aligned_prefill_scale_in_setting"] = dict(ALIGNED_PREFILL_SCALE)
    figures["wall_s"] = round(time.perf_counter() - t0, 2)
    out.json(figures)
    out.markdown(lines)
    harness.finish({**figures, "systems": {s: {k: v for k, v in r.items() if k != "grid"} for s, r in figures["systems"].items()}})  # the grids: JSON


if __name__ == "__main__":
    main()
