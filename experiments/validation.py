"""What ``validate_simulator.py`` and ``validate_planner.py`` share: measuring a real deployment for the simulator.

The scaled chatbot workload (``lengths``), the engine profile (``make_profile``, ``concurrent_slowdown``),
open-loop replay of a workload against a deployment's controller with freshly drawn prompts
(``replay``, ``fresh_prompts``), and the solo-request calibration of the runtime constants
(``solo_calibration``; the arithmetic is ``simulator.calibration``). The scripts' shared options
(``add_profile_args``) are read here by name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from distserve.cli.arg_types import at_least_one, non_negative_float
from distserve.config import SamplingParams
from harness import QuietGuard
from simulator.calibration import Calibration, StepTrace, calibrate
from simulator.latency import FittedLatencyModel
from simulator.metrics import RequestRecord
from simulator.lengths import chatbot_lengths
from simulator.workload import Request

CALIBRATION_PROMPT, CALIBRATION_OUTPUT = 32, 24


def add_profile_args(p: argparse.ArgumentParser) -> None:
    """The model, its profile and the runtime overrides both validations take."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--profile", default=None, help="reuse a profile JSON from `distserve profile` (default: measure now)")
    p.add_argument("--profile-grid", default="full", choices=["quick", "full"])
    p.add_argument("--step-overhead-ms", type=non_negative_float, default=None,
                   help="runtime cost per step for the simulator (default: calibrated with one solo request)")
    p.add_argument("--concurrent-slowdown", type=at_least_one, default=None,
                   help="step-time factor while both workers compute (default: the profile's measurement; 1 if absent)")


def lengths(quick: bool) -> Any:
    """ShareGPT's shape (chatbot) scaled to what one CPU core serves: prompts / 2, outputs / 8."""
    if quick:
        return chatbot_lengths(prompt_mean=24, prompt_median=16, prompt_max=64, prompt_min=4,
                               output_mean=8, output_median=6, output_max=24, output_min=2)
    return chatbot_lengths(prompt_mean=114, prompt_median=52, prompt_max=512, prompt_min=4,
                           output_mean=28, output_median=20, output_max=128, output_min=2)


def make_profile(args: argparse.Namespace) -> dict[str, Any]:
    """The profile: steps re-timed when others used the CPU (not in the quick run), and how much a
    step slows down while the other worker computes (the simulator's ``concurrent_slowdown``)."""
    if args.profile:
        return json.loads(Path(args.profile).read_text())
    from distserve.measure.profiler import profile_engine

    return profile_engine(args.model, (1,), dtype=args.dtype, threads=1, quick=args.profile_grid == "quick",
                          quiet=not args.quick, concurrency=True, max_quiet_wait_s=args.max_wait_s)


def concurrent_slowdown(args: argparse.Namespace, profile: dict[str, Any]) -> float:
    if args.concurrent_slowdown is not None:
        return args.concurrent_slowdown
    measured = (profile.get("meta") or {}).get("concurrent_slowdown")
    return max(1.0, float(measured["factor"])) if measured else 1.0


def overrides(args: argparse.Namespace, cal: Calibration) -> Calibration:
    """The calibration with the command line's fixed values in its place."""
    if args.step_overhead_ms is not None:
        cal = replace(cal, step_overhead_s=args.step_overhead_ms / 1e3)
    return cal


def rel_err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas > 0 else math.nan


def fresh_prompts(requests: list[Request], rng: np.random.Generator, vocab_size: int) -> dict[int, list[int]]:
    """Random token ids of each request's prompt length, new on every call: no prefix is shared with
    any earlier replay (the deployment's prefix cache would otherwise serve it)."""
    return {r.req_id: rng.integers(3, vocab_size - 3, r.prompt_len).tolist() for r in requests}


async def replay(controller: Any, requests: list[Request], prompts: dict[int, list[int]], tag: str,
                 cached_tokens: list[int] | None = None) -> list[RequestRecord]:
    """Open loop: submit each request at its arrival time; record what the client observes (and,
    into ``cached_tokens``, how many prompt tokens of each the prefix cache served)."""
    t0 = time.monotonic() + 0.2

    async def one(r: Request) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
        sp = SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        last = None
        async for out in controller.generate(prompts[r.req_id], sp, f"{tag}-{r.req_id}"):
            last = out
        assert last is not None
        m = last.metrics
        if cached_tokens is not None:
            cached_tokens.append(m.num_cached_tokens)
        return RequestRecord(
            r.req_id, m.arrival_time - t0, r.prompt_len, r.output_len,
            first_token_s=None if m.first_token_time is None else m.first_token_time - t0,
            finish_s=None if m.finish_time is None else m.finish_time - t0,
            num_output_tokens=m.num_output_tokens,
        )

    return list(await asyncio.gather(*(one(r) for r in requests)))


def solo_calibration(guard: QuietGuard, llm: Any, trace: StepTrace, name: str, rng: np.random.Generator,
                     latency: FittedLatencyModel, block_size: int) -> tuple[Calibration, list[dict[str, Any]]]:
    """The deployment's runtime constants, separate from the validation runs: one request alone,
    three times (``calibrate``); and the steps they were read from. Leaves ``trace`` empty and disabled."""
    solo = [Request(-1, 0.0, CALIBRATION_PROMPT, CALIBRATION_OUTPUT)]
    vocab = latency.model.vocab_size

    def solo_run() -> tuple[list[float], list[dict[str, Any]]]:
        trace.steps.clear()
        trace.enabled = True
        tpots = []
        for i in range(3):
            tpots.append(llm.run(replay(llm.controller, solo, fresh_prompts(solo, rng, vocab), f"{name}-cal{i}"))[0].tpot_s)
            trace.new_run()
        trace.enabled = False
        return tpots, list(trace.steps)

    (tpots, steps), _, _ = guard.measure(f"{name} calibration", solo_run)
    trace.steps.clear()
    cal = calibrate(steps, latency, block_size)
    step = latency.decode_time([CALIBRATION_PROMPT + CALIBRATION_OUTPUT // 2])
    print(f"  {name}: solo TPOT {1e3 * float(np.median(tpots)):.1f} ms, profile decode step {1e3 * step:.1f} ms; "
          f"calibrated: step time x{cal.step_time_scale:.3f} (prefill x{cal.prefill_time_scale or cal.step_time_scale:.3f}), "
          f"runtime overhead {1e3 * cal.step_overhead_s:.1f} ms/step, migration overhead {1e3 * cal.migration_overhead_s:.1f} ms",
          flush=True)
    return cal, steps
