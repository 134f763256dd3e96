"""Where a process runs its model: on one thread, with a chosen number of torch threads.

torch on CPU parallelises each op with OpenMP (libgomp in the PyPI wheels), and libgomp keeps a
worker pool **per thread** that ever ran a parallel region. Once the pools of a process hold more
threads than the machine has cores, libgomp stops spinning between regions (its "throttled" spin
count) and puts its workers to sleep, so each of a step's hundreds of regions pays a futex
wake-up. Loading the model on one thread and stepping it on another measured 36 vs 25 ms per
SmolLM2 decode step at batch 1 and 63 vs 33 ms at batch 8 on 2 cores. So every process that
computes does all of it — loading, prepacking, steps — on one thread, and only that thread asks
for more than one torch thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def use_compute_threads(num_threads: int | None) -> None:
    """Call on the compute thread before its first op: its OpenMP team size (per-thread state)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)


def compute_executor(num_threads: int | None, name: str = "compute") -> ThreadPoolExecutor:
    """A one-thread executor to run every model op of this process on (see the module doc)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=use_compute_threads, initargs=(num_threads,))


__all__ = ["compute_executor", "use_compute_threads"]
