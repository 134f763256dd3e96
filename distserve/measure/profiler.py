"""`distserve profile`: time the real engine's steps on this machine and fit the simulator's latency model.

Every sample is one ``ModelRunner.execute(plan)`` on a ``StepPlan`` built by the real schedulers
over a real ``BlockManager``, i.e. what a serving worker runs:

* prefill: a ``PrefillScheduler`` batches ``b`` fresh random prompts of ``L`` tokens into one step;
* decode: a source prompt of the target context is prefilled once, then a ``DecodeScheduler`` per
  batch size reserves ``b`` requests and receives the source's KV by block copy (as a migration
  would fill it), and single-token decode steps of the batch are timed.

The recorded wall time of a point is the median of ``repeats`` steps after one warm-up step. The
points are measured round-robin, not one after the other: every round runs one step of each
prefill point (of each batch size of a decode context), in alternating order. This machine's speed
drifts while a profile runs (other processes, the hypervisor: a 256-token prefill took 188 ms in
one profile and 312 ms an hour later); measured point by point, a drift lands on whichever points
happened to run then. A SmolLM2 profile measured that way had every 2- and 4-prompt batch 30-90%
slower than one prompt of the same total length, which alternated measurements do not show
(2 x 256 tokens 5% *faster* than 1 x 512, 2 x 512 13% faster than 1 x 1024), and its fit
over-predicted single prompts by 40-50%. With ``quiet`` a step is timed again when other processes
used the CPU meanwhile.
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
from distserve.engine.scheduler import SampledToken, ScheduledChunk, StepPlan
from distserve.engine.sequence import Sequence
from distserve.engine.weights import LoadedModel, load_model, resolve_model_dir
from distserve.errors import InvalidConfigError
from distserve.prefill.scheduler import PrefillScheduler
from kernels.decode_attention import default_decode_attention, get_decode_attention

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
    decode_attention: str  # the kernels.decode_attention backend the runner uses
    quiet: bool = False
    max_quiet_wait_s: float = 600.0


# Quiet-machine guard: others may use this much CPU (cores) during a timed step; a disturbed step is
# timed again up to _QUIET_RETRIES times (waiting for quiet takes at most ``max_quiet_wait_s`` in all).
_QUIET_MAX_OTHER_CORES = 0.25
_QUIET_RETRIES = 3


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
class _QuietGuard:
    """Whether other processes used the CPU while a step ran, and waiting for them to stop.

    On a VM whose vCPUs can share a physical core a busy neighbour process can double a one-thread
    step's time (measured here: 2.05-2.3x at one time, ~1.0x an hour and a half later), so a step
    timed while others ran is timed again. Budgets bound the waiting: a machine that never quiets
    down still gets profiled.
    """

    def __init__(self, max_other_cores: float, max_retries: int, max_wait_s: float, exclude_pids: Seq[int] = ()) -> None:
        """``exclude_pids``: processes that are part of the measurement (not "others")."""
        self.max_other_cores = max_other_cores
        self.exclude_pids = list(exclude_pids)
        self.max_retries = max_retries
        self.wait_budget_s = max_wait_s
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self.num_disturbed = 0  # steps timed again
        self.num_kept_disturbed = 0  # out of retries: kept anyway
        self.waited_s = 0.0

    def snapshot(self) -> tuple[float, float]:
        """(CPU seconds the whole machine has been busy, CPU seconds of this process and the excluded ones)."""
        total, _ = cpu_jiffies(busy=True)
        return total * self.tick_s, time.process_time() + sum(_process_cpu_s(pid, self.tick_s) for pid in self.exclude_pids)

    def timed(self, run: Callable[[], object]) -> float:
        """Seconds ``run()`` takes on a quiet machine: run again (after waiting) while others
        disturbed it, up to ``max_retries`` times."""
        for attempt in range(self.max_retries + 1):
            before = self.snapshot()
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
            if self.others_cores(before, seconds) < self.max_other_cores:
                break
            if attempt == self.max_retries:
                self.num_kept_disturbed += 1
                break
            self.num_disturbed += 1
            self.wait_for_quiet()
        return seconds

    def others_cores(self, before: tuple[float, float], seconds: float) -> float:
        busy, own = self.snapshot()
        others = (busy - before[0]) - (own - before[1])
        return max(0.0, others - 2 * self.tick_s) / max(seconds, 1e-9)  # two ticks of slack: jiffy rounding

    def wait_for_quiet(self, window_s: float = 0.5) -> None:
        while self.wait_budget_s > 0:
            before = self.snapshot()
            time.sleep(window_s)
            self.wait_budget_s -= window_s
            self.waited_s += window_s
            if self.others_cores(before, window_s) < self.max_other_cores:
                return


def _process_cpu_s(pid: int, tick_s: float) -> float:
    """CPU seconds (user + system) process ``pid`` has used; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... utime stime
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) * tick_s


