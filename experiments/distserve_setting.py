"""What DistServe's evaluation ran, as constants with their sources, and seeded request streams of its
workloads: shared by ``distserve_ablation.py`` and ``distserve_table.py``.

Sources are files of the LLMServe/DistServe repository (DistServe, OSDI'24):

* ``evaluation/2-benchmark-serving/2-start-api-server.py`` launches the real comparison. Its
  ``MODEL_TO_PARALLEL_PARAMS`` holds ONE layout per model, used for every dataset: vLLM's tensor
  parallelism and DistServe's (context_tp, context_pp, decoding_tp, decoding_pp). vLLM runs with
  ``--max-num-seqs 1024 --max-num-batched-tokens 16384 --gpu-memory-utilization 0.95``; DistServe's
  prefill instance with a batch cap of 128 sequences / 8192 tokens, its decode instance 1024 / 65536,
  also at 0.95 of GPU memory.
* ``simdistserve/estimators/profile_data/profiler-a100-80g.vllm.json``: DistServe's fitted step
  times of vLLM (the baseline's engine), OPT-13B at TP 1, 2, 4 and OPT-66B at TP 2, 3, 4; copied
  verbatim to ``simulator/data/distserve-a100-80g-vllm-profile.json`` (``VLLM_A100_PROFILE``).
  There are none for OPT-175B.
* ``simdistserve/benchmarks/alignment/data-ground-truth/opt-13b-sharegpt/vllm-*.exp``: DistServe's
  measured vLLM traces (``REAL_VLLM_TRACE``, ``VLLM_STEP_OVERHEAD_S``).
* ``evaluation/ae-scripts/e2e/_plot.py`` (``EVAL_PLOT_SCRIPT``) draws figures 8 and 9 from the runs: the
  attainment counts a request only if it meets both SLOs (``MODE = "joint"``), and each measured rate is
  one run of 25-100 prompts per GPU (``Row.eval_prompts_per_gpu``), far shorter than our 300.

DistServe's paper (Table 3) gives per-application layouts for OPT-66B code completion and
summarisation; the repository does not hold them (searched: the launch script, ``ae-scripts``,
``simdistserve/benchmarks``), so ``PUBLISHED_LAYOUTS`` has only what the repository publishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from simulator.workload import Request, generate_requests, rescale

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_SCRIPT = "LLMServe/DistServe evaluation/2-benchmark-serving/2-start-api-server.py"
EVAL_PLOT_SCRIPT = "LLMServe/DistServe evaluation/ae-scripts/e2e/_plot.py"  # draws DistServe's figures 8-10 from its runs

# model -> (vLLM's tp, DistServe's (prefill tp, prefill pp, decode tp, decode pp)), MODEL_TO_PARALLEL_PARAMS of LAUNCH_SCRIPT.
PARALLEL_PARAMS: dict[str, tuple[int, tuple[int, int, int, int]]] = {
    "facebook/opt-13b": (1, (2, 1, 1, 1)),
    "facebook/opt-66b": (4, (4, 1, 2, 2)),
    "facebook/opt-175b": (8, (3, 3, 4, 3)),
}
Limits = tuple[int, int]  # (max_num_seqs, max_num_batched_tokens)
VLLM_LIMITS: Limits = (1024, 16384)  # vLLM's --max-num-seqs, --max-num-batched-tokens
DISTSERVE_PREFILL_LIMITS: Limits = (128, 8192)  # --context-max-batch-size, --context-max-tokens-per-batch
DISTSERVE_DECODE_LIMITS: Limits = (1024, 65536)  # --decoding-max-batch-size, --decoding-max-tokens-per-batch
# DistServe's goodput: the rate at which 90% of requests meet both SLOs (``joint``). Its plotting script
# (``EVAL_PLOT_SCRIPT``, ``get_attainment``) counts a request only if ``ftl <= ttft_slo and
# tpot <= tpot_slo`` and reads the goodput where that share crosses 90% (linear between measured rates).
ATTAINMENT, MODE = 0.9, "joint"
EVAL_MEM_UTILIZATION = 0.95  # --gpu-memory-utilization of both

DATA_DIR = ROOT / "simulator" / "data"  # DistServe's published profiles and traces (its README says where each comes from)
VLLM_A100_PROFILE = DATA_DIR / "distserve-a100-80g-vllm-profile.json"
# vLLM's per-step cost beyond its fitted step time: DistServe's real vLLM traces show TPOT 25-38 ms at light load
# where the fitted decode step is ~20 ms (OPT-13B, TP1).
VLLM_STEP_OVERHEAD_S = 0.006
# What makes our simulator replay DistServe's real traces best (``DATA_DIR``: OPT-13B, vLLM at TP1, DistServe at P TP2 /
# D TP1): each engine's overhead per step and per sequence in a step, and vLLM's KV cache as its busiest trace shows it
# (``align_real_traces.py``; its results: experiments/results/align_real_traces.md).
ALIGNED_OVERHEADS_S = {"vllm": (0.008, 0.0004), "distserve": (0.004, 0.0001)}  # system -> (per step, per sequence in a step)
ALIGNED_VLLM_KV_SHARE = 0.82  # vLLM's KV cache in its busiest trace over what our memory model gives it (align_real_traces.py)
# Each engine's prompt steps x this (align_real_traces.py fits it with the overheads): vLLM's profile times OPT-13B's
# TP1 prompts at 1.43x DistServe's profile (1.05-1.07x at TP2, 1.03-1.28x for OPT-66B at TP4), and its light-load trace
# (vllm-100-1) says too slow: a 1717-token prompt took 263 ms to its first token, the profile's prefill alone 309 ms.
# vLLM's scale applies only where the traces measured it: ``FITTED_VLLM`` (model, TP).
ALIGNED_PREFILL_SCALE = {"vllm": 0.8, "distserve": 1.0}
FITTED_VLLM = ("facebook/opt-13b", 1)
# DistServe's vLLM is v0.2.3 (its evaluation README), where an instance of TP > 1 drives each worker, a Ray actor, by a Ray
# call per step (vLLM PR #2221 removed that in v0.2.7); its TP1 traces above cannot show the cost. Fitted to the PR's
# LLaMA-70B TP8 before/after throughputs (``fit_ray_control_plane.py``; experiments/results/fit_ray_control_plane.md), in
# two forms: per step per TP worker (the better on the PR's second benchmark), or per sequence in the step per TP worker.
VLLM_RAY_STEP_S = 0.0064
VLLM_RAY_SEQ_S = 0.000071
# A third form, per worker: a fixed cost per call + one per sequence (holding ShareGPT's ~440 tokens), in the shape
# ``bench_ray_step_calls.py`` measured with real Ray actors, scaled by one factor fitted as above. (per step, per sequence)
VLLM_RAY_MEASURED_S = (0.001144, 0.0000585)  # k = 0.59; the PR's second benchmark fits it worst (31% off)
# Read off DistServe's measured vLLM trace (not simulated here).
REAL_VLLM_TRACE = (
    "DistServe's own measurement of vLLM (OPT-13B, one TP1 A100, ShareGPT, 1 req/s: "
    "`simdistserve/benchmarks/alignment/data-ground-truth/opt-13b-sharegpt/vllm-100-1.exp`, its first 65 requests): 10 take "
    "longer than 250 ms to the first token (85% attainment, below the 90% target even at 1 req/s); a 1316-token prompt "
    "220 ms, 1717 tokens 263 ms, with little queueing; TPOT 25-38 ms where the fitted decode step is ~20 ms (hence the 6 ms overhead).")

_STREAMS: dict[tuple[str, int, int, int, int], list[Request]] = {}


def request_stream(workload: str, num_requests: int, stream_len: int, seed: int, max_total_len: int = 2048) -> list[Request]:
    """The first ``num_requests`` of one seeded stream of ``stream_len`` requests of ``workload``, rescaled
    to exactly 1 request/s: smaller workloads are prefixes of larger ones, so placements of different
    sizes, given requests in proportion to their GPUs, are simulated for the same time at equal per-GPU rates."""
    key = (workload, num_requests, stream_len, seed, max_total_len)
    if key not in _STREAMS:
        stream = generate_requests(workload, 1.0, max(stream_len, num_requests), seed=seed, max_total_len=max_total_len)
        _STREAMS[key] = rescale(stream[:num_requests], 1.0) if num_requests > 1 else stream[:num_requests]
    return _STREAMS[key]


# The rows of DistServe's evaluation: its Table 1 SLOs and the goodput ratios over vLLM it published.
@dataclass(frozen=True)
class Row:
    key: str
    model: str
    workload: str
    application: str
    ttft_s: float  # DistServe's Table 1
    tpot_s: float
    published: tuple[float, float]  # DistServe's goodput ratio vs vLLM (a range for chatbots: per-model values not given)
    plan_nodes: int  # nodes of 8 A100-80G the planner searches
    layout_in_repo: bool  # whether the launch script's layout is DistServe's layout for this application
    eval_prompts_per_gpu: int  # prompts per GPU of each measured rate in DistServe's figures (``EVAL_PLOT_SCRIPT``)
    eval_scale_rate: float  # the per-GPU rate of its SLO-scale figure (``EVAL_PLOT_SCRIPT``)

    @property
    def vllm_tp(self) -> int:
        return PARALLEL_PARAMS[self.model][0]

    @property
    def layout(self) -> tuple[int, int, int, int]:
        return PARALLEL_PARAMS[self.model][1]


CHATBOT = (2.0, 4.6)
# DistServe's figures 8 and 9 (``EVAL_PLOT_SCRIPT``): each point is one run of ``per_gpu_num_prompt x GPUs`` prompts
# (100 per GPU for OPT-13B chatbot, 50 for code completion, 25 for the others), and a request counts towards the
# attainment only if it meets both SLOs (``MODE``); the goodput is where that share crosses 90%. Its SLO-scale
# figures are one such run each, at one per-GPU rate (``Row.eval_scale_rate``).
ROWS = [
    Row("opt-13b-chatbot", "facebook/opt-13b", "sharegpt-multiturn", "chatbot", 0.25, 0.1, CHATBOT, 1, True, 100, 1.5),
    Row("opt-66b-chatbot", "facebook/opt-66b", "sharegpt-multiturn", "chatbot", 2.5, 0.15, CHATBOT, 1, True, 25, 0.25),
    Row("opt-175b-chatbot", "facebook/opt-175b", "sharegpt-multiturn", "chatbot", 4.0, 0.2, CHATBOT, 2, True, 25, 0.125),
    Row("opt-66b-code", "facebook/opt-66b", "humaneval", "code completion", 0.125, 0.2, (5.7, 5.7), 1, False, 50, 0.875),
    Row("opt-66b-summarisation", "facebook/opt-66b", "longbench", "summarisation", 15.0, 0.15, (4.3, 4.3), 1, False, 25, 0.375),
]
