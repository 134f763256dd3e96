"""`distserve profile`: time the real engine's steps on this machine and fit the simulator's latency model.

This module is the entry point (``profile_engine``, ``write_profile``, the CLI's validation) and
the profile's ``meta``; the parts live next to it:

* ``distserve.measure.step_times``: the grid and the measurement, a driver over ``InstanceCore``
  (prefill and decode instances over one runner), in this process or on ``tp`` spawned ranks;
* ``distserve.measure.machine``: CPU accounting and the quiet-machine guard;
* ``distserve.measure.contention``: the slowdown next to a busy worker (``--concurrency``).

Pipeline parallelism is not profiled: the simulator derives pp from the tp profile. Fitting is
``simulator.fitting.build_profile``'s job.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import time
from collections.abc import Sequence as Seq
from dataclasses import asdict
from typing import Any

import torch

from distserve.config import ModelConfig
from distserve.dtypes import DTYPE_BYTES, resolve_dtype
from distserve.engine.shard import ShardSpec
from distserve.engine.weights import load_model, resolve_model_dir
from distserve.errors import InvalidConfigError
from distserve.measure.contention import measure_concurrent_slowdown
from distserve.measure.machine import cpu_jiffies, cpu_model, steal_fraction
from distserve.measure.step_times import (
    FULL_GRID,
    QUICK_GRID,
    MeasureJob,
    ProfileGrid,
    check_positive,
    measure_in_process,
    measure_tp,
)
from kernels.backends import default_decode_attention, get_decode_attention

HARDWARE = "cpu"


# ---- validation ----------------------------------------------------------------------------------
def model_config(model: str, dtype: str = "float32") -> ModelConfig:
    """The model's config without its weights; ``ModelNotFoundError`` if it is unknown."""
    return load_model(model, resolve_dtype(dtype), weights=False).config


def check_tps(config: ModelConfig, tps: Seq[int]) -> list[int]:
    """Sorted distinct tp degrees; ``InvalidConfigError`` if one is < 1 or does not split the model."""
    if not tps:
        raise InvalidConfigError("at least one tp degree is needed")
    for tp in tps:
        if tp < 1:
            raise InvalidConfigError(f"tp must be >= 1, got {tp}")
        ShardSpec(tp=tp).validate(config)
    return sorted(set(tps))


# ---- the profile --------------------------------------------------------------------------------
def profile_engine(
    model: str,
    tps: Seq[int] = (1,),
    dtype: str = "float32",
    threads: int = 1,
    quick: bool = False,
    repeats: int = 3,
    block_size: int = 16,
    quiet: bool = False,
    concurrency: bool = False,
    max_quiet_wait_s: float = 600.0,
) -> dict[str, Any]:
    """Measure prefill and decode step times for each tp degree and fit them (``build_profile``).

    ``threads`` is torch's intra-op thread count per rank (the Ray runtime's workers use 1). tp = 1
    runs in this process; tp > 1 spawns tp processes (so a calling script needs a ``__main__`` guard).
    ``quiet`` (tp = 1) times a step again, after waiting, when other processes used the CPU
    meanwhile (``meta.quiet_guard`` counts them; the waits take ``max_quiet_wait_s`` in all at most).
    ``concurrency`` also measures how much a step slows down while another worker computes
    (``measure_concurrent_slowdown``, spawns one; ``meta.concurrent_slowdown``). Every profile
    records ``meta.prefill_first_use_extra_s``: the median extra time of the first step of a new
    prefill shape (not in the fit, which times warm shapes).
    Raises ``ModelNotFoundError`` for an unknown model and ``InvalidConfigError`` for a tp that
    does not split the model or a non-positive count.
    """
    from simulator.fitting import build_profile

    check_positive(threads=threads, repeats=repeats, block_size=block_size)
    resolved = resolve_dtype(dtype)
    config = model_config(model, resolved)
    tps = check_tps(config, tps)
    grid = QUICK_GRID if quick else FULL_GRID
    samples_by_tp: dict[int, dict[str, Any]] = {}
    decode_attention = default_decode_attention("cpu")  # what ModelRunner runs by default here
    t0 = time.perf_counter()
    jiffies0 = cpu_jiffies()
    for tp in tps:
        job = MeasureJob(model, resolved, tp, threads, repeats, block_size, grid, decode_attention,
                         quiet=quiet, max_quiet_wait_s=max_quiet_wait_s)
        samples_by_tp[tp] = measure_in_process(job) if tp == 1 else measure_tp(job)
    extras = {tp: {k: v for k, v in samples.items() if k not in ("prefill", "decode")} for tp, samples in samples_by_tp.items()}
    concurrent = measure_concurrent_slowdown(model, resolved, threads, quiet=quiet, max_quiet_wait_s=max_quiet_wait_s) if concurrency else None
    meta = {
        "dtype": resolved,
        "threads": threads,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "num_cpus": os.cpu_count(),
        "block_size": block_size,
        "repeats": repeats,
        "quick": quick,
        "grid": asdict(grid),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profile_seconds": round(time.perf_counter() - t0, 1),
        # Share of the CPU time the hypervisor gave to others while profiling (a VM's noise).
        "cpu_steal_fraction": steal_fraction(jiffies0, cpu_jiffies()),
        "note": "pp is not profiled; the simulator models pp from the tp profile",
        # What the profiled decode-attention backend reads, as FittedLatencyModel charges it: "sum"
        # (Σctx) or "padded" (batch x max ctx, kernels.decode_attention's padded backend).
        "decode_attention": get_decode_attention(decode_attention).kv_read,
        "decode_attention_backend": decode_attention,
        "prefill_first_use_extra_s": {str(tp): e.get("prefill_first_use_extra_s") for tp, e in extras.items()},
        "architecture": _architecture(config),
    }
    if quiet:
        meta["quiet_guard"] = {str(tp): e.get("quiet_guard") for tp, e in extras.items()}
    if concurrent is not None:
        meta["concurrent_slowdown"] = concurrent
    return build_profile(_simulator_model_name(model, config), HARDWARE, samples_by_tp, meta=meta)


def _architecture(config: ModelConfig) -> dict[str, Any]:
    """The ``simulator.models.ModelSpec`` fields of the profiled model at the profiled dtype."""
    return {
        "name": config.name,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "gated_mlp": True,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "dtype_bytes": DTYPE_BYTES[config.dtype],
    }


def _simulator_model_name(model: str, config: ModelConfig) -> str:
    """A name the simulator resolves to the architecture: a known id, else the folder with config.json."""
    from simulator.models import known_model

    if known_model(model) is not None:
        return model
    folder = resolve_model_dir(model)
    return folder if folder is not None else config.name


def write_profile(profile: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``profile`` as JSON; ``InvalidConfigError`` if the folder does not exist."""
    out = pathlib.Path(path)
    if not out.parent.is_dir():
        raise InvalidConfigError(f"cannot write {out}: directory {out.parent} does not exist")
    if out.is_dir():
        raise InvalidConfigError(f"cannot write {out}: it is a directory")
    out.write_text(json.dumps(profile, indent=2) + "\n")


__all__ = ["FULL_GRID", "HARDWARE", "QUICK_GRID", "ProfileGrid", "check_tps", "cpu_jiffies", "measure_concurrent_slowdown",
           "model_config", "profile_engine", "write_profile"]
