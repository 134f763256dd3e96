"""How much slower a worker's step runs while another worker of this machine computes.

The simulator charges a step run next to busy co-located workers by this factor (its
``concurrent_slowdown``): ~1 on a GPU node (separate devices), ~2 on a VM whose vCPUs share one
physical core's vector units. Measured with fixed probe plans on a small runner, not the grid.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from distserve.config import SamplingParams
from distserve.dtypes import resolve_dtype
from distserve.engine.model_runner import ModelRunner
from distserve.engine.step_plan import ScheduledChunk, StepPlan
from distserve.engine.weights import load_weights
from distserve.measure.machine import QUIET_MAX_OTHER_CORES, QUIET_RETRIES, QuietGuard
from distserve.measure.step_times import SEED, WORKER_TIMEOUT_S, check_positive, random_tokens


# Between the idle and busy rounds the neighbour is given a few of its steps to finish the one it runs (or to start),
# at most 0.2 s (a small model's step takes milliseconds: 0.2 s each round was most of a quick profile's wait).
SETTLE_STEPS, SETTLE_MIN_S, SETTLE_MAX_S = 3, 0.02, 0.2


def _probe_runner(model: str, dtype: str, threads: int) -> tuple[ModelRunner, dict[str, StepPlan]]:
    """A small runner and the probe steps: a 128-token prefill and a decode of 8 at context 128."""
    torch.set_num_threads(threads)
    config, state_dict = load_weights(model, dtype)
    bs = 16
    runner = ModelRunner(config, state_dict, 80, bs)
    rng = random.Random(SEED)
    sampling = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)
    vocab = config.vocab_size
    prefill = StepPlan([ScheduledChunk("p", random_tokens(rng, 128, vocab), 0, list(range(9)), True, sampling, 0)])
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

    check_positive(threads=threads, rounds=rounds)
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
        # The neighbour's step, warm: a switch of ``on`` takes effect once its current step ends.
        t0 = time.perf_counter()
        runner.execute(plans["prefill 1x128"])
        settle_s = min(SETTLE_MAX_S, max(SETTLE_MIN_S, SETTLE_STEPS * (time.perf_counter() - t0)))
        if not ready.wait(WORKER_TIMEOUT_S):
            raise RuntimeError("the neighbour worker did not start")
        assert proc.pid is not None
        guard = QuietGuard(QUIET_MAX_OTHER_CORES, QUIET_RETRIES if quiet else 0, max_quiet_wait_s if quiet else 0.0,
                           exclude_pids=[proc.pid])
        if quiet:
            guard.wait_for_quiet()
        times: dict[tuple[str, bool], list[float]] = {(name, busy): [] for name in plans for busy in (False, True)}
        for r in range(2 * rounds):
            busy = r % 2 == 1
            (on.set if busy else on.clear)()
            time.sleep(settle_s)  # let the neighbour finish or start a step
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
        out["quiet_guard"] = guard.counts()
    return out


__all__ = ["measure_concurrent_slowdown"]
