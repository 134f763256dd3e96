"""The shape of vLLM v0.2.3's Ray control plane per engine step: fixed per call, per sequence, per token (issue 18).

vLLM v0.2.3 (the vLLM DistServe compared against) runs every tensor-parallel worker of a TP > 1 instance as a Ray
actor, and each engine step its driver calls ``_run_workers("execute_model", seq_group_metadata_list=...,
blocks_to_swap_in=..., blocks_to_swap_out=..., blocks_to_copy=...)``: one ``worker.execute_method.remote(...)`` per
worker, one after another (Ray pickles the arguments anew for each call), then ``ray.get`` of all the outputs (every
worker returns the sampler output of every sequence) and ``assert output == other_output`` for each other worker.
``fit_ray_control_plane.py`` fitted that cost to vLLM PR #2221's LLaMA-70B TP8 before/after throughputs (~256
sequences a step) in two forms, 6.4 ms per step per worker or 0.071 ms per sequence per worker, which differ ~10x at
the 5-30 sequences of a code-completion step. This benchmark measures the missing shape with real Ray on this machine:

* the step contract as plain classes, shaped as vLLM v0.2.x's ``vllm/sequence.py`` and ``vllm/sampling_params.py``
  (``SequenceGroupMetadata`` with its ``SequenceData`` and ``SamplingParams`` and a block table per sequence; the
  output a ``SequenceGroupOutput`` of one ``SequenceOutput`` with one logprob per sequence), pickled by reference as
  vLLM's are (the actors import this file as a module);
* W actors that do no model work: ``execute_model`` builds and returns the sampler output;
* the driver's step as v0.2.3's loop, timed on the driver's wall clock, for W workers, N sequences per decode step
  and L tokens per sequence (prompt + generated so far; a block table of ceil(L/16) blocks);
* the fit per step = W * (a + b*N + c*N*L) (non-negative least squares on the medians, absolute and relative), and
  its translation to the PR's scale: k such that k * (a + b*256 + c*256*L_pr) = 6.4 ms (``VLLM_RAY_STEP_S``),
  then the implied cost per worker per step at code completion's batches. k absorbs the CPU (and Ray version)
  difference between this machine and the PR's and assumes the shape is the same there.

Configurations are interleaved (a shuffled order each round) and every step is timed; the medians are fitted.

    python experiments/bench_ray_step_calls.py           # W 1,2,4 x N 1..256 x L 200,1000 (~4 min)
    python experiments/bench_ray_step_calls.py --quick   # W 1,2 x N 1,16 x L 200, few steps (< 30 s)
"""

from __future__ import annotations

import math
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import harness
from distserve.cli.arg_types import positive_int

# The actors unpickle the step's objects by this module name (Ray puts the script's folder on their sys.path), as
# v0.2.3's workers import ``vllm.sequence``: pickled by reference, not by value as cloudpickle would a __main__ class.
MODULE = "bench_ray_step_calls"
BLOCK_SIZE = 16  # v0.2.3's default --block-size
VOCAB = 32000  # LLaMA's: token ids below 65536 pickle as 3 bytes
NUM_GPU_BLOCKS = 8000  # block ids drawn below this (LLaMA-70B TP8 on A100-40G holds a few thousand)
RAY_INLINE_BYTES = 100 * 1024  # Ray's max_direct_call_object_size: bigger arguments go through the object store
PR = "vllm-project/vllm#2221"
PR_NUM_SEQS = 256  # v0.2.3's --max-num-seqs, the PR's batches
CODE_NUM_SEQS = (4, 8, 16, 32)  # OPT-66B code completion at TP4: ~5-30 sequences a step
CODE_LEN = 200  # HumanEval: prompt ~150 + output ~100, a decode step holds ~ prompt + half the output


