"""How DistServe's evaluation ran each system, for the simulator: its layout and vLLM as colocated ``vllm-2023``, each
under one ``Ablation`` (an assumption changed), and the step-time models of both engines. Shared by
``distserve_table.py`` (the reproduction table) and ``align_real_traces.py`` (the overheads fitted to DistServe's traces)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from distserve.config import SchedulerConfig
from distserve.placement import Placement
from distserve_setting import DISTSERVE_DECODE_LIMITS, DISTSERVE_PREFILL_LIMITS, EVAL_MEM_UTILIZATION, VLLM_A100_PROFILE, VLLM_LIMITS, Row
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
    first_turn: bool = False  # `chatbot` (first-turn prompts) instead of `sharegpt-multiturn`
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
    pp_as_replicas: bool = False  # DistServe's pp > 1 instances as pp instances without stages (the ideal pipeline's throughput)
    short_runs: bool = False  # runs as long as DistServe's (``Row.eval_prompts_per_gpu`` prompts per GPU), goodput averaged over seeds

    @property
    def changes_distserve(self) -> bool:
        return (self.seqs is not None or self.mem_utilization is not None or self.kv_unlimited or self.launch_limits or self.first_turn
                or self.pp_as_replicas or self.distserve_overhead_s > 0 or self.distserve_seq_overhead_s > 0 or self.short_runs)


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
