"""How DistServe's evaluation ran each system, for the simulator: its layout and vLLM as colocated ``vllm-2023``, each
under one ``Ablation`` (an assumption changed), and the step-time models of both engines. Shared by
``distserve_table.py`` (the reproduction table) and ``align_real_traces.py`` (the overheads fitted to DistServe's traces).
The table's ablations are listed here too (``ABLATIONS``), next to what each field of an ``Ablation`` changes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from distserve.config import SchedulerConfig
from distserve.placement import Placement
from distserve_setting import (ALIGNED_OVERHEADS_S, ALIGNED_PREFILL_SCALE, ALIGNED_VLLM_KV_SHARE, DISTSERVE_DECODE_LIMITS,
                               DISTSERVE_PREFILL_LIMITS, EVAL_MEM_UTILIZATION, FITTED_VLLM, VLLM_A100_PROFILE, VLLM_LIMITS,
                               VLLM_RAY_MEASURED_S, VLLM_RAY_SEQ_S, VLLM_RAY_STEP_S, VLLM_STEP_OVERHEAD_S, Row)
from simulator.latency import FittedLatencyModel, LatencyModel
from simulator.simulation import SimConfig
from sweep_systems import latency_model, with_overrides

UNLIMITED_KV_BLOCKS = 1 << 24  # blocks of 16 tokens per instance: no workload here comes near
SHORT_RUN_SEEDS = 10  # seeded runs a ``short_runs`` ablation averages (one of DistServe's short runs is noisy)
RUN_SEP = "#"  # "<ablation>#<seed>": one of a short-runs ablation's runs


@dataclass(frozen=True)
class Ablation:
    name: str
    assumption: str
    seqs: int | None = None  # max_num_seqs of every instance
    mem_utilization: float | None = None
    kv_unlimited: bool = False  # every instance holds any number of KV tokens, as the workers of DistServe's simulator
    launch_limits: bool = False  # DistServe's launch settings: vLLM 1024 seqs / 16384 tokens, prefill 128 / 8192, decode 1024 / 65536, KV at 95%
    chatbot_workload: str | None = None  # the chatbot rows' workload instead of `sharegpt-multiturn` (other rows: not run)
    vllm_engine: bool = False  # the vllm-2023 baseline on vLLM's fitted step times
    vllm_overhead_s: float = 0.0  # per step, vllm-2023 only
    distserve_overhead_s: float = 0.0  # per step, DistServe's layout only
    vllm_seq_overhead_s: float = 0.0  # per sequence in a step, vllm-2023 only
    # vLLM v0.2.3's Ray control plane at TP > 1 (``distserve_setting.VLLM_RAY_STEP_S``): per step / per sequence in a
    # step, each per TP worker of vllm-2023 (none at TP1, where the worker runs in the driver's process)
    vllm_ray_step_s: float = 0.0
    vllm_ray_seq_s: float = 0.0
    distserve_seq_overhead_s: float = 0.0  # per sequence in a step, DistServe's layout only
    vllm_kv_share: float | None = None  # vllm-2023's KV cache: this share of the tokens our memory model gives it
    vllm_padding: bool = False  # vllm-2023's prompt batches padded to the longest prompt (``SimConfig.prefill_padding``)
    # vllm-2023's prompt steps x this on the one row whose vLLM DistServe's real traces measured (OPT-13B at TP1: the
    # ``FITTED_VLLM`` model and TP; ``align_real_traces.py``); other rows' vLLM profile entries have no trace to correct them
    vllm_prefill_scale: float = 1.0
    distserve_prefill_scale: float = 1.0  # DistServe's prompt steps x this (``align_real_traces.py`` fits it as well)
    pp_as_replicas: bool = False  # DistServe's pp > 1 instances as pp instances without stages (the ideal pipeline's throughput)
    short_runs: bool = False  # runs as long as DistServe's (``Row.eval_prompts_per_gpu`` prompts per GPU), goodput averaged over seeds

    @property
    def changes_distserve(self) -> bool:
        return (self.seqs is not None or self.mem_utilization is not None or self.kv_unlimited or self.launch_limits or self.chatbot_workload is not None
                or self.pp_as_replicas or self.distserve_overhead_s > 0 or self.distserve_seq_overhead_s > 0 or self.short_runs
                or self.distserve_prefill_scale != 1.0)


def runs_of(a: Ablation, row: Row, common: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(run name, Job fields) of each goodput search an ablation makes per system: one at ``common``'s size, or (``short_runs``)
    ``SHORT_RUN_SEEDS`` of DistServe's run length (``row.eval_prompts_per_gpu``), seeded ``common["seed"]`` onwards."""
    if not a.short_runs:
        return [(a.name, common)]
    return [(f"{a.name}{RUN_SEP}{i}", {**common, "requests_per_gpu": row.eval_prompts_per_gpu, "seed": common["seed"] + i})
            for i in range(SHORT_RUN_SEEDS)]