# ---- vLLM v0.2.x's step contract (vllm/sampling_params.py, vllm/sequence.py) --------------------------------------
class SamplingParams:
    """v0.2.3's fields (its __init__ arguments, defaults as there; a ShareGPT-style sampled request)."""

    def __init__(self, n: int = 1, temperature: float = 0.8, top_p: float = 0.95, max_tokens: int = 512) -> None:
        self.n = n
        self.best_of = n
        self.presence_penalty = 0.0
        self.frequency_penalty = 0.0
        self.repetition_penalty = 1.0
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = -1
        self.use_beam_search = False
        self.length_penalty = 1.0
        self.early_stopping: bool | str = False
        self.stop: list[str] = []
        self.stop_token_ids: list[int] = []
        self.ignore_eos = False
        self.max_tokens = max_tokens
        self.logprobs: int | None = None
        self.prompt_logprobs: int | None = None
        self.skip_special_tokens = True
        self.spaces_between_special_tokens = True


class SequenceData:
    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.cumulative_logprob = 0.0


class SequenceGroupMetadata:
    def __init__(self, request_id: str, is_prompt: bool, seq_data: dict[int, SequenceData], sampling_params: SamplingParams,
                 block_tables: dict[int, list[int]]) -> None:
        self.request_id = request_id
        self.is_prompt = is_prompt
        self.seq_data = seq_data
        self.sampling_params = sampling_params
        self.block_tables = block_tables


class SequenceOutput:
    def __init__(self, parent_seq_id: int, output_token: int, logprobs: dict[int, float]) -> None:
        self.parent_seq_id = parent_seq_id
        self.output_token = output_token
        self.logprobs = logprobs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceOutput):
            return NotImplemented  # (vLLM v0.2.x raised NotImplementedError here; only same-type outputs are compared)
        return (self.parent_seq_id == other.parent_seq_id and self.output_token == other.output_token
                and self.logprobs == other.logprobs)


class SequenceGroupOutput:
    def __init__(self, samples: list[SequenceOutput], prompt_logprobs: list[dict[int, float] | None] | None) -> None:
        self.samples = samples
        self.prompt_logprobs = prompt_logprobs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceGroupOutput):
            return NotImplemented  # (vLLM v0.2.x raised NotImplementedError here; only same-type outputs are compared)
        return self.samples == other.samples and self.prompt_logprobs == other.prompt_logprobs


def sampler_output(seq_group_metadata_list: list[SequenceGroupMetadata]) -> list[SequenceGroupOutput]:
    """What every worker returns: one sampled token (deterministic, so all workers agree) with its logprob per sequence."""
    out = []
    for group in seq_group_metadata_list:
        samples = []
        for seq_id, data in group.seq_data.items():
            last = data.output_token_ids[-1] if data.output_token_ids else data.prompt_token_ids[-1]
            token = (last * 31 + 7) % VOCAB
            samples.append(SequenceOutput(seq_id, token, {token: -0.25 - (token % 97) / 100}))
        out.append(SequenceGroupOutput(samples, None))
    return out


class StepWorker:
    """A tensor-parallel worker without a model: v0.2.3's ``RayWorkerVllm.execute_method`` and the step's output."""

    def execute_method(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)

    def execute_model(self, seq_group_metadata_list: list[SequenceGroupMetadata], blocks_to_swap_in: dict[int, int],
                      blocks_to_swap_out: dict[int, int], blocks_to_copy: dict[int, list[int]]) -> list[SequenceGroupOutput]:
        return sampler_output(seq_group_metadata_list)

    def ready(self) -> bool:
        return True


for _cls in (SamplingParams, SequenceData, SequenceGroupMetadata, SequenceOutput, SequenceGroupOutput, StepWorker):
    _cls.__module__ = MODULE
if __name__ != MODULE:  # run as the script: pickle finds the classes under the module name the actors import
    sys.modules.setdefault(MODULE, sys.modules[__name__])


# ---- one step ----------------------------------------------------------------------------------------------------
def decode_batch(num_seqs: int, seq_len: int, rng: random.Random) -> list[SequenceGroupMetadata]:
    """``num_seqs`` single-sequence requests at a decode step, each holding ``seq_len`` tokens (a third generated)."""
    num_output = seq_len // 3
    batch = []
    for i in range(num_seqs):
        data = SequenceData([rng.randrange(VOCAB) for _ in range(seq_len - num_output)])
        data.output_token_ids = [rng.randrange(VOCAB) for _ in range(num_output)]
        data.cumulative_logprob = -0.7 * num_output
        blocks = [rng.randrange(NUM_GPU_BLOCKS) for _ in range(math.ceil(seq_len / BLOCK_SIZE))]
        batch.append(SequenceGroupMetadata(f"cmpl-{uuid.UUID(int=rng.getrandbits(128)).hex}", False, {i: data}, SamplingParams(),
                                           {i: blocks}))
    return batch