class _StepTimer:
    """Runs plans on one rank: all ranks start a step together, rank 0's wall time is the sample.

    With a ``_QuietGuard`` (one rank only) a step during which other processes used the CPU is run
    again after they stop: executing a plan twice recomputes the same KV, so it is harmless.
    """

    def __init__(self, runner: ModelRunner, parallel: ParallelState, guard: _QuietGuard | None = None) -> None:
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


def _median_sample(times: list[float], lens: list[list[int]]) -> tuple[float, list[int]]:
    """The median step (lower median for even counts) and the lengths it ran with."""
    order = sorted(range(len(times)), key=times.__getitem__)
    i = order[(len(order) - 1) // 2]
    return times[i], lens[i]


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _decode_rows(grid: ProfileGrid, max_model_len: int, num_steps: int) -> dict[int, list[int]]:
    """Decode batch sizes per context length (context-major, as ``decode_points``)."""
    rows: dict[int, list[int]] = {}
    for b, c in grid.decode_points(max_model_len, num_steps):
        rows.setdefault(c, []).append(b)
    return rows


def _num_blocks_needed(job: _Job, max_model_len: int) -> int:
    bs = job.block_size
    steps = job.repeats + 1
    prefill = max((b * -(-(n + 1) // bs) for b, n in job.grid.prefill_points(max_model_len)), default=0)
    # A decode context's batches are all live at once (measured round-robin), with their source.
    decode = max(
        (sum(sizes) * -(-(c + steps + 1) // bs) + -(-(c + 1) // bs)
         for c, sizes in _decode_rows(job.grid, max_model_len, steps).items()),
        default=0,
    )
    return max(prefill, decode) + 8


def _measure(job: _Job, loaded: LoadedModel, parallel: ParallelState) -> dict[str, list[dict[str, Any]]]:
    """Every grid point of ``job`` on this rank; the samples are meaningful on rank 0."""
    config = loaded.config
    max_model_len = config.max_position_embeddings
    num_blocks = _num_blocks_needed(job, max_model_len)
    runner = ModelRunner(config, loaded.state_dict, num_blocks, job.block_size, parallel=parallel,
                         decode_attention=job.decode_attention)
    guard = _QuietGuard(_QUIET_MAX_OTHER_CORES, _QUIET_RETRIES, job.max_quiet_wait_s) if job.quiet else None
    timer = _StepTimer(runner, parallel, guard)
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

    # Round-robin: round 0 warms every shape up, each later round times one step of every point.
    points = grid.prefill_points(max_model_len)
    prefill_times: dict[tuple[int, int], list[float]] = {pt: [] for pt in points}
    first_use: dict[tuple[int, int], float] = {}
    for step in range(steps):
        for b, n in points if step % 2 == 0 else points[::-1]:
            batch = [new_seq(n) for _ in range(b)]
            seconds = prefill(batch)
            release(batch, lambda s: prefill_sched.release(s.seq_id))
            if step:
                prefill_times[(b, n)].append(seconds)
            else:
                first_use[(b, n)] = seconds
    prefill_samples = [{"lens": [n] * b, "seconds": statistics.median(prefill_times[(b, n)])} for b, n in points]
    # What the first step of a new token count costs on top (oneDNN builds its kernels per shape).
    first_use_extra_s = statistics.median(first_use[pt] - statistics.median(prefill_times[pt]) for pt in points) if points else 0.0

    decode_samples: list[dict[str, Any]] = []
    for c, sizes in _decode_rows(grid, max_model_len, steps).items():
        # The first timed step attends to ``c`` tokens: a prompt of c - 1 plus its first token.
        source = new_seq(c - 1)
        prefill([source])
        batches: dict[int, tuple[DecodeScheduler, list[Sequence]]] = {}
        for b in sizes:
            sched = DecodeScheduler(sched_config, bm, max_model_len)  # one per batch size, one block pool
            batch = [new_seq(c - 1) for _ in range(b)]
            for seq in batch:
                seq.token_ids.append(rng.randrange(config.vocab_size))  # the first token, sampled "elsewhere"
                reservation = sched.reserve(seq)
                assert reservation is not None, "KV cache sized too small for the grid"
                lo, hi = reservation.num_reused_blocks, reservation.num_blocks_to_fill
                runner.copy_blocks(list(zip(source.block_table[lo:hi], reservation.block_table[lo:hi])))
                sched.complete(seq.seq_id)
            batches[b] = (sched, batch)
        release([source], lambda s: prefill_sched.release(s.seq_id))
        times: dict[int, list[float]] = {b: [] for b in sizes}
        ctx_lens: dict[int, list[list[int]]] = {b: [] for b in sizes}
        for step in range(steps):
            for b in sizes if step % 2 == 0 else sizes[::-1]:
                sched, batch = batches[b]
                plan = sched.schedule()
                assert len(plan.chunks) == b and all(ch.is_decode for ch in plan.chunks)
                seconds, sampled = timer.run(plan)
                sched.update_from_output(plan, sampled, seqs, 0.0)
                if step:
                    times[b].append(seconds)
                    ctx_lens[b].append([ch.start_pos + 1 for ch in plan.chunks])
        for b in sizes:
            seconds, lens = _median_sample(times[b], ctx_lens[b])
            decode_samples.append({"ctx_lens": lens, "seconds": seconds})
            sched, batch = batches[b]
            release(batch, lambda s, sched=sched: sched.finish(s, "abort"))
    out: dict[str, Any] = {"prefill": prefill_samples, "decode": decode_samples,
                           "prefill_first_use_extra_s": round(first_use_extra_s, 4)}
    if guard is not None:
        out["quiet_guard"] = {"max_other_cores": guard.max_other_cores, "num_steps_retimed": guard.num_disturbed,
                              "num_steps_kept_disturbed": guard.num_kept_disturbed, "waited_s": round(guard.waited_s, 1)}
    return out


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


# ---- concurrent workers -----------------------------------------------------------------------
def _probe_runner(model: str, dtype: str, threads: int) -> tuple[ModelRunner, dict[str, StepPlan]]:
    """A small runner and the probe steps: a 128-token prefill and a decode of 8 at context 128."""
    torch.set_num_threads(threads)
    loaded = load_model(model, dtype)
    bs = 16
    runner = ModelRunner(loaded.config, loaded.state_dict, 80, bs)
    rng = random.Random(_SEED)
    sampling = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)
    vocab = loaded.config.vocab_size
    prefill = StepPlan([ScheduledChunk("p", _random_tokens(rng, 128, vocab), 0, list(range(9)), True, sampling, 0)])
    decode = StepPlan([
        ScheduledChunk(f"d{i}", [rng.randrange(vocab)], 127, list(range(9 + 8 * i, 17 + 8 * i)), True, sampling, 1)
        for i in range(8)
    ])
    return runner, {"prefill 1x128": prefill, "decode 8x128": decode}


def _busy_neighbour(model: str, dtype: str, threads: int, on: Any, stop: Any, ready: Any) -> None:
    """A second worker (spawned) that runs prefill steps back to back while ``on`` is set."""
    runner, plans = _probe_runner(model, dtype, threads)
    ready.set()
    while not stop.is_set():
        if on.wait(0.05):
            runner.execute(plans["prefill 1x128"])


def measure_concurrent_slowdown(
    model: str, dtype: str = "float32", threads: int = 1, rounds: int = 6, quiet: bool = False, max_quiet_wait_s: float = 600.0
) -> dict[str, Any]:
    """How much slower a worker's step runs while another worker of this machine computes.

    Spawns a second process running prefill steps and times the probe steps with it busy and idle,
    alternated, ``rounds`` times each. On a GPU node the answer is ~1 (separate devices); a VM
    whose vCPUs share one physical core's vector units measures ~2. ``quiet`` times a step again
    when processes other than these two used the CPU meanwhile (a busy machine would make the
    "idle" steps slow too and hide the effect). Returns ``{"factor": median of the probes'
    busy/idle ratios, "probes": {name: ratio}}`` (and ``quiet_guard`` counts with ``quiet``).
    """
    import torch.multiprocessing as mp

    _check_positive(threads=threads, rounds=rounds)
    resolved = resolve_dtype(dtype)
    ctx = mp.get_context("spawn")
    on, stop, ready = ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_busy_neighbour, args=(model, resolved, threads, on, stop, ready), daemon=True)
    previous = torch.get_num_threads()
    proc.start()
    try:
        runner, plans = _probe_runner(model, resolved, threads)
        for plan in plans.values():  # warm-up
            runner.execute(plan)
        if not ready.wait(_WORKER_TIMEOUT_S):
            raise RuntimeError("the neighbour worker did not start")
        assert proc.pid is not None
        guard = _QuietGuard(_QUIET_MAX_OTHER_CORES, _QUIET_RETRIES if quiet else 0, max_quiet_wait_s if quiet else 0.0,
                            exclude_pids=[proc.pid])
        if quiet:
            guard.wait_for_quiet()
        times: dict[tuple[str, bool], list[float]] = {(name, busy): [] for name in plans for busy in (False, True)}
        for r in range(2 * rounds):
            busy = r % 2 == 1
            (on.set if busy else on.clear)()
            time.sleep(0.2)  # let the neighbour finish or start a step
            for name, plan in plans.items():
                for _ in range(2):
                    times[(name, busy)].append(guard.timed(lambda plan=plan: runner.execute(plan)))
    finally:
        stop.set()
        on.set()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
        torch.set_num_threads(previous)
    probes = {name: statistics.median(times[(name, True)]) / statistics.median(times[(name, False)]) for name in plans}
    out: dict[str, Any] = {"factor": round(statistics.median(probes.values()), 3), "probes": {k: round(v, 3) for k, v in probes.items()}}
    if quiet:
        out["quiet_guard"] = {"num_steps_retimed": guard.num_disturbed, "num_steps_kept_disturbed": guard.num_kept_disturbed,
                              "waited_s": round(guard.waited_s, 1)}
    return out


# ---- the profile --------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_jiffies(busy: bool = False) -> tuple[int, int]:
    """(all, steal) jiffies of the machine since boot — with ``busy``, all but idle and iowait;
    (0, 0) where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return 0, 0
    total = sum(fields) - (fields[3] + fields[4] if busy else 0)
    return total, fields[7] if len(fields) > 7 else 0


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
    from simulator.latency import build_profile

    _check_positive(threads=threads, repeats=repeats, block_size=block_size)
    resolved = resolve_dtype(dtype)
    config = model_config(model, resolved)
    tps = check_tps(config, tps)
    grid = QUICK_GRID if quick else FULL_GRID
    samples_by_tp: dict[int, dict[str, Any]] = {}
    decode_attention = default_decode_attention("cpu")  # what ModelRunner runs by default here
    t0 = time.perf_counter()
    jiffies0 = cpu_jiffies()
    for tp in tps:
        job = _Job(model, resolved, tp, threads, repeats, block_size, grid, decode_attention,
                   quiet=quiet, max_quiet_wait_s=max_quiet_wait_s)
        samples_by_tp[tp] = _measure_in_process(job) if tp == 1 else _measure_tp(job)
    extras = {tp: {k: v for k, v in samples.items() if k not in ("prefill", "decode")} for tp, samples in samples_by_tp.items()}
    concurrent = measure_concurrent_slowdown(model, resolved, threads, quiet=quiet, max_quiet_wait_s=max_quiet_wait_s) if concurrency else None
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
        # Share of the CPU time the hypervisor gave to others while profiling (a VM's noise).
        "cpu_steal_fraction": _steal_fraction(jiffies0, cpu_jiffies()),
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


def _steal_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[0] - before[0]
    return round((after[1] - before[1]) / total, 4) if total > 0 else 0.0


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
