"""A real deployment's runtime constants for the simulator, read off the steps its controller applies.

``SimConfig`` charges every simulated step the profile's time x ``step_time_scale`` plus
``step_overhead_s``, and every KV migration its link time plus ``migration_overhead_s``. This
module measures those constants on a running deployment: ``StepTrace`` records every step the
controller applies (a listener on ``Controller.add_step_listener``) with the batch it computed,
and ``calibrate`` derives a ``Calibration`` from the trace of one request served alone.
``step_time_summary`` compares any trace with what the simulator charges for the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from simulator.latency import BatchShape, FittedLatencyModel

if TYPE_CHECKING:
    from distserve.runtime.controller import Controller, StepEvent


class StepTrace:
    """Every step the controller applies while ``enabled``: which phase, the batch, how long it took.

    A step is recorded when its tokens can be attributed: a request's first token ends a prefill of
    its uncached prompt tokens, a later token one decode over its context (``StepEvent``); steps
    with a preempted recompute or a chunk without a token are skipped. ``step_s`` is the instance's
    own step time (schedule + execute + update, ``StepResult.step_seconds``), ``execute_s`` the
    model's; ``cycle_s`` the time since the instance's previous step returned, kept only when that
    step reported more work (the loop went straight on): one step plus the runtime's round trip.
    ``new_shape``: the instance had not run this token count since the trace began (oneDNN builds
    kernels per shape). Use as a context manager (or call ``close``) to stop listening.
    """

    def __init__(self, controller: Controller) -> None:
        self.steps: list[dict[str, Any]] = []
        self.enabled = False
        self._last: dict[str, tuple[float, bool]] = {}  # instance id -> (time of its last step, it had more work)
        self._shapes: dict[str, set[int]] = {}  # token counts each instance has run (since the trace began)
        self.close = controller.add_step_listener(self._on_step)

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_run(self) -> None:
        """A run starts after an idle gap: no cycle is measured across it."""
        self._last.clear()

    def _on_step(self, event: StepEvent) -> None:
        num_tokens = event.result.num_batched_tokens
        shapes = self._shapes.setdefault(event.instance_id, set())
        new_shape = num_tokens not in shapes
        shapes.add(num_tokens)
        if self.enabled:
            self._record(event, new_shape)

    def _record(self, event: StepEvent, new_shape: bool) -> None:
        result = event.result
        last = self._last.get(event.instance_id)
        self._last[event.instance_id] = (event.time, bool(result.has_work))
        if not result.num_batched_tokens:
            return
        if sum(event.prefill_lens) + len(event.decode_ctx) != result.num_batched_tokens:
            return  # a preempted recompute or a chunk without a token: not one we can attribute
        self.steps.append({
            "phase": event.phase, "prefill_lens": list(event.prefill_lens), "decode_ctx": list(event.decode_ctx),
            "step_s": result.step_seconds, "execute_s": result.execute_seconds,
            "cycle_s": event.time - last[0] if last is not None and last[1] else None, "new_shape": new_shape,
            "t": event.time,
        })


@dataclass
class Calibration:
    """A deployment's runtime constants for the simulator (``SimConfig`` fields of the same names),
    measured with one request alone (``calibrate``)."""

    step_overhead_s: float  # per step: controller -> instance actor -> controller, and the scheduling around the model
    step_time_scale: float  # the model's time in the serving process / the profile's step time (decode steps)
    migration_overhead_s: float = 0.0  # per KV migration, beyond the link time (1P1D)
    prefill_time_scale: float | None = None  # the same for steps with prompt tokens (None: step_time_scale)


def profile_step_time(latency: FittedLatencyModel, step: dict[str, Any]) -> float:
    """The profile's time for a traced step's batch."""
    return latency.step_time(BatchShape.of(prefill_lens=step["prefill_lens"], decode_ctx_lens=step["decode_ctx"]))


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else math.nan


def calibrate(steps: list[dict[str, Any]], latency: FittedLatencyModel, block_size: int) -> Calibration:
    """The runtime constants from a solo request's step trace (``StepTrace``, with ``execute_s``).

    * ``step_time_scale`` (decode steps) and ``prefill_time_scale`` (steps with prompt tokens): the
      median of the model's execute time (``StepResult.execute_seconds``) over the profile's time
      for the same batch. Above 1 where the serving process computes more slowly than the profiler
      did (measured here: ~1.05 for decode steps, 1.1-1.25 for a prefill, which in serving follows
      an idle or a decode step; the profiler times steps back to back in a bare process).
    * ``step_overhead_s``: over back-to-back decode steps, the median time between two steps minus
      the model's time: the round trip controller -> instance actor -> controller plus scheduling.
    * ``migration_overhead_s`` (1P1D): from the prefill step that produced the first token to the
      decode step that produced the second, minus what the simulator already charges for it (the
      decode step and the link time of the KV): the controller's reserve round trip and the decode
      instance's wake-up.

    Not the solo TPOT minus the profile's step: in 1P1D the TPOT also spreads the KV migration over
    the output tokens, and the two constants would be folded into one.
    """
    timed = [s for s in steps if s.get("execute_s")]
    if not timed:
        raise RuntimeError("calibration saw no steps")
    ratios = {kind: [s["execute_s"] / profile_step_time(latency, s) for s in timed if bool(s["prefill_lens"]) == (kind == "prefill")]
              for kind in ("prefill", "decode")}
    if not ratios["decode"]:
        raise RuntimeError("calibration saw no decode steps")
    scale = float(np.median(ratios["decode"]))
    prefill_scale = float(np.median(ratios["prefill"])) if ratios["prefill"] else None
    gaps = [s["cycle_s"] - s["execute_s"] for s in timed if s["cycle_s"] is not None and s["decode_ctx"] and not s["prefill_lens"]]
    if not gaps:
        raise RuntimeError("calibration saw no back-to-back decode steps")
    overhead = max(0.0, float(np.median(gaps)))
    kv_bytes = latency.kv_bytes_per_token_per_device(1, 1)
    extra: list[float] = []
    for i, s in enumerate(steps):
        if s["phase"] != "prefill" or not s["prefill_lens"]:
            continue
        second = next((d for d in steps[i + 1:] if d["phase"] == "decode" and d["decode_ctx"]), None)
        if second is None:
            continue
        num_bytes = -(-(s["prefill_lens"][0] + 1) // block_size) * block_size * kv_bytes
        charged = scale * profile_step_time(latency, second) + overhead + latency.migration_time(num_bytes)
        extra.append(second["t"] - s["t"] - charged)
    migration = max(0.0, float(np.median(extra))) if extra else 0.0
    return Calibration(overhead, scale, migration, prefill_scale)


def step_time_summary(steps: list[dict[str, Any]], latency: FittedLatencyModel, cal: Calibration) -> dict[str, Any]:
    """Median real/profile ratios per kind of step: ``step_s`` vs the profile's step time, and
    ``cycle_s`` vs what the simulator charges a step (scale x profile + runtime overhead)."""
    out: dict[str, Any] = {}
    for kind in ("prefill", "decode", "mixed"):
        ratios, cycles, preds, first, again = [], [], [], [], []
        for s in steps:
            p, d = s["prefill_lens"], s["decode_ctx"]
            if ("mixed" if p and d else "prefill" if p else "decode") != kind:
                continue
            pred = profile_step_time(latency, s)
            ratios.append(s["step_s"] / pred)
            (first if s.get("new_shape") else again).append(s["step_s"] / pred)
            preds.append(pred)
            if s["cycle_s"] is not None:
                k = (cal.prefill_time_scale or cal.step_time_scale) if p else cal.step_time_scale
                cycles.append(s["cycle_s"] / (k * pred + cal.step_overhead_s))
        out[kind] = {
            "num_steps": len(ratios),
            "median_profile_s": _median(preds),
            "median_step_over_profile": _median(ratios),
            "median_cycle_over_simulated": _median(cycles),
            # A token count this instance had not run before (oneDNN builds kernels per shape) vs one it had.
            "num_new_shape_steps": len(first),
            "median_step_over_profile_new_shape": _median(first),
            "median_step_over_profile_seen_shape": _median(again),
        }
    return out


def step_diagnostics(steps: list[dict[str, Any]], latency: FittedLatencyModel) -> dict[str, float]:
    """Medians over a run's steps: the model's execute time over the profile's (prefill-carrying and
    decode-only steps), and the round trip between back-to-back decode steps beyond the model's time
    (what the simulator charges as the step overhead)."""
    timed = [s for s in steps if s.get("execute_s")]
    return {
        "prefill_execute_over_profile": _median([s["execute_s"] / profile_step_time(latency, s) for s in timed if s["prefill_lens"]]),
        "decode_execute_over_profile": _median([s["execute_s"] / profile_step_time(latency, s) for s in timed if not s["prefill_lens"]]),
        "decode_round_trip_s": _median([s["cycle_s"] - s["execute_s"] for s in timed
                                        if s["cycle_s"] is not None and s["decode_ctx"] and not s["prefill_lens"]]),
        "num_steps": len(steps),
    }