def run_step(workers: list[Any], batch: list[SequenceGroupMetadata]) -> list[SequenceGroupOutput]:
    """v0.2.3's ``LLMEngine._run_workers("execute_model", ...)`` with Ray workers."""
    import ray

    refs = [w.execute_method.remote("execute_model", seq_group_metadata_list=batch, blocks_to_swap_in={},
                                    blocks_to_swap_out={}, blocks_to_copy={}) for w in workers]
    outputs = ray.get(refs)
    output = outputs[0]
    for other in outputs[1:]:
        assert output == other
    return output  # type: ignore[no-any-return]


# ---- measurement and fit ------------------------------------------------------------------------------------------
Config = tuple[int, int, int]  # (workers, sequences, tokens per sequence)


def measure(workers: list[Any], configs: list[Config], rounds: int, steps: int, warmup: int, seed: int) -> tuple[dict[Config, list[float]], list[float]]:
    """Every config's step times (s): ``rounds`` rounds, each running ``steps`` steps of every config in a new
    shuffled order, after ``warmup`` untimed steps each. Also the cores others used, per round."""
    rng = random.Random(seed)
    batches = {(n, length): decode_batch(n, length, rng) for _, n, length in configs}
    for w, n, length in configs:
        for _ in range(warmup):
            run_step(workers[:w], batches[n, length])
    times: dict[Config, list[float]] = {c: [] for c in configs}
    others = []
    for r in range(rounds):
        order = list(configs)
        rng.shuffle(order)
        with harness.LoadWatch(period=None) as watch:  # no polling thread: it would disturb the timings
            for w, n, length in order:
                batch, ws = batches[n, length], workers[:w]
                for _ in range(steps):
                    t0 = time.perf_counter()
                    run_step(ws, batch)
                    times[w, n, length].append(time.perf_counter() - t0)
        others.append(watch.other_cores)
        print(f"  round {r + 1}/{rounds}: {watch.seconds:.1f} s, others used {watch.other_cores:.2f} cores", flush=True)
    return times, others


def fit(medians: dict[Config, float], relative: bool, step_term: bool = False) -> dict[str, Any]:
    """Non-negative least squares of step (ms) = W * (a + b*N + c*N*L), plus d once per step with ``step_term``;
    ``relative``: residuals relative to the median."""
    import numpy as np
    from scipy.optimize import nnls

    configs = sorted(medians)
    x = np.array([[w, w * n, w * n * length, 1.0 if step_term else 0.0] for w, n, length in configs], float)
    y = np.array([medians[c] * 1e3 for c in configs])
    scale = 1 / y if relative else np.ones_like(y)
    (a, b, c, d), _ = nnls(x * scale[:, None], y * scale)
    pred = x @ np.array([a, b, c, d])
    resid = y - pred
    return {"a_ms": float(a), "b_ms": float(b), "c_ms": float(c), "d_ms": float(d), "weighting": "relative" if relative else "absolute",
            "rms_residual_ms": float(np.sqrt(np.mean(resid ** 2))), "rms_relative_residual": float(np.sqrt(np.mean((resid / y) ** 2))),
            "max_abs_relative_residual": float(np.max(np.abs(resid / y))),
            "residuals": {key(cfg): {"measured_ms": round(float(m), 4), "fit_ms": round(float(p), 4), "relative": round(float(r / m), 3)}
                          for cfg, m, p, r in zip(configs, y, pred, resid)}}


def per_worker_ms(f: dict[str, Any], n: int, length: float) -> float:
    return float(f["a_ms"] + f["b_ms"] * n + f["c_ms"] * n * length)


def key(cfg: Config) -> str:
    return f"W{cfg[0]} N{cfg[1]} L{cfg[2]}"


