"""Does the simulator predict the real engine? Measured vs simulated TTFT/TPOT/attainment on this machine.

1. Profile the real engine here (``distserve.measure.profiler.profile_engine``: ``ModelRunner.execute`` on
   real scheduler plans, one thread, as the Ray workers run; steps re-timed while other processes
   used the CPU) and fit DistServe's latency form. The profile also measures how much a step slows
   down while the other worker computes (``concurrent_slowdown``: the two workers share this
   machine's cores), which the simulator applies to instances computing at the same time.
2. Deploy each system on the Ray runtime (colocated: 1 instance; 1P1D: one prefill and one decode
   instance, KV over gloo; the controller in this process), warm it up with one uncounted replay,
   and replay the same seeded open-loop workload at three arrival rates: token-id prompts of the
   generated lengths, exactly ``output_len`` tokens each (ignore_eos).
3. Simulate the same requests (their actual submission times) on the same placement, with the
   same scheduler limits and KV blocks, and the fitted profile.
4. Print predicted vs measured P50/P90 TTFT and TPOT and SLO attainment, and the relative errors.
   Target: <= 10% error on P90 TTFT and TPOT (goal <= 5%).

No calibration against the validation runs: the simulator sees only the profile, the placement,
the scheduler settings, the requests, and three runtime constants measured beforehand on each
deployment with a single request running alone (``calibrate``): how much slower the model runs in
the serving process than in the profiler (``step_time_scale``), what the Ray runtime adds to every
step (controller → instance actor → controller, ``step_overhead_s``), and what it adds to a KV
migration beyond the link time (``migration_overhead_s``, 1P1D). ``--step-overhead-ms`` sets the
second instead.

Every replay (warm-up, calibration, each rate) sends freshly drawn prompts: the deployment keeps
prefix caching on (the server default), so replaying the same token ids would turn the prefills of
every later run into prefix-cache hits that the simulated workload (no shared prefixes) does not
have. The number of prompt tokens served from the cache is reported (``num_cached_tokens``: 0).

This machine is shared: each calibration and each rate waits for a quiet machine and is measured
again (``--retries``) when other processes used more than ``--max-other-cores`` meanwhile; the
table reports what they used. A step trace (``StepTrace``) records every step the controller
applies, with the batch it computed, and compares the real step times with the profile's: how far
the latency model itself is off, apart from the simulation around it. ``--from-raw`` simulates the
measurements of an earlier run again (its ``validate_simulator_raw.json``).

Writes JSON + markdown + PNG under --out-dir; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from distserve.placement import Placement  # noqa: E402
from distserve.measure.profiler import cpu_jiffies  # noqa: E402
from distserve.slo import SLO, SLOSpec, attainment, latency_summary  # noqa: E402
from simulator.latency import FittedLatencyModel  # noqa: E402
from simulator.metrics import RequestRecord  # noqa: E402
from simulator.simulation import SimConfig, simulate, with_rate  # noqa: E402
from simulator.workload import Request, chatbot_lengths, generate_requests  # noqa: E402

SYSTEMS = {"colocated": Placement.colocated_instances(1), "1p1d": Placement.disaggregated(1, 1)}
BUSY_PATTERN = r"experiments/(validate_simulator|validate_planner|reproduce_distserve|bench_simulator)\.py"
T = TypeVar("T")
METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")
CALIBRATION_PROMPT, CALIBRATION_OUTPUT = 32, 24


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--profile", default=None, help="reuse a profile JSON from `distserve profile` (default: measure now)")
    p.add_argument("--profile-grid", default="full", choices=["quick", "full"])
    p.add_argument("--rates", default="0.4,0.8,1.2", help="arrival rates, requests/s")
    p.add_argument("--num-requests", type=int, default=60, help="requests per rate")
    p.add_argument("--ttft", type=float, default=1.0, help="TTFT SLO (s) for attainment")
    p.add_argument("--tpot", type=float, default=0.15, help="TPOT SLO (s) for attainment")
    p.add_argument("--step-overhead-ms", type=float, default=None,
                   help="runtime cost per step for the simulator (default: calibrated with one solo request)")
    p.add_argument("--concurrent-slowdown", type=float, default=None,
                   help="step-time factor while both workers compute (default: the profile's measurement; 1 if absent)")
    p.add_argument("--max-wait-s", type=float, default=1800.0, help="longest wait for a quiet machine before a measurement")
    p.add_argument("--max-other-cores", type=float, default=0.25,
                   help="CPU the rest of the machine (hypervisor steal included) may use during a measurement (cores, mean) "
                        "before it is redone")
    p.add_argument("--retries", type=int, default=2, help="times a measurement is redone when others used the CPU meanwhile")
    p.add_argument("--recalibrate", action="store_true",
                   help="with --from-raw: compute the calibration again from the stored calibration steps")
    p.add_argument("--from-raw", default=None,
                   help="simulate the measurements of an earlier run (its validate_simulator_raw.json; pass its profile "
                        "with --profile) instead of measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, few requests (the test suite's run)")
    p.add_argument("--out-dir", default=str(REPO / "experiments" / "results"))
    args = p.parse_args()
    args.wait_for_quiet = not args.quick
    if args.quick:
        args.model, args.dtype, args.profile_grid = "tiny", "float32", "quick"
        args.rates, args.num_requests = "2,4,8", 12
        args.ttft, args.tpot = 0.5, 0.05
    args.rate_list = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in args.rate_list) or args.num_requests < 1:
        p.error("--rates must be positive and --num-requests >= 1")
    if args.from_raw and not args.profile:
        p.error("--from-raw needs the run's profile (--profile)")
    return args


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
                          quiet=args.wait_for_quiet, concurrency=True, max_quiet_wait_s=args.max_wait_s)


def concurrent_slowdown(args: argparse.Namespace, profile: dict[str, Any]) -> float:
    if args.concurrent_slowdown is not None:
        return args.concurrent_slowdown
    measured = (profile.get("meta") or {}).get("concurrent_slowdown")
    return max(1.0, float(measured["factor"])) if measured else 1.0


def fresh_prompts(requests: list[Request], rng: np.random.Generator, vocab_size: int) -> dict[int, list[int]]:
    """Random token ids of each request's prompt length, new on every call: no prefix is shared with
    any earlier replay (the deployment's prefix cache would otherwise serve it)."""
    return {r.req_id: rng.integers(3, vocab_size - 3, r.prompt_len).tolist() for r in requests}


class StepTrace:
    """Every step the controller applies: which instance, the batch it computed, how long it took.

    Wraps ``Controller._apply`` (every ``StepResult`` passes through it, in this process) and reads
    the batch off the updates before they are applied: a request's first token ends a prefill of its
    uncached prompt tokens, a later token one decode over its context. ``step_s`` is the instance's
    own step time (schedule + execute + update, ``StepResult.step_seconds``); ``cycle_s`` the time
    since the instance's previous step returned, kept only when that step reported more work (the
    loop went straight on): one step plus the runtime's round trip.
    """

    def __init__(self, controller: Any) -> None:
        self.steps: list[dict[str, Any]] = []
        self._last: dict[int, tuple[float, bool]] = {}
        self._shapes: dict[int, set[int]] = {}  # token counts each instance has run (since the trace began)
        self.enabled = False
        original = controller._apply

        def apply(inst: Any, result: Any) -> None:
            shapes = self._shapes.setdefault(id(inst), set())
            new_shape = result.num_batched_tokens not in shapes
            shapes.add(result.num_batched_tokens)
            if self.enabled:
                self._record(controller, inst, result, new_shape)
            original(inst, result)

        controller._apply = apply

    def new_run(self) -> None:
        """A run starts after an idle gap: no cycle is measured across it."""
        self._last.clear()

    def _record(self, controller: Any, inst: Any, result: Any, new_shape: bool) -> None:
        now = time.monotonic()
        last = self._last.get(id(inst))
        self._last[id(inst)] = (now, bool(result.has_work))
        if not result.num_batched_tokens:
            return
        prefill_lens: list[int] = []
        decode_ctx: list[int] = []
        for up in result.updates:
            seq = controller._seqs.get(up.seq_id)
            if seq is None or not up.new_token_ids:
                continue
            if seq.first_token_time is None:
                prefill_lens.append(seq.num_prompt_tokens - up.num_cached_tokens)
            else:
                decode_ctx.append(len(seq.token_ids))
        if sum(prefill_lens) + len(decode_ctx) != result.num_batched_tokens:
            return  # a preempted recompute or a chunk without a token: not one we can attribute
        self.steps.append({
            "phase": inst.phase, "prefill_lens": prefill_lens, "decode_ctx": decode_ctx, "step_s": result.step_seconds,
            "execute_s": result.execute_seconds,
            "cycle_s": now - last[0] if last is not None and last[1] else None, "new_shape": new_shape, "t": now,
        })


@dataclass
class Calibration:
    """A deployment's runtime constants for the simulator (``SimConfig`` fields of the same names),
    measured with one request alone (``calibrate``)."""

    step_overhead_s: float  # per step: controller -> instance actor -> controller, and the scheduling around the model
    step_time_scale: float  # the model's time in the serving process / the profile's step time (decode steps)
    migration_overhead_s: float = 0.0  # per KV migration, beyond the link time (1P1D)
    prefill_time_scale: float | None = None  # the same for steps with prompt tokens (None: step_time_scale)


def _profile_step(latency: FittedLatencyModel, step: dict[str, Any]) -> float:
    from simulator.latency import BatchShape

    return latency.step_time(BatchShape.of(prefill_lens=step["prefill_lens"], decode_ctx_lens=step["decode_ctx"]))


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
    ratios = {kind: [s["execute_s"] / _profile_step(latency, s) for s in timed if bool(s["prefill_lens"]) == (kind == "prefill")]
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
        charged = scale * _profile_step(latency, second) + overhead + latency.migration_time(num_bytes)
        extra.append(second["t"] - s["t"] - charged)
    migration = max(0.0, float(np.median(extra))) if extra else 0.0
    return Calibration(overhead, scale, migration, prefill_scale)


def step_time_summary(steps: list[dict[str, Any]], latency: FittedLatencyModel, cal: Calibration) -> dict[str, Any]:
    """Median real/profile ratios per kind of step: ``step_s`` vs the profile's step time, and
    ``cycle_s`` vs what the simulator charges a step (scale x profile + runtime overhead)."""
    from simulator.latency import BatchShape

    def median(xs: list[float]) -> float:
        return float(np.median(xs)) if xs else math.nan

    out: dict[str, Any] = {}
    for kind in ("prefill", "decode", "mixed"):
        ratios, cycles, preds, first, again = [], [], [], [], []
        for s in steps:
            p, d = s["prefill_lens"], s["decode_ctx"]
            if ("mixed" if p and d else "prefill" if p else "decode") != kind:
                continue
            pred = latency.step_time(BatchShape.of(prefill_lens=p, decode_ctx_lens=d))
            ratios.append(s["step_s"] / pred)
            (first if s.get("new_shape") else again).append(s["step_s"] / pred)
            preds.append(pred)
            if s["cycle_s"] is not None:
                k = (cal.prefill_time_scale or cal.step_time_scale) if p else cal.step_time_scale
                cycles.append(s["cycle_s"] / (k * pred + cal.step_overhead_s))
        out[kind] = {
            "num_steps": len(ratios),
            "median_profile_s": median(preds),
            "median_step_over_profile": median(ratios),
            "median_cycle_over_simulated": median(cycles),
            # A token count this instance had not run before (oneDNN builds kernels per shape) vs one it had.
            "num_new_shape_steps": len(first),
            "median_step_over_profile_new_shape": median(first),
            "median_step_over_profile_seen_shape": median(again),
        }
    return out


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


def measure(args: argparse.Namespace, name: str, placement: Placement, unit: list[Request], rng: np.random.Generator,
            cache: CacheConfig, sched: SchedulerConfig, latency: FittedLatencyModel,
            ) -> tuple[dict[float, list[RequestRecord]], int, Calibration, dict[str, Any]]:
    """Deploy, warm up, calibrate the runtime constants, replay at every rate (fresh prompts each time,
    on a quiet machine: ``quietly``).

    Returns the records per rate, the KV blocks per instance, the calibration and the diagnostics
    (prefix-cache hits, others' CPU per rate, the step trace and its summary, KV migration times)."""
    from distserve.runtime.llm import DisaggLLM

    vocab = latency.model.vocab_size
    runs: dict[float, list[RequestRecord]] = {}
    cached: list[int] = []
    other_cores: dict[float, float] = {}
    migrations: dict[float, list[float]] = {}
    # The controller in this process: StepTrace instruments it.
    with DisaggLLM(args.model, placement, dtype=args.dtype, cache_config=cache, scheduler_config=sched,
                   controller_in_process=True) as llm:
        num_blocks = llm.controller.num_blocks
        trace = StepTrace(llm.controller)
        # Warm-up: first steps pay one-off costs (allocator, oneDNN primitives) the profile excluded.
        warm = fresh_prompts(unit[:2], rng, vocab)
        llm.generate([warm[r.req_id] for r in unit[:2]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        calibration, calibration_trace = solo_calibration(args, llm, trace, name, rng, latency, cache.block_size)
        # One uncounted replay first, at the highest rate: the first step of every new token count
        # costs ~25 ms more (oneDNN builds its kernels per shape; the profile times warm shapes), and
        # the measured runs replay the same prompt lengths, so they then run warm as a server does.
        warm_reqs = with_rate(unit, max(args.rate_list))
        t = time.perf_counter()
        llm._run(replay(llm.controller, warm_reqs, fresh_prompts(warm_reqs, rng, vocab), f"{name}-warm-up"))
        print(f"  {name}: warm-up replay at {max(args.rate_list)} req/s (not counted) in {time.perf_counter() - t:.1f} s", flush=True)
        for rate in args.rate_list:
            reqs = with_rate(unit, rate)
            t = time.perf_counter()

            def run_rate() -> tuple[list[RequestRecord], list[int], list[dict[str, Any]], list[float]]:
                del trace.steps[num_kept:]  # a redone run's steps are not kept
                llm.controller.migration_durations.clear()
                trace.enabled = True
                hits: list[int] = []
                records = llm._run(replay(llm.controller, reqs, fresh_prompts(reqs, rng, vocab), f"{name}-{rate}", hits))
                trace.enabled = False
                return records, hits, trace.steps[num_kept:], list(llm.controller.migration_durations)

            num_kept = len(trace.steps)
            (runs[rate], hits, _, migrations[rate]), waited, watch = quietly(args, f"{name} at {rate} req/s", run_rate)
            cached += hits
            other_cores[rate] = watch.other_cores
            print(f"  {name} at {rate} req/s: {len(reqs)} requests in {time.perf_counter() - t - waited:.1f} s "
                  f"(CPU: this run {watch.own_cores:.2f} cores, others {watch.other_cores:.2f})", flush=True)
    steps = step_time_summary(trace.steps, latency, overrides(args, calibration))
    for kind, v in steps.items():
        print(f"  {name} {kind} steps: {v['num_steps']}, real/profile step time {v['median_step_over_profile']:.2f} "
              f"(new shape {v['median_step_over_profile_new_shape']:.2f}, seen {v['median_step_over_profile_seen_shape']:.2f}), "
              f"real/simulated step cycle {v['median_cycle_over_simulated']:.2f} (medians)", flush=True)
    diagnostics = {"num_cached_prompt_tokens": int(sum(cached)), "steps": steps, "step_trace": trace.steps,
                   "other_cores": other_cores, "migration_s": migrations, "calibration_trace": calibration_trace}
    return runs, num_blocks, calibration, diagnostics


def solo_calibration(args: argparse.Namespace, llm: Any, trace: StepTrace, name: str, rng: np.random.Generator,
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
            tpots.append(llm._run(replay(llm.controller, solo, fresh_prompts(solo, rng, vocab), f"{name}-cal{i}"))[0].tpot_s)
            trace.new_run()
        trace.enabled = False
        return tpots, list(trace.steps)

    (tpots, steps), _, _ = quietly(args, f"{name} calibration", solo_run)
    trace.steps.clear()
    cal = calibrate(steps, latency, block_size)
    ctx = CALIBRATION_PROMPT + CALIBRATION_OUTPUT // 2
    step = latency.decode_time([ctx])
    print(f"  {name}: solo TPOT {1e3 * float(np.median(tpots)):.1f} ms, profile decode step {1e3 * step:.1f} ms; "
          f"calibrated: step time x{cal.step_time_scale:.3f} (prefill x{cal.prefill_time_scale or cal.step_time_scale:.3f}), runtime overhead {1e3 * cal.step_overhead_s:.1f} ms/step, "
          f"migration overhead {1e3 * cal.migration_overhead_s:.1f} ms", flush=True)
    return cal, steps


def overrides(args: argparse.Namespace, cal: Calibration) -> Calibration:
    """The calibration with the command line's fixed values in its place."""
    if args.step_overhead_ms is not None:
        cal = replace(cal, step_overhead_s=args.step_overhead_ms / 1e3)
    return cal


# ---- a quiet machine ----------------------------------------------------------------------------
def busy_pids() -> list[str]:
    """Other benchmarks that load the cores (this machine is shared): not this process, nor the
    processes that started it (a ``timeout`` or shell whose command line names this script)."""
    pids = subprocess.run(["pgrep", "-f", BUSY_PATTERN], capture_output=True, text=True).stdout.split()
    return [pid for pid in pids if int(pid) not in _ancestors()]


def _ancestors() -> set[int]:
    """This process and its parents, up to init."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state ppid
        except (OSError, ValueError, IndexError):
            break
    return out


def cpu_snapshot() -> tuple[int, int]:
    """(busy jiffies of the machine, jiffies of this process and its descendants: Ray and its actors)."""
    busy, _ = cpu_jiffies(busy=True)
    parent: dict[int, int] = {}
    used: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... utime stime cutime cstime
        except OSError:
            continue
        pid = int(entry.name)
        # Reaped children's time moves into their parent's cutime/cstime, so it stays in the tree.
        parent[pid], used[pid] = int(rest[1]), sum(int(x) for x in rest[11:15])
    mine = {os.getpid()}
    grew = True
    while grew:
        new = {pid for pid, ppid in parent.items() if ppid in mine} - mine
        mine |= new
        grew = bool(new)
    return busy, sum(used.get(pid, 0) for pid in mine)


class LoadWatch:
    """CPU used by everything but this run (cores, averaged) and other benchmarks seen, polled every
    ``period`` s in a thread while a measurement runs."""

    def __init__(self, period: float = 2.0) -> None:
        self.period = period
        self.seen: set[str] = set()
        self._other_jiffies = 0
        self._own_jiffies = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        busy, mine = cpu_snapshot()
        while True:
            self.seen.update(busy_pids())
            stopped = self._stop.wait(self.period)
            busy2, mine2 = cpu_snapshot()
            self._other_jiffies += max(0, (busy2 - busy) - max(0, mine2 - mine))
            self._own_jiffies += max(0, mine2 - mine)
            busy, mine = busy2, mine2
            if stopped:
                return

    def __enter__(self) -> "LoadWatch":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.monotonic() - self._t0

    @property
    def other_cores(self) -> float:
        return self._other_jiffies / os.sysconf("SC_CLK_TCK") / max(self.seconds, 1e-9)

    @property
    def own_cores(self) -> float:
        """CPU of this run: the controller (this process), Ray and the instances' actors."""
        return self._own_jiffies / os.sysconf("SC_CLK_TCK") / max(self.seconds, 1e-9)


def wait_for_quiet(max_wait_s: float, max_other_cores: float) -> float:
    """Seconds spent waiting until no other benchmark runs and the rest of the machine uses less
    than ``max_other_cores`` (over 5 s)."""
    t0 = time.monotonic()
    announced = False
    while time.monotonic() - t0 < max_wait_s:
        with LoadWatch(period=5.0) as watch:
            time.sleep(5.0)
        if not watch.seen and watch.other_cores < max_other_cores:
            break
        if not announced:
            print(f"  waiting for a quiet machine (others use {watch.other_cores:.1f} cores"
                  + (f"; benchmarks running: pids {', '.join(sorted(watch.seen))})" if watch.seen else ")"), flush=True)
            announced = True
        time.sleep(10)
    return time.monotonic() - t0


def quietly(args: argparse.Namespace, what: str, measure: Callable[[], T]) -> tuple[T, float, LoadWatch]:
    """``measure()`` on a quiet machine: wait for one, and redo the measurement (up to --retries
    times) when another benchmark ran or the rest of the machine used more than --max-other-cores
    meanwhile. Returns the result, the seconds waited and the CPU watch of the result kept. The
    quick run just measures (others' load is still reported)."""
    waited = 0.0
    for attempt in range(args.retries + 1):
        if args.wait_for_quiet:
            waited += wait_for_quiet(args.max_wait_s, args.max_other_cores)
        with LoadWatch() as watch:
            result = measure()
        if not args.wait_for_quiet or (not watch.seen and watch.other_cores < args.max_other_cores):
            return result, waited, watch
        again = "measuring again" if attempt < args.retries else "keeping it, marked disturbed"
        print(f"  {what}: others used {watch.other_cores:.2f} cores meanwhile"
              + (f" (benchmarks: pids {', '.join(sorted(watch.seen))})" if watch.seen else "") + f"; {again}", flush=True)
    return result, waited, watch


def from_raw(entry: dict[str, Any], latency: FittedLatencyModel,
             ) -> tuple[dict[float, list[RequestRecord]], int, Calibration, dict[str, Any]]:
    """``measure``'s results, read back from a ``validate_simulator_raw.json`` entry."""
    runs = {float(rate): [RequestRecord(**r) for r in recs] for rate, recs in entry["records"].items()}
    diagnostics = {
        "num_cached_prompt_tokens": entry.get("num_cached_prompt_tokens", 0),
        "other_cores": {float(k): v for k, v in (entry.get("other_cores") or {}).items()},
        "migration_s": {float(k): v for k, v in (entry.get("migration_s") or {}).items()},
        "step_trace": entry.get("step_trace", []),
    }
    cal = Calibration(**entry["calibration"]) if "calibration" in entry else Calibration(float(entry["step_overhead_s"]), 1.0)
    diagnostics["calibration_trace"] = entry.get("calibration_trace", [])
    return runs, int(entry["num_blocks"]), cal, diagnostics


def rel_err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas > 0 else math.nan


def main() -> None:
    args = parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wall0 = time.perf_counter()
    t = time.perf_counter()
    profile = make_profile(args)
    profile_s = time.perf_counter() - t
    if not args.profile:
        stem = "validate_simulator_profile" + ("_quick" if args.quick else "")
        (out_dir / f"{stem}.json").write_text(json.dumps(profile, indent=1) + "\n")  # reusable: --profile
    latency = FittedLatencyModel.from_profile(profile)
    fit = profile["tp"]["1"]["fit_error"]
    print(f"profile: {latency!r} fit MAPE prefill {fit['prefill_mape']:.1%} decode {fit['decode_mape']:.1%} ({profile_s:.0f} s)", flush=True)

    unit = generate_requests(lengths(args.quick), 1.0, args.num_requests, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    cache = CacheConfig(block_size=16, kv_cache_memory_gb=0.5)
    sched = SchedulerConfig()
    slo = SLOSpec(SLO(args.ttft, args.tpot, 0.9))

    slowdown = concurrent_slowdown(args, profile)
    print(f"concurrent slowdown (step-time factor while both workers compute): {slowdown:.2f}", flush=True)
    rows: list[dict[str, Any]] = []
    calibrations: dict[str, Calibration] = {}
    diagnostics: dict[str, dict[str, Any]] = {}
    raw: dict[str, Any] = {}
    earlier = json.loads(Path(args.from_raw).read_text()) if args.from_raw else None
    for name, placement in SYSTEMS.items():
        if earlier is None:
            runs, num_blocks, cal, diagnostics[name] = measure(args, name, placement, unit, rng, cache, sched, latency)
        else:
            runs, num_blocks, cal, diagnostics[name] = from_raw(earlier[name], latency)
            if args.recalibrate and diagnostics[name]["calibration_trace"]:
                cal = calibrate(diagnostics[name]["calibration_trace"], latency, cache.block_size)
            args.rate_list = list(runs)
        raw[name] = {"num_blocks": num_blocks, "calibration": asdict(cal),
                     "records": {str(rate): [asdict(r) for r in recs] for rate, recs in runs.items()},
                     **{k: diagnostics[name][k] for k in ("num_cached_prompt_tokens", "other_cores", "migration_s", "step_trace",
                                                          "calibration_trace")}}
        cal = overrides(args, cal)
        calibrations[name] = cal
        diagnostics[name]["steps"] = step_time_summary(diagnostics[name]["step_trace"], latency, cal)
        config = SimConfig(block_size=cache.block_size, scheduler=sched, prefill_scheduler=sched, decode_scheduler=sched,
                           num_blocks=num_blocks, concurrent_slowdown=slowdown, **asdict(cal))
        for rate, measured in runs.items():
            # The simulator gets the requests as they were actually submitted.
            actual = [Request(r.req_id, r.arrival_s, r.prompt_len, r.output_len) for r in sorted(measured, key=lambda r: r.arrival_s)]
            shift = actual[0].arrival_s
            actual = [Request(r.req_id, r.arrival_s - shift, r.prompt_len, r.output_len) for r in actual]
            predicted = simulate(placement, latency, actual, config)
            m, s = latency_summary(measured), latency_summary(predicted.records)
            am, ap = attainment(measured, slo), attainment(predicted.records, slo)
            row: dict[str, Any] = {"system": name, "rate": rate, "num_requests": len(measured)}
            for key in METRICS:
                row[f"measured_{key}"], row[f"predicted_{key}"] = m[key], s[key]
                row[f"error_{key}"] = rel_err(s[key], m[key])
            row["measured_attainment"], row["predicted_attainment"] = am["joint"], ap["joint"]
            row["other_cores"] = diagnostics[name]["other_cores"].get(rate, math.nan)
            migrations = diagnostics[name]["migration_s"].get(rate)
            if migrations:
                row["measured_mean_migration_s"], row["predicted_mean_migration_s"] = float(np.mean(migrations)), predicted.mean_migration_s
            rows.append(row)

    p90_errors = [abs(r[f"error_{k}"]) for r in rows for k in ("ttft_p90_s", "tpot_p90_s") if not math.isnan(r[f"error_{k}"])]
    figures = {
        "model": args.model,
        "dtype": profile["meta"].get("dtype"),
        "fit_mape": fit,
        "rates": args.rate_list,
        "num_requests_per_rate": args.num_requests,
        "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot},
        "runtime_overhead_s_per_step": {k: c.step_overhead_s for k, c in calibrations.items()},
        "calibration": {k: asdict(c) for k, c in calibrations.items()},
        "concurrent_slowdown": slowdown,
        "profile_meta": {k: profile["meta"].get(k) for k in ("concurrent_slowdown", "prefill_first_use_extra_s", "quiet_guard",
                                                             "cpu_steal_fraction", "profile_seconds")},
        "num_cached_prompt_tokens": {k: d["num_cached_prompt_tokens"] for k, d in diagnostics.items()},
        "step_times": {k: d["steps"] for k, d in diagnostics.items()},
        "max_abs_p90_error": max(p90_errors) if p90_errors else math.nan,
        "mean_abs_p90_error": float(np.mean(p90_errors)) if p90_errors else math.nan,
        "target_p90_error": 0.10,
        "rows": rows,
        "wall_s": time.perf_counter() - wall0,
    }
    write_outputs(out_dir, rows, figures, quick=args.quick)
    if earlier is None:  # the raw measurements: --from-raw simulates them again without a rerun
        stem = "validate_simulator_raw" + ("_quick" if args.quick else "")
        (out_dir / f"{stem}.json").write_text(json.dumps(raw) + "\n")
    print_table(rows)
    print(json.dumps(figures, default=float))


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{1e3 * x:.0f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="simulator vs real engine: predicted / measured (ms), relative error")
    for col in ("system", "rate", "P50 TTFT", "P90 TTFT", "P50 TPOT", "P90 TPOT", "attainment"):
        t.add_column(col, justify="right")
    for r in rows:
        cells = [f"{_ms(r[f'predicted_{k}'])} / {_ms(r[f'measured_{k}'])} ({r[f'error_{k}']:+.0%})" for k in METRICS]
        t.add_row(r["system"], f"{r['rate']:g}", *cells, f"{r['predicted_attainment']:.0%} / {r['measured_attainment']:.0%}")
    Console().print(t)


def write_outputs(out_dir: Path, rows: list[dict[str, Any]], figures: dict[str, Any], quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = "validate_simulator" + ("_quick" if quick else "")
    (out_dir / f"{stem}.json").write_text(json.dumps(figures, indent=2, default=float) + "\n")
    lines = [
        f"# Simulator vs real engine ({figures['model']}, {figures['dtype']}, this machine)",
        "",
        f"Profile fit MAPE: prefill {figures['fit_mape']['prefill_mape']:.1%}, decode {figures['fit_mape']['decode_mape']:.1%}. "
        "Solo-request calibration: "
        + "; ".join(f"{k}: step time x{c['step_time_scale']:.3f} (prefill x{c['prefill_time_scale'] or c['step_time_scale']:.3f}), runtime overhead {1e3 * c['step_overhead_s']:.1f} ms/step, "
                    f"migration overhead {1e3 * c['migration_overhead_s']:.1f} ms" for k, c in figures["calibration"].items()) + ". "
        f"Concurrent slowdown (both workers computing): {figures['concurrent_slowdown']:.2f}. "
        f"Prompt tokens served by the prefix cache: {figures['num_cached_prompt_tokens']}. "
        f"{figures['num_requests_per_rate']} requests per rate. Max |error| of P90 TTFT/TPOT: "
        f"{figures['max_abs_p90_error']:.1%} (mean {figures['mean_abs_p90_error']:.1%}; target 10%).",
        "",
        "| system | rate (req/s) | P50 TTFT ms pred/meas | P90 TTFT ms pred/meas | P50 TPOT ms pred/meas | P90 TPOT ms pred/meas "
        "| attainment pred/meas | others' CPU (cores) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [f"{_ms(r[f'predicted_{k}'])} / {_ms(r[f'measured_{k}'])} ({r[f'error_{k}']:+.0%})" for k in METRICS]
        lines.append(f"| {r['system']} | {r['rate']:g} | " + " | ".join(cells)
                     + f" | {r['predicted_attainment']:.0%} / {r['measured_attainment']:.0%} | {r.get('other_cores', math.nan):.2f} |")
    lines += ["", "Real step time / the profile's, medians (step trace; new shape = a token count the instance had not run):", "",
              "| system | kind | steps | real/profile | new shape | seen shape | real cycle / simulated step |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for system, kinds in figures["step_times"].items():
        for kind, v in kinds.items():
            if v["num_steps"]:
                lines.append(f"| {system} | {kind} | {v['num_steps']} | {v['median_step_over_profile']:.2f} "
                             f"| {v['median_step_over_profile_new_shape']:.2f} | {v['median_step_over_profile_seen_shape']:.2f} "
                             f"| {v['median_cycle_over_simulated']:.2f} |")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft_p90_s", "tpot_p90_s")):
        for system, marker in (("colocated", "o"), ("1p1d", "s")):
            sel = [r for r in rows if r["system"] == system]
            rates = [r["rate"] for r in sel]
            ax.plot(rates, [1e3 * r[f"measured_{metric}"] for r in sel], marker=marker, label=f"{system} measured")
            ax.plot(rates, [1e3 * r[f"predicted_{metric}"] for r in sel], marker=marker, linestyle="--", label=f"{system} simulated")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"{metric[:4].upper()} P90 (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / f"{stem}.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