def mean_or_none(xs: list[float | None]) -> float | None:
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)  # type: ignore[arg-type,misc]


_LATENCY: dict[tuple[str, str], tuple[LatencyModel, str | None]] = {}


def row_latency(model: str, engine: str = "distserve") -> tuple[LatencyModel, str | None]:
    """(step-time model, its profile file or None for the roofline): DistServe's where it covers the model; vLLM's fitted ones."""
    key = (model, engine)
    if key not in _LATENCY:
        if engine == "vllm":
            _LATENCY[key] = FittedLatencyModel.from_profile(VLLM_A100_PROFILE, model=model), str(VLLM_A100_PROFILE)
        else:
            _LATENCY[key] = latency_model(argparse.Namespace(profile="auto", model=model, hardware=None))
    return _LATENCY[key]


def has_vllm_fit(model: str) -> bool:
    import json

    return model in json.loads(VLLM_A100_PROFILE.read_text())


def distserve_config(a: Ablation) -> SimConfig:
    cfg = SimConfig()
    if a.launch_limits:
        cfg = replace(cfg, prefill_scheduler=SchedulerConfig(*DISTSERVE_PREFILL_LIMITS), decode_scheduler=SchedulerConfig(*DISTSERVE_DECODE_LIMITS),
                      mem_utilization=EVAL_MEM_UTILIZATION)
    if a.seqs is not None:
        cfg = with_overrides(cfg, [f"max_num_seqs={a.seqs}"])
    if a.mem_utilization is not None:
        cfg = replace(cfg, mem_utilization=a.mem_utilization)
    cfg = replace(cfg, step_overhead_s=a.distserve_overhead_s, seq_overhead_s=a.distserve_seq_overhead_s)
    if a.distserve_prefill_scale != 1.0:
        cfg = replace(cfg, prefill_time_scale=a.distserve_prefill_scale)
    return replace(cfg, num_blocks=UNLIMITED_KV_BLOCKS) if a.kv_unlimited else cfg


