"""Cumulative histograms of an instance's engine steps: tokens per step (vLLM's
``iteration_tokens_total``) and step seconds, which ``/metrics`` exports per instance.

They are counted where the step is observed (``InstanceCore.observe``), not at the API server, so
every runtime has them — the Ray runtime's instances included, whose figures cross a process
boundary: ``as_dict`` is plain lists (bucket bounds and per-bucket counts), so a reader needs no
type of ours and no observation is lost between two reads (nothing is drained).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import TypedDict

# vLLM's iteration-token buckets are its CUDA-graph sizes; powers of two cover a CPU instance's steps as well.
ITERATION_TOKEN_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
STEP_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class HistogramCounts(TypedDict):
    """One histogram as plain data: ``counts[i]`` observations ≤ ``bounds[i]`` and > the bound before
    (the last entry: above every bound), and the sum of the observations."""

    bounds: list[float]
    counts: list[int]
    sum: float


class CumulativeHistogram:
    """Observations counted into fixed buckets since the instance started."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # ≤ bound: Prometheus's ``le``
        self.total += value

    def as_dict(self) -> HistogramCounts:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


__all__ = ["CumulativeHistogram", "HistogramCounts", "ITERATION_TOKEN_BOUNDS", "STEP_SECONDS_BOUNDS"]
