"""Timing the real engine's steps at a profile's grid points: a driver over ``InstanceCore``.

Every sample is one ``ModelRunner.execute(plan)`` of a ``StepPlan`` that an ``InstanceCore`` (the
real schedulers over a real ``BlockManager``) launched, i.e. what a serving worker runs:

* prefill: a prefill instance batches ``b`` fresh random prompts of ``L`` tokens into one step;
* decode: a source prompt of the target context is prefilled once, then a decode instance per
  batch size reserves ``b`` requests and receives the source's KV by block copy (as a migration
  would fill it), and single-token decode steps of the batch are timed.

The profiled instances share one runner, so each owns a range of its KV cache's blocks
(``ProfiledInstance.base``); block ids in a plan are shifted by it before the runner sees them.

The recorded wall time of a point is the median of ``repeats`` steps after one warm-up step. The
points are measured round-robin, not one after the other: every round runs one step of each
prefill point (of each batch size of a decode context), in alternating order. This machine's speed
drifts while a profile runs (other processes, the hypervisor: a 256-token prefill took 188 ms in
one profile and 312 ms an hour later); measured point by point, a drift lands on whichever points
happened to run then. A SmolLM2 profile measured that way had every 2- and 4-prompt batch 30-90%
slower than one prompt of the same total length, which alternated measurements do not show
(2 x 256 tokens 5% *faster* than 1 x 512, 2 x 512 13% faster than 1 x 1024), and its fit
over-predicted single prompts by 40-50%. With ``quiet`` a step is timed again when other processes
used the CPU meanwhile. Tensor parallelism runs ``tp`` spawned processes over gloo, each executing
the same plans (the instances are deterministic), timed on rank 0.
"""

from __future__ import annotations

import os
import queue
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from distserve.config import SamplingParams, SchedulerConfig
from distserve.engine.instance_core import InstanceCore
from distserve.engine.model_runner import ModelRunner
from distserve.engine.parallel import ParallelState, build_parallel_state
from distserve.engine.shard import ShardSpec
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence
from distserve.engine.weights import load_weights
from distserve.errors import InvalidConfigError
from distserve.measure.machine import QUIET_MAX_OTHER_CORES, QUIET_RETRIES, QuietGuard

SEED = 0
WORKER_TIMEOUT_S = 3600.0


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

    def decode_rows(self, max_model_len: int, num_steps: int) -> dict[int, list[int]]:
        """Decode batch sizes per context length (context-major, as ``decode_points``)."""
        rows: dict[int, list[int]] = {}
        for b, c in self.decode_points(max_model_len, num_steps):
            rows.setdefault(c, []).append(b)
        return rows


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
class MeasureJob:
    """What one measuring process needs; plain data so it crosses the spawn boundary."""

    model: str
    dtype: str
    tp: int
    threads: int
    repeats: int
    block_size: int
    grid: ProfileGrid
    decode_attention: str  # the kernels.decode_attention backend the runner uses
    quiet: bool = False
    max_quiet_wait_s: float = 600.0


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise InvalidConfigError(f"{name} must be >= 1, got {value}")


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


# ---- the driver ----------------------------------------------------------------------------------
class StepTimer:
    """Runs plans on one rank: all ranks start a step together, rank 0's wall time is the sample.

    With a ``QuietGuard`` (one rank only) a step during which other processes used the CPU is run
    again after they stop: executing a plan twice recomputes the same KV, so it is harmless.
    """

    def __init__(self, runner: ModelRunner, parallel: ParallelState, guard: QuietGuard | None = None) -> None:
        self.runner = runner
        self.distributed = parallel.shard.tp > 1
        self.guard = None if self.distributed else guard

    def run(self, plan: StepPlan) -> tuple[float, list[SampledToken]]:
        if self.distributed:
            dist.barrier()
        if self.guard is None:
            t0 = time.perf_counter()
            sampled = self.runner.execute(plan)
            seconds = time.perf_counter() - t0
        else:
            box: list[list[SampledToken]] = []
            seconds = self.guard.timed(lambda: box.append(self.runner.execute(plan)))
            sampled = box[-1]
        if self.distributed:
            box = [sampled]
            dist.broadcast_object_list(box, src=0)  # the driver's tokens keep every rank's scheduler in step
            sampled = box[0]
        return seconds, sampled


