"""`distserve profile`: time the real engine's steps on this machine and fit the simulator's latency model.

Every sample is one ``ModelRunner.execute(plan)`` on a ``StepPlan`` built by the real schedulers
over a real ``BlockManager``, i.e. what a serving worker runs:

* prefill: a ``PrefillScheduler`` batches ``b`` fresh random prompts of ``L`` tokens into one step;
* decode: a source prompt of the target context is prefilled once, then a ``DecodeScheduler``
  reserves ``b`` requests and receives the source's KV by block copy (as a migration would fill
  it), and single-token decode steps of the batch are timed.

The recorded wall time of a point is the median of ``repeats`` steps after one warm-up step.
Tensor parallelism runs ``tp`` spawned processes over gloo, each executing the same plans (the
schedulers are deterministic), timed on rank 0. Pipeline parallelism is not profiled: the simulator
derives pp from the tp profile. Fitting is ``simulator.latency.build_profile``'s job.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import queue
import random
import socket
import statistics
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from distserve.config import ModelConfig, SamplingParams, SchedulerConfig
from distserve.decode.scheduler import DecodeScheduler
from distserve.engine.block_manager import BlockManager
from distserve.engine.model import resolve_dtype
from distserve.engine.model_runner import ModelRunner
from distserve.engine.parallel import ParallelState, ShardSpec, build_parallel_state
from distserve.engine.scheduler import SampledToken, StepPlan
from distserve.engine.sequence import Sequence
from distserve.engine.weights import LoadedModel, load_model, resolve_model_dir
from distserve.errors import InvalidConfigError
from distserve.prefill.scheduler import PrefillScheduler

HARDWARE = "cpu"
_SEED = 0
_WORKER_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ProfileGrid:
    """The points measured: prefill ``batch × prompt length`` and decode ``batch × context length``."""

    prefill_batch_sizes: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    decode_batch_sizes: tuple[int, ...]
    decode_ctx_lens: tuple[int, ...]
    max_prefill_tokens: int  # tokens per prefill step (the prefill scheduler's budget)
    max_decode_kv_tokens: int  # context tokens held by one decode batch (bounds KV memory)

    def prefill_points(self, max_model_len: int) -> list[tuple[int, int]]:
        """(batch, prompt length) pairs; lengths are clamped to what the context admits."""
        lens = sorted({min(n, max_model_len - 1) for n in self.prefill_lens})
        return [(b, n) for b in self.prefill_batch_sizes for n in lens if b * n <= self.max_prefill_tokens]

    def decode_points(self, max_model_len: int, num_steps: int) -> list[tuple[int, int]]:
        """(batch, context length) pairs, context-major: one source prefill serves a whole row."""
        lens = sorted({min(c, max_model_len - num_steps - 1) for c in self.decode_ctx_lens})
        return [(b, c) for c in lens for b in self.decode_batch_sizes if b * c <= self.max_decode_kv_tokens]


FULL_GRID = ProfileGrid(
    prefill_batch_sizes=(1, 2, 4),
    prefill_lens=(16, 32, 64, 128, 256, 512, 1024),
    decode_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
    decode_ctx_lens=(32, 64, 128, 256, 512, 1024),
    max_prefill_tokens=2048,
    max_decode_kv_tokens=32768,
)
QUICK_GRID = ProfileGrid(
    prefill_batch_sizes=(1, 2),
    prefill_lens=(16, 64, 256, 512),
    decode_batch_sizes=(1, 4, 16, 32),
    decode_ctx_lens=(32, 128, 512),
    max_prefill_tokens=1024,
    max_decode_kv_tokens=16384,
)


@dataclass(frozen=True)
class _Job:
    """What one measuring process needs; plain data so it crosses the spawn boundary."""

    model: str
    dtype: str
    tp: int
    threads: int
    repeats: int
    block_size: int
    grid: ProfileGrid


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


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise InvalidConfigError(f"{name} must be >= 1, got {value}")


# ---- measuring ---------------------------------------------------------------------------------
class _StepTimer:
    """Runs plans on one rank: all ranks start a step together, rank 0's wall time is the sample."""

    def __init__(self, runner: ModelRunner, parallel: ParallelState) -> None:
        self.runner = runner
        self.distributed = parallel.shard.tp > 1

    def run(self, plan: StepPlan) -> tuple[float, list[SampledToken]]:
        if self.distributed:
            dist.barrier()
        t0 = time.perf_counter()
        sampled = self.runner.execute(plan)
        seconds = time.perf_counter() - t0
        if self.distributed:
            box = [sampled]
            dist.broadcast_object_list(box, src=0)  # the driver's tokens keep every rank's scheduler in step
            sampled = box[0]
        return seconds, sampled