def vllm_config(a: Ablation, row: Row, ratios: tuple[float, float]) -> tuple[SimConfig, str]:
    """(config, engine) of the vllm-2023 baseline under an ablation."""
    cfg = SimConfig(scheduler=SchedulerConfig(step_policy="vllm-2023"))
    if a.launch_limits:
        cfg = replace(cfg, scheduler=SchedulerConfig(*VLLM_LIMITS, step_policy="vllm-2023"), mem_utilization=EVAL_MEM_UTILIZATION)
    if a.seqs is not None:
        cfg = with_overrides(cfg, [f"colocated.max_num_seqs={a.seqs}"])
    if a.mem_utilization is not None:
        cfg = replace(cfg, mem_utilization=a.mem_utilization)
    if a.kv_unlimited:
        cfg = replace(cfg, num_blocks=UNLIMITED_KV_BLOCKS)
    engine = "distserve"
    if a.vllm_engine:
        if has_vllm_fit(row.model):
            engine = "vllm"
            if (row.model, row.vllm_tp) == FITTED_VLLM and a.vllm_prefill_scale != 1.0:
                cfg = replace(cfg, prefill_time_scale=a.vllm_prefill_scale)
        else:
            cfg = replace(cfg, prefill_time_scale=ratios[0], step_time_scale=ratios[1])
    if a.vllm_kv_share is not None:
        tokens = row_latency(row.model, engine)[0].max_kv_tokens(row.vllm_tp, 1, cfg.mem_utilization)
        cfg = replace(cfg, num_blocks=max(1, int(tokens * a.vllm_kv_share) // cfg.block_size))
    ray_workers = row.vllm_tp if row.vllm_tp > 1 else 0
    return replace(cfg, step_overhead_s=a.vllm_overhead_s + ray_workers * a.vllm_ray_step_s,
                   seq_overhead_s=a.vllm_seq_overhead_s + ray_workers * a.vllm_ray_seq_s, prefill_padding=a.vllm_padding), engine


def distserve_placement(a: Ablation, row: Row, config: SimConfig) -> tuple[Placement, SimConfig]:
    """DistServe's layout under an ablation: one prefill + one decode instance, or (``pp_as_replicas``) pp of each
    without stages, every instance holding the KV of the smaller of the two per-replica shares."""
    tp_p, pp_p, tp_d, pp_d = row.layout
    if not a.pp_as_replicas:
        return Placement.disaggregated(1, 1, tp_p, pp_p, tp_d, pp_d), config
    latency, _ = row_latency(row.model)
    tokens = min(latency.max_kv_tokens(tp, pp, config.mem_utilization) // pp for tp, pp in ((tp_p, pp_p), (tp_d, pp_d)))
    return Placement.disaggregated(pp_p, pp_d, tp_p, 1, tp_d, 1), replace(config, num_blocks=tokens // config.block_size)


# ---- the ablations: one assumption changed at a time --------------------------------------------------
ABLATIONS = [
    Ablation("baseline", "our defaults: max_num_seqs 64, 2048 tokens per step, KV at 90% of HBM, DistServe's step times for both"),
    Ablation("seqs-1024", "sequence cap 1024 on every instance (DistServe's decode cap and vLLM's --max-num-seqs; ours 64)", seqs=1024),
    Ablation("kv-95", "KV at 95% of HBM on every instance (both launches' --gpu-memory-utilization; ours 90%)", mem_utilization=0.95),
    Ablation("kv-unlimited", "no KV capacity limit on any instance (with sequence cap 1024), as the workers of DistServe's simulator "
             "(simdistserve/base/worker.py batches every queued decode; no memory model there)", seqs=1024, kv_unlimited=True),
    Ablation("launch-limits", "DistServe's launch settings: vLLM 1024 seqs / 16384 tokens per step; DistServe prefill 128 / 8192, "
             "decode 1024 / 65536; KV at 95%", launch_limits=True),
    Ablation("first-turn", "first-turn ShareGPT prompts (`chatbot`, mean ~228 tokens) instead of DistServe's multi-turn preparation",
             chatbot_workload="chatbot"),
    Ablation("pp-as-replicas", "each of DistServe's pp > 1 instances replaced by pp instances of its TP without pipeline stages, "
             "each with 1/pp of its KV: the throughput of a perfect pipeline (same GPUs, same latency per batch)", pp_as_replicas=True),
    Ablation("vllm-steps", "vllm-2023 on vLLM's fitted step times (DistServe's profiler-a100-80g.vllm.json; OPT-175B: OPT-66B TP4's "
             "vLLM/DistServe ratios on the roofline)", vllm_engine=True),
    Ablation("vllm-steps+6ms", f"vllm-steps plus {VLLM_STEP_OVERHEAD_S * 1000:.0f} ms per vLLM step (DistServe's real vLLM traces)",
             vllm_engine=True, vllm_overhead_s=VLLM_STEP_OVERHEAD_S),
    Ablation("distserve-sim", "kv-unlimited + vllm-steps: what DistServe's own simulator assumes (its vLLM profile for vLLM, no KV limit)",
             seqs=1024, kv_unlimited=True, vllm_engine=True),
    Ablation("as-evaluated", "launch-limits + vllm-steps+6ms: the closest we model DistServe's real comparison", launch_limits=True,
             vllm_engine=True, vllm_overhead_s=VLLM_STEP_OVERHEAD_S),
    Ablation("aligned", "both engines as DistServe's real OPT-13B traces show them (`align_real_traces.py`): launch limits; vllm-2023 on "
             f"vLLM's step times (OPT-13B TP1's prompt steps x{ALIGNED_PREFILL_SCALE['vllm']:g}) + {ALIGNED_OVERHEADS_S['vllm'][0] * 1e3:g} ms "
             f"per step + {ALIGNED_OVERHEADS_S['vllm'][1] * 1e3:g} ms per "
             f"sequence, its KV cache {ALIGNED_VLLM_KV_SHARE:g} of our memory model's; DistServe's layout + "
             f"{ALIGNED_OVERHEADS_S['distserve'][0] * 1e3:g} ms per step + {ALIGNED_OVERHEADS_S['distserve'][1] * 1e3:g} ms per sequence",
             launch_limits=True, vllm_engine=True, vllm_overhead_s=ALIGNED_OVERHEADS_S["vllm"][0],
             vllm_seq_overhead_s=ALIGNED_OVERHEADS_S["vllm"][1], vllm_kv_share=ALIGNED_VLLM_KV_SHARE,
             distserve_overhead_s=ALIGNED_OVERHEADS_S["distserve"][0], distserve_seq_overhead_s=ALIGNED_OVERHEADS_S["distserve"][1],
             vllm_prefill_scale=ALIGNED_PREFILL_SCALE["vllm"], distserve_prefill_scale=ALIGNED_PREFILL_SCALE["distserve"]),
]
ALIGNED = ABLATIONS[-1]
# vLLM before 0.4 computed a step's prompts as one [prompts x longest prompt] tensor (``SimConfig.prefill_padding``):
# a batch of mixed lengths costs that many copies of its longest. Neither fitted step times (from batches of one
# length) nor DistServe's simulator model it.
ABLATIONS += [
    Ablation("vllm-padded", "vllm-steps with vLLM's prompt batches padded to the longest prompt (before 0.4 its model runner "
             "made [prompts x longest] input tensors: `_prepare_prompt`)", vllm_engine=True, vllm_padding=True),
    replace(ALIGNED, name="aligned+padded", vllm_padding=True,
            assumption="aligned, vllm-2023's prompt batches padded to the longest prompt (the overheads as fitted without)"),
]
# DistServe measured each rate with one short run (``Row.eval_prompts_per_gpu``: 25-100 prompts per GPU): a system whose
# queue grows slowly (TTFT-bound under a loose TTFT SLO) reads a higher goodput than in steady state. One short run is
# noisy, so these ablations average the goodput over ``SHORT_RUN_SEEDS`` seeded streams (``runs_of``).
ABLATIONS += [
    Ablation("short-runs", "runs as long as DistServe's (its figures' 25-100 prompts per GPU per rate, `_plot.py`; ours 300), "
             f"goodput the mean of {SHORT_RUN_SEEDS} seeds", short_runs=True),
    replace(ALIGNED, name="aligned+short-runs", assumption="aligned, with runs as long as DistServe's", short_runs=True),
]
# DistServe's vLLM (v0.2.3) drove each TP worker by a Ray call per step, a cost its TP1 traces cannot show
# (``fit_ray_control_plane.py``: fitted to vLLM PR #2221's before/after throughputs of LLaMA-70B at TP8).
ABLATIONS += [
    replace(ALIGNED, name="aligned+ray", vllm_ray_step_s=VLLM_RAY_STEP_S,
            assumption=f"aligned, and vllm-2023 at TP > 1 pays v0.2.3's Ray control plane: {VLLM_RAY_STEP_S * 1e3:g} ms per step per "
                       "TP worker (fitted to vLLM PR #2221's LLaMA-70B TP8 throughputs before/after it removed that; `fit_ray_control_plane.py`)"),
    replace(ALIGNED, name="aligned+ray-per-seq", vllm_ray_seq_s=VLLM_RAY_SEQ_S,
            assumption=f"aligned+ray in the form the PR's second benchmark fits less well: {VLLM_RAY_SEQ_S * 1e3:g} ms per sequence "
                       "in the step per TP worker"),
    replace(ALIGNED, name="aligned+ray+short-runs", vllm_ray_step_s=VLLM_RAY_STEP_S, short_runs=True,
            assumption="aligned+ray, with runs as long as DistServe's"),
    replace(ALIGNED, name="aligned+ray-measured", vllm_ray_step_s=VLLM_RAY_MEASURED_S[0], vllm_ray_seq_s=VLLM_RAY_MEASURED_S[1],
            assumption=f"aligned+ray in the shape `bench_ray_step_calls.py` measured with real Ray actors, scaled to the PR: "
                       f"{VLLM_RAY_MEASURED_S[0] * 1e3:g} ms per step + {VLLM_RAY_MEASURED_S[1] * 1e3:g} ms per sequence, per TP worker"),
]
# DistServe's own requests: its real runs' traces record 300 of its prepared ShareGPT requests (``sharegpt-distserve``),
# with longer prompts than ``sharegpt-multiturn`` rebuilds from published statistics (mean 780 vs 649, p90 1,512 vs 1,394).
ABLATIONS += [
    Ablation("distserve-prompts", "the chatbot rows on DistServe's own requests (`sharegpt-distserve`: the 300 its real OPT-13B runs "
             "served, resampled) instead of `sharegpt-multiturn`", chatbot_workload="sharegpt-distserve"),
    replace(ALIGNED, name="aligned+distserve-prompts", chatbot_workload="sharegpt-distserve",
            assumption="aligned, the chatbot rows on DistServe's own requests"),
    replace(ALIGNED, name="aligned+ray+distserve-prompts+short-runs", vllm_ray_step_s=VLLM_RAY_STEP_S, short_runs=True,
            chatbot_workload="sharegpt-distserve", assumption="aligned+ray+short-runs, the chatbot rows on DistServe's own requests"),
]