def step_weighted_len(workload: str, num_requests: int) -> dict[str, float]:
    """Mean tokens a sequence holds at a decode step in ``workload`` (the project's length distribution, 2048 context):
    weighted by steps, so long outputs count for the many steps they run; and the naive prompt + half the output."""
    from simulator.workload import generate_requests

    reqs = generate_requests(workload, 1.0, num_requests, seed=0, max_total_len=2048)
    steps = sum(r.output_len - 1 for r in reqs)  # the first output token comes from the prompt step
    held = sum(r.prompt_len * (r.output_len - 1) + (r.output_len - 1) * r.output_len / 2 for r in reqs) / steps
    prompt = statistics.fmean(r.prompt_len for r in reqs)
    output = statistics.fmean(r.output_len for r in reqs)
    return {"step_weighted": round(held, 1), "prompt_plus_half_output": round(prompt + output / 2, 1),
            "mean_prompt": round(prompt, 1), "mean_output": round(output, 1)}


def ray_processes(temp_dir: str) -> list[str]:
    """Pids of processes whose command line names this run's Ray temp dir (its raylet, GCS, workers)."""
    out = subprocess.run(["pgrep", "-f", temp_dir], capture_output=True, text=True).stdout.split()
    return [p for p in out if int(p) != os.getpid()]