def _median_sample(times: list[float], lens: list[list[int]]) -> tuple[float, list[int]]:
    """The median step (lower median for even counts) and the lengths it ran with."""
    order = sorted(range(len(times)), key=times.__getitem__)
    i = order[(len(order) - 1) // 2]
    return times[i], lens[i]


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _num_blocks_needed(job: _Job, max_model_len: int) -> int:
    bs = job.block_size
    steps = job.repeats + 1
    prefill = max((b * -(-(n + 1) // bs) for b, n in job.grid.prefill_points(max_model_len)), default=0)
    decode = max(
        (b * -(-(c + steps + 1) // bs) + -(-(c + 1) // bs) for b, c in job.grid.decode_points(max_model_len, steps)),
        default=0,
    )
    return max(prefill, decode) + 8


def _measure(job: _Job, loaded: LoadedModel, parallel: ParallelState) -> dict[str, list[dict[str, Any]]]:
    """Every grid point of ``job`` on this rank; the samples are meaningful on rank 0."""
    config = loaded.config
    max_model_len = config.max_position_embeddings
    num_blocks = _num_blocks_needed(job, max_model_len)
    runner = ModelRunner(config, loaded.state_dict, num_blocks, job.block_size, parallel=parallel)
    timer = _StepTimer(runner, parallel)
    bm = BlockManager(num_blocks, job.block_size)
    rng = random.Random(_SEED)  # the same draws on every rank, so every rank builds the same plans
    sampling = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)
    grid = job.grid
    steps = job.repeats + 1  # the first is the warm-up
    max_seqs = max(grid.prefill_batch_sizes + grid.decode_batch_sizes)
    sched_config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=max(grid.max_prefill_tokens, max_seqs), max_model_len=max_model_len
    )
    prefill_sched = PrefillScheduler(sched_config, bm, max_model_len)
    decode_sched = DecodeScheduler(sched_config, bm, max_model_len)
    seqs: dict[str, Sequence] = {}
    counter = iter(range(1 << 62))

    def new_seq(num_tokens: int) -> Sequence:
        seq = Sequence(f"p{next(counter)}", _random_tokens(rng, num_tokens, config.vocab_size), sampling)
        seqs[seq.seq_id] = seq
        return seq

    def prefill(batch: list[Sequence]) -> float:
        """One step prefilling ``batch`` whole; the sequences then await migration."""
        for seq in batch:
            prefill_sched.add(seq)
        plan = prefill_sched.schedule()
        assert [c.num_tokens for c in plan.chunks] == [s.num_prompt_tokens for s in batch], "grid exceeds the budget"
        seconds, sampled = timer.run(plan)
        prefill_sched.update_from_output(plan, sampled, seqs, 0.0)
        return seconds

    def release(batch: list[Sequence], finish: Callable[[Sequence], None]) -> None:
        for seq in batch:
            finish(seq)
            seqs.pop(seq.seq_id, None)

    prefill_samples: list[dict[str, Any]] = []
    for b, n in grid.prefill_points(max_model_len):
        times: list[float] = []
        for step in range(steps):
            batch = [new_seq(n) for _ in range(b)]
            seconds = prefill(batch)
            release(batch, lambda s: prefill_sched.release(s.seq_id))
            if step:
                times.append(seconds)
        prefill_samples.append({"lens": [n] * b, "seconds": statistics.median(times)})

    decode_samples: list[dict[str, Any]] = []
    source: Sequence | None = None
    for b, c in grid.decode_points(max_model_len, steps):
        # The first timed step attends to ``c`` tokens: a prompt of c - 1 plus its first token.
        if source is None or source.num_prompt_tokens != c - 1:
            if source is not None:
                release([source], lambda s: prefill_sched.release(s.seq_id))
            source = new_seq(c - 1)
            prefill([source])
        batch = [new_seq(c - 1) for _ in range(b)]
        for seq in batch:
            seq.token_ids.append(rng.randrange(config.vocab_size))  # the first token, sampled "elsewhere"
            reservation = decode_sched.reserve(seq)
            assert reservation is not None, "KV cache sized too small for the grid"
            lo, hi = reservation.num_reused_blocks, reservation.num_blocks_to_fill
            runner.copy_blocks(list(zip(source.block_table[lo:hi], reservation.block_table[lo:hi])))
            decode_sched.complete(seq.seq_id)
        times, ctx_lens = [], []
        for step in range(steps):
            plan = decode_sched.schedule()
            assert len(plan.chunks) == b and all(ch.is_decode for ch in plan.chunks)
            seconds, sampled = timer.run(plan)
            decode_sched.update_from_output(plan, sampled, seqs, 0.0)
            if step:
                times.append(seconds)
                ctx_lens.append([ch.start_pos + 1 for ch in plan.chunks])
        seconds, lens = _median_sample(times, ctx_lens)
        decode_samples.append({"ctx_lens": lens, "seconds": seconds})
        release(batch, lambda s: decode_sched.finish(s, "abort"))
    return {"prefill": prefill_samples, "decode": decode_samples}


def _measure_in_process(job: _Job) -> dict[str, list[dict[str, Any]]]:
    previous = torch.get_num_threads()
    torch.set_num_threads(job.threads)
    try:
        return _measure(job, load_model(job.model, job.dtype), ParallelState(ShardSpec()))
    finally:
        torch.set_num_threads(previous)


def _tp_worker(rank: int, job: _Job, port: int, results: Any) -> None:
    """One TP rank (spawned): join gloo, measure, rank 0 reports its samples."""
    os.environ["OMP_NUM_THREADS"] = str(job.threads)
    torch.set_num_threads(job.threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=job.tp)
        try:
            shard = ShardSpec(tp=job.tp, tp_rank=rank)
            samples = _measure(job, load_model(job.model, job.dtype), build_parallel_state(shard, list(range(job.tp))))
            dist.barrier()
        finally:
            dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", samples))
    except BaseException as exc:  # reported to the parent, which raises it
        results.put(("error", f"rank {rank}: {exc!r}"))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _measure_tp(job: _Job) -> dict[str, list[dict[str, Any]]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, job, port, results), daemon=True) for r in range(job.tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + _WORKER_TIMEOUT_S
    try:
        while True:
            try:
                status, payload = results.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"tp={job.tp} profiling worker failed (exit codes {[p.exitcode for p in procs]})")
        if status != "ok":
            raise RuntimeError(f"tp={job.tp} profiling worker failed: {payload}")
        for p in procs:
            p.join(timeout=60)
        return payload
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)


# ---- the profile --------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_engine(
    model: str,
    tps: Seq[int] = (1,),
    dtype: str = "float32",
    threads: int = 1,
    quick: bool = False,
    repeats: int = 3,
    block_size: int = 16,
) -> dict[str, Any]:
    """Measure prefill and decode step times for each tp degree and fit them (``build_profile``).

    ``threads`` is torch's intra-op thread count per rank (the Ray runtime's workers use 1). tp = 1
    runs in this process; tp > 1 spawns tp processes (so a calling script needs a ``__main__`` guard).
    Raises ``ModelNotFoundError`` for an unknown model and ``InvalidConfigError`` for a tp that
    does not split the model or a non-positive count.
    """
    from simulator.latency import build_profile

    _check_positive(threads=threads, repeats=repeats, block_size=block_size)
    resolved = resolve_dtype(dtype)
    config = model_config(model, resolved)
    tps = check_tps(config, tps)
    grid = QUICK_GRID if quick else FULL_GRID
    samples_by_tp: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for tp in tps:
        job = _Job(model, resolved, tp, threads, repeats, block_size, grid)
        samples_by_tp[tp] = _measure_in_process(job) if tp == 1 else _measure_tp(job)
    meta = {
        "dtype": resolved,
        "threads": threads,
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "num_cpus": os.cpu_count(),
        "block_size": block_size,
        "repeats": repeats,
        "quick": quick,
        "grid": asdict(grid),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profile_seconds": round(time.perf_counter() - t0, 1),
        "note": "pp is not profiled; the simulator models pp from the tp profile",
        "architecture": _architecture(config),
    }
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
        "dtype_bytes": 4 if config.dtype == "float32" else 2,
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