@dataclass
class ProfiledInstance:
    """An ``InstanceCore`` whose blocks are ``base ..`` of the shared runner's KV cache."""

    core: InstanceCore
    base: int

    def block_ids(self, table: list[int]) -> list[int]:
        """``table`` as the runner's block ids."""
        return [b + self.base for b in table]

    def step(self, timer: StepTimer) -> tuple[float, StepPlan]:
        """Launch, time and apply one plan: (seconds, the plan)."""
        launched = self.core.launch()
        assert launched is not None, "nothing to profile"
        plan = launched.plan
        seconds, sampled = timer.run(self._on_runner(plan))
        self.core.observe(plan, seconds)
        self.core.apply_oldest(sampled, 0.0)
        return seconds, plan

    def _on_runner(self, plan: StepPlan) -> StepPlan:
        if not self.base:
            return plan
        return StepPlan(
            [replace(c, block_table=self.block_ids(c.block_table)) for c in plan.chunks],
            [(s + self.base, d + self.base) for s, d in plan.block_copies],
            plan.preempted_seq_ids,
            plan.finished_seq_ids,
        )


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _prefill_pool(job: MeasureJob, max_model_len: int) -> int:
    """Blocks of the prefill instance: the largest prefill batch, or a decode row's source prompt."""
    steps = job.repeats + 1
    batches = [b * _blocks(n + 1, job.block_size) for b, n in job.grid.prefill_points(max_model_len)]
    sources = [_blocks(c + 1, job.block_size) for c in job.grid.decode_rows(max_model_len, steps)]
    return max(batches + sources, default=1)


def _decode_pool(job: MeasureJob, batch_size: int, ctx_len: int) -> int:
    """Blocks of the decode instance of one point: its batch's contexts after every step."""
    return batch_size * _blocks(ctx_len + job.repeats + 2, job.block_size)


def _median_sample(times: list[float], lens: list[list[int]]) -> tuple[float, list[int]]:
    """The median step (lower median for even counts) and the lengths it ran with."""
    order = sorted(range(len(times)), key=times.__getitem__)
    i = order[(len(order) - 1) // 2]
    return times[i], lens[i]


def measure(job: MeasureJob, parallel: ParallelState) -> dict[str, Any]:
    """Every grid point of ``job`` on this rank (its model loaded here: ``load_weights``, no tokenizer); the
    samples are meaningful on rank 0."""
    config, state_dict = load_weights(job.model, job.dtype)
    max_model_len = config.max_position_embeddings
    grid = job.grid
    steps = job.repeats + 1  # the first is the warm-up
    rows = grid.decode_rows(max_model_len, steps)
    prefill_blocks = _prefill_pool(job, max_model_len)
    decode_blocks = max((sum(_decode_pool(job, b, c) for b in sizes) for c, sizes in rows.items()), default=0)
    runner = ModelRunner(config, state_dict, prefill_blocks + decode_blocks, job.block_size, parallel=parallel,
                         decode_attention=job.decode_attention)
    guard = QuietGuard(QUIET_MAX_OTHER_CORES, QUIET_RETRIES, job.max_quiet_wait_s) if job.quiet else None
    timer = StepTimer(runner, parallel, guard)
    rng = random.Random(SEED)  # the same draws on every rank, so every rank builds the same plans
    sampling = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)
    max_seqs = max(grid.prefill_batch_sizes + grid.decode_batch_sizes)
    sched_config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=max(grid.max_prefill_tokens, max_seqs), max_model_len=max_model_len
    )

    def instance(phase: str, num_blocks: int, base: int) -> ProfiledInstance:
        return ProfiledInstance(InstanceCore(phase, sched_config, num_blocks, job.block_size, max_model_len), base)

    prefiller = instance("prefill", prefill_blocks, 0)
    counter = iter(range(1 << 62))

    def new_seq(num_tokens: int) -> Sequence:
        return Sequence(f"p{next(counter)}", random_tokens(rng, num_tokens, config.vocab_size), sampling)

    def prefill(batch: list[Sequence]) -> float:
        """One step prefilling ``batch`` whole; the sequences then await migration."""
        for seq in batch:
            prefiller.core.add(seq)
        seconds, plan = prefiller.step(timer)
        assert [c.num_tokens for c in plan.chunks] == [s.num_prompt_tokens for s in batch], "grid exceeds the budget"
        return seconds

    # Round-robin: round 0 warms every shape up, each later round times one step of every point.
    points = grid.prefill_points(max_model_len)
    prefill_times: dict[tuple[int, int], list[float]] = {pt: [] for pt in points}
    first_use: dict[tuple[int, int], float] = {}
    for step in range(steps):
        for b, n in points if step % 2 == 0 else points[::-1]:
            batch = [new_seq(n) for _ in range(b)]
            seconds = prefill(batch)
            for seq in batch:
                prefiller.core.release(seq.seq_id)
            if step:
                prefill_times[(b, n)].append(seconds)
            else:
                first_use[(b, n)] = seconds
    prefill_samples = [{"lens": [n] * b, "seconds": statistics.median(prefill_times[(b, n)])} for b, n in points]
    # What the first step of a new token count costs on top (oneDNN builds its kernels per shape).
    first_use_extra_s = statistics.median(first_use[pt] - statistics.median(prefill_times[pt]) for pt in points) if points else 0.0

    decode_samples: list[dict[str, Any]] = []
    for c, sizes in rows.items():
        # The first timed step attends to ``c`` tokens: a prompt of c - 1 plus its first token.
        source = new_seq(c - 1)
        prefill([source])
        source_blocks = prefiller.block_ids(prefiller.core.kv_source(source.seq_id))
        decoders: dict[int, ProfiledInstance] = {}
        base = prefill_blocks
        for b in sizes:  # one decode instance per batch size, its blocks after the previous one's
            decoders[b] = decoder = instance("decode", _decode_pool(job, b, c), base)
            base += decoder.core.num_blocks
            for seq in [new_seq(c - 1) for _ in range(b)]:
                seq.token_ids.append(rng.randrange(config.vocab_size))  # the first token, sampled "elsewhere"
                reservation = decoder.core.reserve(seq)
                assert reservation is not None, "KV cache sized too small for the grid"
                lo, hi = reservation.num_reused_blocks, reservation.num_blocks_to_fill
                runner.copy_blocks(list(zip(source_blocks[lo:hi], decoder.block_ids(reservation.block_table[lo:hi]))))
                decoder.core.complete(seq.seq_id)
        prefiller.core.release(source.seq_id)
        times: dict[int, list[float]] = {b: [] for b in sizes}
        ctx_lens: dict[int, list[list[int]]] = {b: [] for b in sizes}
        for step in range(steps):
            for b in sizes if step % 2 == 0 else sizes[::-1]:
                seconds, plan = decoders[b].step(timer)
                assert len(plan.chunks) == b and all(ch.is_decode for ch in plan.chunks)
                if step:
                    times[b].append(seconds)
                    ctx_lens[b].append([ch.start_pos + 1 for ch in plan.chunks])
        for b in sizes:
            seconds, lens = _median_sample(times[b], ctx_lens[b])
            decode_samples.append({"ctx_lens": lens, "seconds": seconds})
    out: dict[str, Any] = {"prefill": prefill_samples, "decode": decode_samples,
                           "prefill_first_use_extra_s": round(first_use_extra_s, 4)}
    if guard is not None:
        out["quiet_guard"] = {"max_other_cores": guard.max_other_cores, **guard.counts()}
    return out