# ---- main --------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = harness.parser(__doc__, "W 1,2 x N 1,16 x L 200, 5 rounds of 8 steps (< 30 s)")
    ap.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds (default 20; --quick 5)")
    ap.add_argument("--steps", type=positive_int, default=None, help="steps of each configuration per round (default 10; --quick 8)")
    args = ap.parse_args()
    out = harness.Outputs.for_run(args, "bench_ray_step_calls")
    ws: tuple[int, ...]
    ns: tuple[int, ...]
    ls: tuple[int, ...]
    if args.quick:
        ws, ns, ls, rounds, steps, warmup = (1, 2), (1, 16), (200,), 5, 8, 3
    else:
        ws, ns, ls, rounds, steps, warmup = (1, 2, 4), (1, 4, 16, 64, 256), (200, 1000), 20, 10, 5
    rounds, steps = args.rounds or rounds, args.steps or steps
    configs = [(w, n, length) for w in ws for n in ns for length in ls]
    t_start = time.perf_counter()
    loop_ns = harness.python_loop_ns(repeats=2 if args.quick else 5)

    import ray

    from distserve.runtime.ray_env import init_ray_local

    # Ray starts as many idle Python workers as CPUs for the first driver; on 2 shared cores those 8 starts take
    # longer than the benchmark, and our actors get processes of their own anyway.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    temp_dir = tempfile.mkdtemp(prefix="rayb_")
    left: list[str] = []
    try:
        init_ray_local(temp_dir)  # loopback only, 8 CPUs, no dashboard, RAY_AUTH_MODE=disabled
        actor: Any = ray.remote(num_cpus=0.01)(StepWorker)
        workers = [actor.remote() for _ in range(max(ws))]
        ray.get([w.ready.remote() for w in workers])
        print(f"Ray and {len(workers)} actors up after {time.perf_counter() - t_start:.1f} s", flush=True)
        check = run_step(workers[:2], decode_batch(2, 40, random.Random(1)))
        assert len(check) == 2 and type(check[0]).__module__ == MODULE  # unpickled by reference
        times, others = measure(workers, configs, rounds, steps, warmup, seed=0)
    finally:
        ray.shutdown()
        for _ in range(20):  # Ray's processes exit shortly after shutdown
            left = ray_processes(temp_dir)
            if not left:
                break
            time.sleep(0.5)
        shutil.rmtree(temp_dir, ignore_errors=True)
        print(f"Ray shut down after {time.perf_counter() - t_start:.1f} s", flush=True)
    if left:
        print(f"WARNING: {len(left)} Ray processes of this run survived shutdown: {left}", file=sys.stderr)

    medians = {c: statistics.median(t) for c, t in times.items()}
    mins = {c: min(t) for c, t in times.items()}
    rng = random.Random(0)
    payload = {}
    for _, n, length in configs:
        batch = decode_batch(n, length, rng)
        kwargs = {"seq_group_metadata_list": batch, "blocks_to_swap_in": {}, "blocks_to_swap_out": {}, "blocks_to_copy": {}}
        payload[n, length] = (len(pickle.dumps(kwargs, protocol=5)), len(pickle.dumps(sampler_output(batch), protocol=5)))
    # The medians fitted both ways, and the minima (the machine with the least interference from others' load).
    fits = {"relative": fit(medians, True), "absolute": fit(medians, False), "relative_on_min": fit(mins, True)}
    # Diagnostic: how much of a step is paid once rather than per worker (the last call's round trip, ray.get).
    with_step = fit(medians, True, step_term=True)
    head = fits["relative"]  # the small steps (code completion's) matter: residuals relative to each step

    # Translation to the PR's scale.
    from distserve_setting import VLLM_RAY_SEQ_S, VLLM_RAY_STEP_S

    target_ms = VLLM_RAY_STEP_S * 1e3
    num_requests = 4000 if args.quick else 20000
    sharegpt, code = step_weighted_len("chatbot", num_requests), step_weighted_len("code", num_requests)
    pr_len = 450  # ShareGPT first turns, weighted by decode steps (the workload gives sharegpt["step_weighted"])
    translation: dict[str, Any] = {}
    for weighting, f in fits.items():
        k = target_ms / per_worker_ms(f, PR_NUM_SEQS, pr_len)
        at_code: dict[str, dict[str, float]] = {}
        for n in CODE_NUM_SEQS:
            raw = per_worker_ms(f, n, CODE_LEN)
            at_code[str(n)] = {"raw_ms": round(raw, 4), "scaled_ms": round(k * raw, 3), "fixed_form_ms": target_ms,
                            "per_seq_form_ms": round(VLLM_RAY_SEQ_S * 1e3 * n, 3), "fixed_fraction": round(f["a_ms"] / raw, 3)}
        translation[weighting] = {
            "k": round(k, 3), "scaled_a_ms": round(k * f["a_ms"], 4), "scaled_b_ms": round(k * f["b_ms"], 5),
            "scaled_c_us_per_token": round(k * f["c_ms"] * 1e3, 6),
            "scaled_seq_ms_at_code_len": round(k * (f["b_ms"] + f["c_ms"] * CODE_LEN), 5), "code_completion": at_code,
            # k and the code-completion cost at the other readings of L_pr: sensitivity to the assumption
            "sensitivity": {f"L_pr={lp:g}": {"k": round(target_ms / per_worker_ms(f, PR_NUM_SEQS, lp), 3),
                                             "scaled_ms_N16": round(target_ms / per_worker_ms(f, PR_NUM_SEQS, lp) * per_worker_ms(f, 16, CODE_LEN), 3)}
                            for lp in (sharegpt["prompt_plus_half_output"], sharegpt["step_weighted"], 450)},
        }
    fixed_fraction = {f"N{n} L{length}": round(head["a_ms"] / per_worker_ms(head, n, length), 3) for n in (16, 256) for length in ls}
    w_max = max(ws)
    # Measured alone: the W-max step at N=1 (almost all fixed) over the step at N; no fit involved.
    measured_fixed = {f"N{n} L{length}": round(medians[w_max, 1, length] / medians[w_max, n, length], 3)
                      for n in ns if n > 1 for length in ls}

    figures: dict[str, Any] = {
        "quick": args.quick, "ray_version": ray.__version__, "python": sys.version.split()[0], "python_loop_ns": round(loop_ns, 2),
        "cpu_count": os.cpu_count(), "workers": list(ws), "num_seqs": list(ns), "seq_lens": list(ls), "rounds": rounds,
        "steps_per_round": steps, "num_steps_per_config": rounds * steps,
        "others_cores_mean": round(statistics.fmean(others), 3), "others_cores_max": round(max(others), 3),
        "median_ms": {key(c): round(m * 1e3, 4) for c, m in medians.items()},
        "min_ms": {key(c): round(m * 1e3, 4) for c, m in mins.items()},
        "payload_bytes_per_call": {f"N{n} L{length}": p for (n, length), p in payload.items()},
        "fit": {"model": "step_ms = W * (a + b*N + c*N*L)", **fits, "relative_with_step_term": with_step}, "a_ms": round(head["a_ms"], 5), "b_ms": round(head["b_ms"], 6),
        "c_us_per_token": round(head["c_ms"] * 1e3, 7),
        f"fixed_fraction_W{w_max}": fixed_fraction, f"measured_fixed_fraction_W{w_max}": measured_fixed,
        "pr": {"source": PR, "target_ms_per_worker": target_ms, "num_seqs": PR_NUM_SEQS, "seq_len": pr_len,
               "sharegpt_len": sharegpt, "code_len": CODE_LEN, "code_workload_len": code},
        "translation": translation, "ray_processes_left": len(left),
    }
    figures["wall_s"] = round(time.perf_counter() - t_start, 1)

    rows = [[str(w), str(n), str(length), f"{medians[w, n, length] * 1e3:.3f}", f"{mins[w, n, length] * 1e3:.3f}",
             f"{head['residuals'][key((w, n, length))]['fit_ms']:.3f}", f"{head['residuals'][key((w, n, length))]['relative']:+.2f}",
             f"{payload[n, length][0] / 1024:.1f}"] for w, n, length in configs]
    cols = ["W", "N", "L", "median ms", "min ms", "fit ms", "resid", "args KiB"]
    harness.rich_table("driver wall time per decode step (v0.2.3's _run_workers over Ray)", cols, rows)
    tr = translation["relative"]
    code_rows = [[str(n), f"{r['raw_ms']:.3f}", f"{r['scaled_ms']:.2f}", f"{r['fixed_fraction']:.2f}", f"{r['fixed_form_ms']:.1f}",
                  f"{r['per_seq_form_ms']:.2f}"] for n, r in tr["code_completion"].items()]
    code_cols = ["N", "this machine ms", "scaled ms", "fixed share", "fixed form ms", "per-seq form ms"]
    harness.rich_table(f"per worker per step at L={CODE_LEN} (k={tr['k']:.2f})", code_cols, code_rows)
    note = (f"k = {tr['k']:.2f} absorbs the CPU (and Ray version) difference between this machine and the PR's, and assumes "
            f"the same shape (fixed : per sequence : per token) there.")
    print(note)

    f_abs, f_min = fits["absolute"], fits["relative_on_min"]
    lines = [
        "# vLLM v0.2.3's Ray control plane per step: fixed vs per sequence vs per token", "",
        f"Ray {ray.__version__}, Python {figures['python']}, {os.cpu_count()} cores shared with other work (others used "
        f"{figures['others_cores_mean']:.2f} cores on average, at most {figures['others_cores_max']:.2f}, per round); pure-Python loop "
        f"{loop_ns:.1f} ns/iteration (`harness.python_loop_ns`). {rounds} interleaved rounds x {steps} steps per configuration "
        f"({rounds * steps} steps each) after {warmup} warm-up steps; the driver's wall time of v0.2.3's `_run_workers(\"execute_model\", ...)`: "
        f"W `execute_method.remote` calls (arguments pickled per call), `ray.get` of all, `assert output == other_output`. "
        f"Decode steps of N single-sequence requests holding L tokens each (a third generated), ceil(L/16) blocks each; "
        f"the actors do no model work and return one `SequenceOutput` (one logprob) per sequence.", "",
        f"**Fit** (non-negative least squares on the medians, residuals relative to each median): step = W x (a + b N + c N L), "
        f"**a = {head['a_ms']:.3f} ms per call, b = {head['b_ms'] * 1e3:.2f} us per sequence, c = {head['c_ms'] * 1e6:.2f} ns per "
        f"token** (rms relative residual {head['rms_relative_residual']:.3f}, max {head['max_abs_relative_residual']:.3f}). "
        f"With absolute residuals: a = {f_abs['a_ms']:.3f} ms, b = {f_abs['b_ms'] * 1e3:.2f} us, c = {f_abs['c_ms'] * 1e6:.2f} ns "
        f"(rms relative residual {f_abs['rms_relative_residual']:.3f}, rms {f_abs['rms_residual_ms']:.3f} ms). On the minima "
        f"(relative): a = {f_min['a_ms']:.3f} ms, b = {f_min['b_ms'] * 1e3:.2f} us, c = {f_min['c_ms'] * 1e6:.2f} ns "
        f"(rms relative residual {f_min['rms_relative_residual']:.3f}). Mean relative residual by W: " + ", ".join(
            f"W{w} {statistics.fmean(head['residuals'][key((w, n, length))]['relative'] for n in ns for length in ls):+.2f}" for w in ws)
        + f". With a term d paid once per step, d + W x (a + b N + c N L) fits the medians with d = {with_step['d_ms']:.3f} ms, "
        f"a = {with_step['a_ms']:.3f} ms, b = {with_step['b_ms'] * 1e3:.2f} us, c = {with_step['c_ms'] * 1e6:.2f} ns (rms relative "
        f"residual {with_step['rms_relative_residual']:.3f}); the translation below keeps the per-worker form, as the PR's fit has it.", "",
        f"Fixed share of a step (a over a + bN + cNL, any W): " + ", ".join(f"{k2} {v:.2f}" for k2, v in fixed_fraction.items())
        + f". Measured without the fit (the W{w_max} step at N=1 over the W{w_max} step at N): "
        + ", ".join(f"{k2} {v:.2f}" for k2, v in measured_fixed.items()) + ".", "",
        "| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [
        "", "*args KiB*: the call's keyword arguments pickled (protocol 5), once per worker; above "
        f"{RAY_INLINE_BYTES // 1024} KiB Ray passes them through its object store instead of inline.", "",
        f"## At the PR's scale ({PR})", "",
        f"k such that k x (a + b x {PR_NUM_SEQS} + c x {PR_NUM_SEQS} x {pr_len}) = {target_ms:g} ms per worker per step "
        f"(`fit_ray_control_plane.py`'s fixed form). L_pr = {pr_len}: ShareGPT first turns (prompt ~{sharegpt['mean_prompt']:.0f}, "
        f"output ~{sharegpt['mean_output']:.0f} tokens in the project's `chatbot` lengths) held at a decode step, weighted by "
        f"steps (a long output runs many steps): {sharegpt['step_weighted']:.0f}; the unweighted prompt + half the output is "
        f"{sharegpt['prompt_plus_half_output']:.0f}. Code completion: L = {CODE_LEN} (HumanEval prompt ~150 + half an output of "
        f"~100; the `code` lengths give {code['step_weighted']:.0f} weighted by steps). **k = {tr['k']:.2f}** absorbs the CPU "
        f"(and Ray version) difference between this machine and the PR's and assumes the same shape there; in those units "
        f"a = {tr['scaled_a_ms']:.3f} ms per worker per step and {tr['scaled_seq_ms_at_code_len']:.4f} ms per sequence of "
        f"{CODE_LEN} tokens.", "",
        "| " + " | ".join(code_cols) + " |", "|" + "---:|" * len(code_cols)]
    lines += ["| " + " | ".join(r) + " |" for r in code_rows]
    lines += ["", "Sensitivity to L_pr (k; scaled cost at N=16): " + "; ".join(
        f"{lp} k={v['k']:.2f}, {v['scaled_ms_N16']:.2f} ms" for lp, v in tr["sensitivity"].items())
        + ". The other fits: " + "; ".join(
            f"{name} k={t['k']:.2f}, N=16 {t['code_completion']['16']['scaled_ms']:.2f} ms (fixed share {t['code_completion']['16']['fixed_fraction']:.2f})"
            for name, t in translation.items() if name != "relative") + ".", "",
        "Caveats: 2 shared cores, so the actors' unpickling and output pickling compete with the driver (at W=4 four actors "
        "share the cores with it; on a TP host each actor has its own core); Ray "
        f"{ray.__version__} here against the Ray 2.x of late 2023 (its 100 KiB inline limit is the same); the classes carry the "
        "fields and `__eq__` of vLLM v0.2.x's `vllm/sequence.py` and `vllm/sampling_params.py` (read in v0.2.x-era copies, "
        "not the v0.2.3 tag), none of their other methods; the fit charges the actors' share (unpickling the call, "
        "returning the output) per worker, as `fit_ray_control_plane.py`'s forms do.", ""]
    out.json(figures)
    out.markdown(lines)
    harness.finish(figures)


if __name__ == "__main__":
    main()
