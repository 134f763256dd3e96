"""Why DistServe's OPT-13B chatbot headline is not reproduced: one assumption changed at a time.

DistServe (OSDI'24) reports that, for OPT-13B chatbots (ShareGPT, TTFT 0.25 s / TPOT 0.1 s, 90%
attainment, A100), disaggregation serves 2.0-4.6x the rate per GPU of vLLM. Our simulator, with
DistServe's own fitted A100 step times, finds the opposite on DistServe's workload preparation
(``sharegpt-multiturn``). This script measures, for each ablation below, the goodput per GPU of

  (a) DistServe's layout: prefill 1 x TP2 + decode 1 x TP1 (3 GPUs),
  (b) the best disaggregated placement on <= 4 GPUs (every n_p x TPp + n_d x TPd with tp in {1, 2},
      pp 1: the 11 placements that fit; pp > 1 never won for OPT-13B in reproduce_distserve.py),
  (c) the best colocated ``vllm-2023`` placement (prefill-only steps that pause decodes: the vLLM
      DistServe compared with) among 4 x TP1, 2 x TP2, 1 x TP4, and
  (d) the best colocated ``mixed`` placement (ours: prompts join the decodes' step), same shapes,

and the ratio b / c (DistServe's claim: >= 2.0) and b / d; also (c1) the ``vllm-2023`` baseline on TP1
instances only (4 x TP1: DistServe ran vLLM at TP1 for OPT-13B) and a / c1, DistServe's own comparison. Each ablation is one named assumption
(``ABLATIONS``), changed alone from the baseline (our defaults):

  * per-instance sequence cap ``max_num_seqs`` (ours 64; DistServe's evaluation launched vLLM
    with ``--max-num-seqs 1024`` and its decode instances with a batch cap of 1024, its prefill
    instances with 128 — ``evaluation/2-benchmark-serving/2-start-api-server.py``);
  * KV capacity per instance (ours: weights off 90% of 80 GB, 63,022 tokens at TP1; DistServe's
    simulator's memory model ``simdistserve/estimators/profile_data/max_num_tokens.csv``: 66,144
    at TP1, 163,008 at TP2, 356,736 at TP4; or half of ours);
  * a fixed per-step overhead added to every step of every system (``SimConfig.step_overhead_s``);
  * prompt lengths: ``chatbot`` (first turns, mean ~228 tokens) instead of ``sharegpt-multiturn``;
  * step-token budgets of DistServe's evaluation (vLLM ``--max-num-batched-tokens 16384``, DistServe
    prefill 8192 / decode 65536 tokens per batch, KV at ``--gpu-memory-utilization 0.95``);
  * the baseline's engine: vLLM's own fitted step times (DistServe's
    ``simdistserve/estimators/profile_data/profiler-a100-80g.vllm.json``, OPT-13B) for the
    colocated systems, DistServe's for the disaggregated ones — the real comparison ran two
    engines; and that plus a 6 ms per-step overhead on vLLM only (DistServe's real vLLM traces,
    ``simdistserve/benchmarks/alignment/data-ground-truth/opt-13b-sharegpt/vllm-*.exp``, show
    25-30 ms TPOT at light load where the fitted decode step is ~20 ms).

Goodput: ``simulator.goodput.find_goodput`` (bisection on the Poisson rate of one seeded workload
replayed at each rate), attainment ``joint`` (``distserve_setting.MODE``: 90% of requests meet both SLOs,
as DistServe's plotting script counts them), ``--requests-per-gpu`` requests per GPU of the placement (the same seeded stream,
so every placement is simulated for the same time at equal per-GPU rates). Searches that an
ablation does not change (e.g. the disaggregated ones when only the colocated engine changes) are
reused, not repeated.

Writes distserve_ablation.{json,md,png} (bars: b / c and b / d per ablation) under --out-dir; the
last stdout line is one JSON object of figures. A full run (12 ablations, ~170 searches) takes ~7 min
on 2 cores with 2 processes.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import harness
from distserve.cli.arg_types import positive_float, positive_int
from distserve.config import SchedulerConfig
from distserve.placement import Placement
from distserve.slo import SLO, SLOSpec
from simulator import DISTSERVE_A100_PROFILE
from simulator.goodput import find_goodput
from simulator.latency import FittedLatencyModel
from simulator.simulation import SimConfig
from simulator.workload import Request, describe
from distserve_setting import (
    DISTSERVE_DECODE_LIMITS, DISTSERVE_PREFILL_LIMITS, EVAL_MEM_UTILIZATION, MODE, REAL_VLLM_TRACE, VLLM_A100_PROFILE, VLLM_LIMITS,
    VLLM_STEP_OVERHEAD_S, request_stream,
)

MODEL, NUM_GPUS = "facebook/opt-13b", 4
TTFT_SLO_S, TPOT_SLO_S, ATTAINMENT = 0.25, 0.1, 0.9  # DistServe's Table 1, OPT-13B chatbot
DISTSERVE_CLAIM = 2.0  # the low end of "2.0-4.6x the rate of vLLM" for chatbots
START_PER_GPU = 2.0

# KV tokens per instance in DistServe's simulator (simdistserve/estimators/profile_data/max_num_tokens.csv), by tp (pp 1).
DISTSERVE_KV_TOKENS = {1: 66_144, 2: 163_008, 4: 356_736}

Limits = tuple[int, int]  # (max_num_seqs, max_num_batched_tokens)
OURS: Limits = (SchedulerConfig.max_num_seqs, SchedulerConfig.max_num_batched_tokens)


# ---- what one ablation changes ---------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """Everything a search depends on besides the placement and the colocated step policy."""

    workload: str = "sharegpt-multiturn"
    colocated_engine: str = "distserve"  # whose fitted step times the colocated systems get: "distserve" | "vllm"
    colocated_limits: Limits = OURS
    prefill_limits: Limits = OURS
    decode_limits: Limits = OURS
    kv: str = "ours"  # "ours" (latency model at mem_utilization) | "distserve" (DISTSERVE_KV_TOKENS) | "half" (ours / 2)
    mem_utilization: float = 0.9
    step_overhead_s: float = 0.0
    overhead_colocated_only: bool = False

    def for_kind(self, colocated: bool) -> Setup:
        """The fields that matter to one kind of system (the others at the baseline), so equal searches are shared."""
        base = Setup()
        if colocated:
            return replace(self, prefill_limits=base.prefill_limits, decode_limits=base.decode_limits)
        return replace(self, colocated_engine=base.colocated_engine, colocated_limits=base.colocated_limits,
                       step_overhead_s=0.0 if self.overhead_colocated_only else self.step_overhead_s,
                       overhead_colocated_only=False)


@dataclass(frozen=True)
class Ablation:
    name: str
    assumption: str  # what is changed, and why it is a candidate
    setup: Setup


DISTSERVE_EVAL = Setup(colocated_limits=VLLM_LIMITS, prefill_limits=DISTSERVE_PREFILL_LIMITS, decode_limits=DISTSERVE_DECODE_LIMITS,
                       mem_utilization=EVAL_MEM_UTILIZATION)
ABLATIONS = [
    Ablation("baseline", "our defaults: max_num_seqs 64, 2048 tokens per step, KV from our memory model (90% of HBM), no step "
             "overhead, sharegpt-multiturn prompts, DistServe's step times for every system", Setup()),
    Ablation("seqs-32", "max_num_seqs 32 on every instance", Setup(colocated_limits=(32, 2048), prefill_limits=(32, 2048),
                                                                 decode_limits=(32, 2048))),
    Ablation("seqs-256", "max_num_seqs 256 on every instance (vLLM 0.2's default; DistServe's evaluation used 1024)",
             Setup(colocated_limits=(256, 2048), prefill_limits=(256, 2048), decode_limits=(256, 2048))),
    Ablation("kv-distserve", "KV tokens per instance from DistServe's simulator's memory model (66k/163k/357k at TP1/2/4)",
             Setup(kv="distserve")),
    Ablation("kv-half", "half of our KV capacity on every instance", Setup(kv="half")),
    Ablation("overhead-5ms", "5 ms added to every step of every system", Setup(step_overhead_s=0.005)),
    Ablation("overhead-15ms", "15 ms added to every step of every system", Setup(step_overhead_s=0.015)),
    Ablation("chatbot", "first-turn ShareGPT prompts (`chatbot`, mean ~228 tokens) instead of `sharegpt-multiturn`",
             Setup(workload="chatbot")),
    Ablation("eval-limits", "DistServe's evaluation launch settings: vLLM 1024 seqs / 16384 tokens per step; DistServe prefill "
             "128 / 8192, decode 1024 / 65536; KV at 95% of HBM", DISTSERVE_EVAL),
    Ablation("vllm-steps", "the colocated baselines run on vLLM's fitted step times (DistServe's vLLM profile), the "
             "disaggregated ones on DistServe's", Setup(colocated_engine="vllm")),
    Ablation("vllm-steps+6ms", "vllm-steps, plus 6 ms per step on the colocated (vLLM) instances only",
             Setup(colocated_engine="vllm", step_overhead_s=VLLM_STEP_OVERHEAD_S, overhead_colocated_only=True)),
    Ablation("as-evaluated", "vllm-steps+6ms with eval-limits: the closest we model DistServe's real vLLM comparison",
             replace(DISTSERVE_EVAL, colocated_engine="vllm", step_overhead_s=VLLM_STEP_OVERHEAD_S, overhead_colocated_only=True)),
]
QUICK_ABLATIONS = ("baseline", "vllm-steps+6ms")


# ---- candidates --------------------------------------------------------------------------------
DISTSERVE_LAYOUT = Placement.disaggregated(1, 1, 2, 1, 1, 1)
COLOCATED_SHAPES = [(4, 1), (2, 2), (1, 4)]  # (n, tp): 4 GPUs each; the first is TP1 (column c1)
POLICIES = ("vllm-2023", "mixed")


def disagg_candidates(num_gpus: int = NUM_GPUS) -> list[Placement]:
    """Every n_p x TPp + n_d x TPd (tp in {1, 2}, pp 1) on <= num_gpus GPUs."""
    return [Placement.disaggregated(n_p, n_d, tp_p, 1, tp_d, 1)
            for tp_p in (1, 2) for tp_d in (1, 2) for n_p in range(1, num_gpus + 1) for n_d in range(1, num_gpus + 1)
            if n_p * tp_p + n_d * tp_d <= num_gpus]


def name_of(p: Placement) -> str:
    if p.is_disaggregated:
        return f"P {len(p.prefill)}xtp{p.prefill[0].tp} + D {len(p.decode)}xtp{p.decode[0].tp}"
    return f"{len(p.colocated)}xtp{p.colocated[0].tp}"


# ---- one search (in a worker process) -------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    setup: Setup
    placement: dict[str, Any]
    policy: str  # the colocated step policy ("-" for disaggregated)
    requests_per_gpu: int
    rel_tol: float
    seed: int


_CACHE: dict[Any, Any] = {}


class KVCapacityModel(FittedLatencyModel):
    """A fitted model whose KV capacity per instance follows a named assumption instead of our memory model."""

    kv_rule = "ours"

    def max_kv_tokens(self, tp: int, pp: int, mem_utilization: float = 0.9) -> int:
        if self.kv_rule == "distserve":
            return DISTSERVE_KV_TOKENS[tp] // pp
        tokens = super().max_kv_tokens(tp, pp, mem_utilization)
        return tokens // 2 if self.kv_rule == "half" else tokens


def latency_for(engine: str, kv: str) -> KVCapacityModel:
    key = ("latency", engine, kv)
    if key not in _CACHE:
        m = KVCapacityModel.from_profile(VLLM_A100_PROFILE if engine == "vllm" else DISTSERVE_A100_PROFILE, model=MODEL)
        m.kv_rule = kv
        _CACHE[key] = m
    return _CACHE[key]  # type: ignore[no-any-return]


def workload_for(name: str, num_requests: int, stream_len: int, seed: int) -> list[Request]:
    """The first ``num_requests`` of one seeded stream of ``stream_len``, rescaled to exactly 1 request/s."""
    return request_stream(name, num_requests, stream_len, seed)


def sim_config(setup: Setup, colocated: bool, policy: str) -> SimConfig:
    def sched(limits: Limits, **kw: Any) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=limits[0], max_num_batched_tokens=limits[1], **kw)

    return SimConfig(
        scheduler=sched(setup.colocated_limits, step_policy=policy) if colocated else SchedulerConfig(),
        prefill_scheduler=sched(setup.prefill_limits), decode_scheduler=sched(setup.decode_limits),
        mem_utilization=setup.mem_utilization,
        step_overhead_s=setup.step_overhead_s if colocated or not setup.overhead_colocated_only else 0.0,
    )


def search(task: Task) -> dict[str, Any]:
    placement = Placement.from_dict(task.placement)
    colocated = not placement.is_disaggregated
    s = task.setup
    latency = latency_for(s.colocated_engine if colocated else "distserve", s.kv)
    requests = workload_for(s.workload, task.requests_per_gpu * placement.num_workers, task.requests_per_gpu * NUM_GPUS, task.seed)
    slo = SLOSpec(SLO(TTFT_SLO_S, TPOT_SLO_S, ATTAINMENT), mode=MODE)
    t0 = time.perf_counter()
    g = find_goodput(placement, latency, requests, slo, sim_config(s, colocated, task.policy), rel_tol=task.rel_tol,
                     start_rate=START_PER_GPU * placement.num_workers)
    out: dict[str, Any] = {"placement": name_of(placement), "policy": task.policy, "num_gpus": g.num_gpus,
                           "rate": round(g.rate, 4), "per_gpu": round(g.per_gpu, 4), "binding": g.binding,
                           "num_probes": len(g.probes), "wall_s": round(time.perf_counter() - t0, 2)}
    if g.result is not None and g.rate > 0:
        summary = g.result.summary(slo)
        out.update({k: round(float(summary[k]), 4) for k in ("ttft_p90_s", "tpot_p90_s")})  # type: ignore[arg-type]
        out["num_preemptions"] = summary["num_preemptions"]
    return out


def run_all(tasks: list[Task], jobs: int) -> list[dict[str, Any]]:
    def report(r: dict[str, Any]) -> dict[str, Any]:
        print(f"  {r['placement']:<18} {r['policy']:<9} {r['per_gpu']:6.3f}/GPU  binding {r['binding']}  "
              f"({r['num_probes']} probes, {r['wall_s']:.1f} s)", flush=True)
        return r

    if jobs <= 1:
        return [report(search(t)) for t in tasks]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return [report(f.result()) for f in [pool.submit(search, t) for t in tasks]]


# ---- one row per ablation ----------------------------------------------------------------------
def summarise(ablation: Ablation, found: dict[tuple[Any, ...], dict[str, Any]], disagg: list[Placement],
              colocated: list[Placement], key: Any) -> dict[str, Any]:
    def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return max(rows, key=lambda r: (r["per_gpu"], -r["num_gpus"]))

    d_rows = [found[key(ablation.setup, p, "-")] for p in disagg]
    a = found[key(ablation.setup, DISTSERVE_LAYOUT, "-")]
    row: dict[str, Any] = {"ablation": ablation.name, "assumption": ablation.assumption, "setup": asdict(ablation.setup),
                           "a_distserve_layout": a, "b_best_disagg": best(d_rows)}
    for label, policy in (("c_vllm2023", "vllm-2023"), ("d_mixed", "mixed")):
        row[label] = best([found[key(ablation.setup, p, policy)] for p in colocated])
    b = row["b_best_disagg"]["per_gpu"]
    for label in ("c_vllm2023", "d_mixed"):
        c = row[label]["per_gpu"]
        row[f"ratio_b_over_{label[0]}"] = round(b / c, 3) if c > 0 else None
    c = row["c_vllm2023"]["per_gpu"]
    row["ratio_a_over_c"] = round(a["per_gpu"] / c, 3) if c > 0 else None
    # DistServe's own comparison: vLLM ran OPT-13B on TP1 instances (2-start-api-server.py: "vllm": 1).
    row["c1_vllm2023_tp1"] = found[key(ablation.setup, colocated[0], "vllm-2023")]
    c1 = row["c1_vllm2023_tp1"]["per_gpu"]
    row["ratio_a_over_c1"] = round(a["per_gpu"] / c1, 3) if c1 > 0 else None
    return row


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def direction(row: dict[str, Any], base: dict[str, Any], key: str) -> str:
    if row[key] is None or base[key] is None:
        return "-"
    change = row[key] / base[key] - 1.0
    return "=" if abs(change) < 0.03 else ("up" if change > 0 else "down") + f" {change:+.0%}"


def write_outputs(out: harness.Outputs, rows: list[dict[str, Any]], searches: list[dict[str, Any]], figures: dict[str, Any]) -> None:
    out.json({"figures": figures, "rows": rows, "searches": searches})
    base = rows[0]
    md = [
        f"{MODEL} on <= {NUM_GPUS} x A100-80G (DistServe's fitted step times unless an ablation says otherwise), SLO TTFT "
        f"{TTFT_SLO_S * 1000:.0f} ms / TPOT {TPOT_SLO_S * 1000:.0f} ms at {ATTAINMENT:.0%} (`{MODE}`), "
        f"{figures['requests_per_gpu']} requests per GPU of each placement (seed {figures['seed']}), bisection rel_tol "
        f"{figures['rel_tol']}. Goodput in req/s per GPU; (a) DistServe's layout P 1xtp2 + D 1xtp1; (b) best of "
        f"{figures['num_disagg_candidates']} disaggregated placements; (c) best colocated `vllm-2023`, (d) best colocated "
        f"`mixed`, each of {', '.join(f'{n}xtp{tp}' for n, tp in COLOCATED_SHAPES)}. DistServe's claim: b / c >= "
        f"{DISTSERVE_CLAIM}. Direction: the ablation's b / c against the baseline's. {figures['num_searches']} searches, "
        f"wall {figures['wall_s']:.0f} s.",
        "",
        "| ablation | (a) DistServe layout | (b) best disagg | (c) colocated vllm-2023 | (d) colocated mixed | (c1) vllm-2023 4xtp1 "
        "| b / c | b / d | a / c | a / c1 | b / c vs baseline | b / d vs baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{_f(r[k]['per_gpu'])} ({r[k]['placement']}, {r[k]['binding'] or '-'})"
                 if k in ("b_best_disagg", "c_vllm2023", "d_mixed") else f"{_f(r[k]['per_gpu'])} ({r[k]['binding'] or '-'})"
                 for k in ("a_distserve_layout", "b_best_disagg", "c_vllm2023", "d_mixed", "c1_vllm2023_tp1")]
        md.append(f"| {r['ablation']} | " + " | ".join(cells) + f" | {_f(r['ratio_b_over_c'])} | {_f(r['ratio_b_over_d'])} | "
                  f"{_f(r['ratio_a_over_c'])} | {_f(r['ratio_a_over_c1'])} | {direction(r, base, 'ratio_b_over_c')} | "
                  f"{direction(r, base, 'ratio_b_over_d')} |")
    md += ["", "Placement and binding SLO in brackets (the SLO that fails first just above the goodput). (c1): the "
           "`vllm-2023` baseline on TP1 instances only, as DistServe ran vLLM for OPT-13B; a / c1 is DistServe's own comparison "
           "(its layout vs that vLLM).", ""]
    reached = [r["ablation"] for r in rows if (r["ratio_b_over_c"] or 0) >= DISTSERVE_CLAIM]
    reached1 = [r["ablation"] for r in rows if (r["ratio_a_over_c1"] or 0) >= DISTSERVE_CLAIM]
    ttft = figures["unloaded_ttft_p90_prompt_tp1_s"]
    md += [
        f"b / c reaches DistServe's {DISTSERVE_CLAIM}x in: {', '.join(reached) or 'no ablation'}; a / c1 in: "
        f"{', '.join(reached1) or 'no ablation'}.",
        "",
        f"Unloaded TTFT of the p90 prompt ({figures['p90_prompt_tokens']:.0f} tokens of `sharegpt-multiturn`) on one TP1 "
        f"instance: DistServe's step times {ttft['distserve'] * 1000:.0f} ms, vLLM's {ttft['vllm'] * 1000:.0f} ms, vLLM's + 6 ms "
        f"{ttft['vllm+6ms'] * 1000:.0f} ms, against a {TTFT_SLO_S * 1000:.0f} ms SLO that 90% of requests must meet.",
        "",
        "Moves b / c by more than 10% from the baseline: " + (", ".join(
            f"{r['ablation']} ({direction(r, base, 'ratio_b_over_c')})" for r in rows[1:]
            if r["ratio_b_over_c"] and base["ratio_b_over_c"] and abs(r["ratio_b_over_c"] / base["ratio_b_over_c"] - 1) > 0.1)
            or "none") + ".",
        "",
        REAL_VLLM_TRACE,
        "", "Ablations:",
    ]
    md += [f"- **{r['ablation']}**: {r['assumption']}" for r in rows]
    out.markdown(md)

    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(max(7.0, 0.8 * len(rows)), 4.2))
    xs = list(range(len(rows)))
    for offset, key, label in ((-0.27, "ratio_b_over_c", "(b) best disagg / (c) colocated vllm-2023"),
                               (0.0, "ratio_b_over_d", "(b) best disagg / (d) colocated mixed"),
                               (0.27, "ratio_a_over_c1", "(a) DistServe's layout / (c1) vllm-2023 on TP1")):
        ax.bar([x + offset for x in xs], [r[key] or 0.0 for r in rows], width=0.27, label=label)
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.axhline(DISTSERVE_CLAIM, color="tab:red", linestyle="--", linewidth=1, label=f"DistServe's claim ({DISTSERVE_CLAIM}x+)")
    ax.set_xticks(xs, [r["ablation"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="goodput per GPU ratio", title=f"{MODEL}, sharegpt-multiturn unless named: disaggregated / colocated")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.png(fig)


# ---- main ------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__, f"ablations {', '.join(QUICK_ABLATIONS)}; DistServe's layout, one colocated shape; "
                                 "10 requests per GPU, rel_tol 0.3")
    ap.add_argument("--ablations", default=",".join(a.name for a in ABLATIONS), help="comma-separated names (baseline first)")
    ap.add_argument("--requests-per-gpu", type=positive_int, default=300)
    ap.add_argument("--rel-tol", type=positive_float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=positive_int, default=2, help="worker processes")
    args = ap.parse_args()
    if args.quick:
        args.ablations, args.requests_per_gpu, args.rel_tol, args.jobs = ",".join(QUICK_ABLATIONS), 10, 0.3, 1
    known = {a.name for a in ABLATIONS}
    args.ablations = [a for a in args.ablations.split(",") if a]
    if unknown := [a for a in args.ablations if a not in known]:
        ap.error(f"--ablations: unknown {unknown}; known: {sorted(known)}")
    if not args.ablations or args.ablations[0] != "baseline":
        ap.error("--ablations must start with baseline (the directions are relative to it)")
    if args.rel_tol >= 1:
        ap.error("--rel-tol must be in (0, 1)")
    return args


def main() -> None:
    args = parse_args()
    t0 = time.monotonic()
    ablations = [a for name in args.ablations for a in ABLATIONS if a.name == name]
    disagg = [DISTSERVE_LAYOUT] if args.quick else disagg_candidates()
    colocated = [Placement.colocated_instances(n, tp) for n, tp in (COLOCATED_SHAPES[:1] if args.quick else COLOCATED_SHAPES)]

    def key(setup: Setup, p: Placement, policy: str) -> tuple[Any, ...]:
        return (setup.for_kind(not p.is_disaggregated), name_of(p), policy)

    tasks: dict[tuple[Any, ...], Task] = {}
    for a in ablations:
        for p, policy in [*((p, "-") for p in disagg), *((p, pol) for p in colocated for pol in POLICIES)]:
            k = key(a.setup, p, policy)
            tasks.setdefault(k, Task(k[0], p.to_dict(), policy, args.requests_per_gpu, args.rel_tol, args.seed))
    print(f"{len(ablations)} ablations, {len(tasks)} distinct searches, {args.jobs} processes", flush=True)
    keys = list(tasks)
    found = dict(zip(keys, run_all([tasks[k] for k in keys], args.jobs)))
    searches = [{**r, "setup": asdict(k[0])} for k, r in found.items()]
    rows = [summarise(a, found, disagg, colocated, key) for a in ablations]

    stats = {w: {k: round(v, 1) for k, v in describe(workload_for(w, NUM_GPUS * args.requests_per_gpu,
                                                                   NUM_GPUS * args.requests_per_gpu, args.seed)).items()
                 if k in ("prompt_mean", "prompt_p50", "prompt_p90", "output_mean")}
             for w in sorted({a.setup.workload for a in ablations})}
    figures: dict[str, Any] = {
        "model": MODEL, "ttft_slo_s": TTFT_SLO_S, "tpot_slo_s": TPOT_SLO_S, "attainment": ATTAINMENT, "mode": MODE,
        "requests_per_gpu": args.requests_per_gpu, "rel_tol": args.rel_tol, "seed": args.seed, "workload_stats": stats,
        "num_disagg_candidates": len(disagg), "num_searches": len(tasks), "distserve_claim": DISTSERVE_CLAIM,
        "ablations": {r["ablation"]: {
            "a": r["a_distserve_layout"]["per_gpu"], "b": r["b_best_disagg"]["per_gpu"], "b_placement": r["b_best_disagg"]["placement"],
            "c": r["c_vllm2023"]["per_gpu"], "c_placement": r["c_vllm2023"]["placement"],
            "d": r["d_mixed"]["per_gpu"], "d_placement": r["d_mixed"]["placement"],
            "c1": r["c1_vllm2023_tp1"]["per_gpu"], "b_over_c": r["ratio_b_over_c"], "b_over_d": r["ratio_b_over_d"],
            "a_over_c": r["ratio_a_over_c"], "a_over_c1": r["ratio_a_over_c1"],
        } for r in rows},
    }
    # Why TP1 colocated instances are TTFT-bound with vLLM's step times: the p90 prompt alone, on an idle instance.
    p90 = float(describe(workload_for("sharegpt-multiturn", NUM_GPUS * args.requests_per_gpu, NUM_GPUS * args.requests_per_gpu,
                                      args.seed))["prompt_p90"])
    figures["p90_prompt_tokens"] = p90
    figures["unloaded_ttft_p90_prompt_tp1_s"] = {
        name: round(latency_for(engine, "ours").prefill_time([round(p90)], 1) + overhead, 4)
        for name, engine, overhead in (("distserve", "distserve", 0.0), ("vllm", "vllm", 0.0), ("vllm+6ms", "vllm", VLLM_STEP_OVERHEAD_S))
    }
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    harness.rich_table("disaggregated vs colocated, one assumption at a time (req/s per GPU)",
                       ["ablation", "a", "b", "c", "d", "c1", "b/c", "b/d", "a/c", "a/c1"],
                       [[r["ablation"], *(_f(r[k]["per_gpu"]) for k in ("a_distserve_layout", "b_best_disagg", "c_vllm2023", "d_mixed",
                                                                         "c1_vllm2023_tp1")),
                         _f(r["ratio_b_over_c"]), _f(r["ratio_b_over_d"]), _f(r["ratio_a_over_c"]), _f(r["ratio_a_over_c1"])]
                        for r in rows],
                       width=120, left=("ablation",))
    write_outputs(harness.Outputs.for_run(args, "distserve_ablation"), rows, searches, figures)
    harness.finish(figures)


if __name__ == "__main__":
    main()