# ---- where it runs: this process (tp = 1) or tp spawned ranks over gloo -------------------------
def measure_in_process(job: MeasureJob) -> dict[str, Any]:
    previous = torch.get_num_threads()
    torch.set_num_threads(job.threads)
    try:
        return measure(job, ParallelState(ShardSpec()))
    finally:
        torch.set_num_threads(previous)


def _tp_worker(rank: int, job: MeasureJob, address: str, results: Any) -> None:
    """One TP rank (spawned): join gloo (the parent holds the rendezvous at ``address``), measure, rank 0
    reports its samples."""
    from distserve.kvtransfer.transport import init_process_group, join_rendezvous

    os.environ["OMP_NUM_THREADS"] = str(job.threads)
    torch.set_num_threads(job.threads)
    try:
        init_process_group(rank, job.tp, None, "gloo", store=join_rendezvous(address, job.tp))
        try:
            shard = ShardSpec(tp=job.tp, tp_rank=rank)
            samples = measure(job, build_parallel_state(shard, list(range(job.tp))))
            dist.barrier()
        finally:
            dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", samples))
    except BaseException as exc:  # reported to the parent, which raises it
        results.put(("error", f"rank {rank}: {exc!r}"))
        raise


def measure_tp(job: MeasureJob) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from distserve.kvtransfer.transport import open_rendezvous

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    address, _store = open_rendezvous(job.tp, "127.0.0.1")  # (the store held here while the ranks run)
    procs = [ctx.Process(target=_tp_worker, args=(r, job, address, results), daemon=True) for r in range(job.tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + WORKER_TIMEOUT_S
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


__all__ = ["FULL_GRID", "QUICK_GRID", "MeasureJob", "ProfileGrid", "ProfiledInstance", "StepTimer", "measure",
           "measure_in_process", "measure_tp"]
