"""What vLLM's Ray control plane cost per step before v0.2.7, fitted to vLLM's own before/after numbers (issue 18).

DistServe compared against a fork of vLLM **v0.2.3** (its ``evaluation/README``: branch ``distserve-baseline-vllm``,
"based on v0.2.3, with some minor changes"). In that vLLM every tensor-parallel worker of an instance with TP > 1 is
a Ray actor, and each step the driver process sends every worker the step's whole metadata by a Ray call and gathers
every worker's output (``_run_workers``). vLLM PR #2221 (merged for v0.2.7) replaced this with a driver worker that
broadcasts the metadata over NCCL, "to remove serialization overhead", and published the throughput of LLaMA-70B
on 8 A100-40G before and after (vLLM's throughput benchmark, all requests at once):

* ShareGPT: 3.01 req/s before, 5.08 after;
* input 1031 / output 317 tokens, "batch size 512": 2.48 before, 3.48 after.

DistServe's real vLLM traces (``align_real_traces.py``) are all at TP1, where v0.2.3 runs the worker in the driver's
process and there is no such cost: the ``aligned`` ablation cannot show it, while every other row of DistServe's
table runs vLLM at TP 4 or 8. This script simulates the benchmark — LLaMA-2-70B (LLaMA-3.1-70B's shape with its
32k vocabulary and 4k context) on the roofline model of an A100-40G (1.555 TB/s, 40 GiB), one TP8 instance, the
``vllm-2023`` step policy at v0.2.3's defaults (256 sequences, 4096 tokens per step, KV at 90%), ShareGPT
first-turn lengths (``chatbot``: what vLLM's benchmark samples), every request arriving at once — and fits:

1. the engine's own overhead per sequence in a step (with ``aligned``'s per-step overhead) to the *after* ShareGPT
   throughput: to compare with the per-sequence overhead DistServe's TP1 traces give (``ALIGNED_OVERHEADS_S``);
2. the Ray control plane on top, to the *before* ShareGPT throughput, in two forms: a fixed cost per step per
   worker, or a cost per sequence per worker (both scale with TP: the driver serialises and sends each worker's call,
   and receives each worker's output, one after another);
3. then checks both forms on the other benchmark (input 1031 / output 317), read two ways, as the PR does not say
   what "batch size 512" set: 512 prompts at the default 256 sequences, or 1000 prompts with up to 512 sequences;
4. a third form with the shape ``bench_ray_step_calls.py`` measured with real Ray actors (per worker: a fixed cost per
   call + one per sequence + one per token the sequence holds; ``experiments/results/bench_ray_step_calls.json``),
   scaled by one factor ``k`` fitted to the *before* ShareGPT figure (``k`` absorbs the other machine's speed), each
   benchmark's sequences holding their mean tokens over decode steps. Checked on the other benchmark as the others.

``distserve_setting.VLLM_RAY_STEP_S`` / ``VLLM_RAY_SEQ_S`` / ``VLLM_RAY_MEASURED_S`` hold the results (``distserve_table.py``'s ``aligned+ray``
ablations apply them to vllm-2023 at its TP). Caveats: the roofline's absolute step times are the model here (the
engine fit absorbs their error); the PR says it "should be merged after #2270, #2273", so its *before* may include
those PRs' changes too.

    python experiments/fit_ray_control_plane.py           # 1000 requests per benchmark
    python experiments/fit_ray_control_plane.py --quick   # 200 requests, coarser bisection
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import harness
from distserve_setting import ALIGNED_OVERHEADS_S, ROOT, VLLM_RAY_MEASURED_S, VLLM_RAY_SEQ_S, VLLM_RAY_STEP_S

from distserve.config import SchedulerConfig
from distserve.placement import Placement
from simulator.hardware import HARDWARE
from simulator.latency import RooflineLatencyModel
from simulator.models import known_model
from simulator.sim_config import SimConfig
from simulator.simulation import simulate
from simulator.workload import Request, generate_requests

PR = "vllm-project/vllm#2221"
TP = 8
# (benchmark, published before, published after), in req/s
PUBLISHED = {"sharegpt": (3.01, 5.08), "fixed-1031-317": (2.48, 3.48)}
V023_SEQS, V023_TOKENS = 256, 4096  # v0.2.3's defaults: --max-num-seqs 256; max_num_batched_tokens = max(max_model_len, 2048)
STEP_S = ALIGNED_OVERHEADS_S["vllm"][0]  # vLLM's fixed cost per step in DistServe's TP1 traces
MEASURED_SHAPE = ROOT / "experiments" / "results" / "bench_ray_step_calls.json"  # bench_ray_step_calls.py's fit


def measured_shape() -> tuple[float, float, float]:
    """(per call s, per sequence s, per token held s) of one v0.2.3 Ray call per worker, as measured on this machine."""
    d = json.loads(MEASURED_SHAPE.read_text())
    return d["a_ms"] / 1e3, d["b_ms"] / 1e3, d["c_us_per_token"] / 1e6


def held_tokens(requests: list[Request]) -> float:
    """Tokens a sequence holds, averaged over the decode steps of the run (a long output holds for many steps)."""
    steps = sum(r.output_len for r in requests)
    return sum(r.output_len * (r.prompt_len + r.output_len / 2) for r in requests) / steps


def latency_model() -> RooflineLatencyModel:
    spec = replace(known_model("meta-llama/Llama-3.1-70B"), name="meta-llama/Llama-2-70b-hf", vocab_size=32000,
                   max_position_embeddings=4096)
    a100_40g = replace(HARDWARE["a100-80g"], name="a100-40g", mem_bandwidth=1.555e12, mem_bytes=40960 * (1 << 20))
    return RooflineLatencyModel(spec, a100_40g)


def workloads(n: int) -> dict[str, tuple[list[Request], int]]:
    """benchmark (and reading) -> (requests, all at t = 0; max_num_seqs). ``fixed/512-prompts``: input 1031 / output 317,
    512 prompts (of 1000) at the default 256 sequences; ``fixed/512-seqs``: all prompts, up to 512 sequences."""
    sharegpt = [replace(r, arrival_s=0.0) for r in generate_requests("chatbot", 1.0, n, seed=0, max_total_len=2048)]
    fixed = [Request(i, 0.0, 1031, 317) for i in range(n)]
    return {"sharegpt": (sharegpt, V023_SEQS), "fixed/512-prompts": (fixed[: max(1, n * 512 // 1000)], V023_SEQS),
            "fixed/512-seqs": (fixed, 512)}


def throughput(latency: RooflineLatencyModel, work: tuple[list[Request], int], step_s: float, seq_s: float) -> float:
    requests, seqs = work
    cfg = SimConfig(scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=V023_TOKENS, step_policy="vllm-2023"),
                    step_overhead_s=step_s, seq_overhead_s=seq_s)
    return len(requests) / simulate(Placement.colocated_instances(1, TP), latency, requests, cfg).duration_s


def solve(f: Any, target: float, hi: float, iterations: int) -> float:
    """x in [0, hi] where the decreasing f(x) crosses target (bisection)."""
    lo = 0.0
    if f(hi) > target:
        raise SystemExit(f"the fit needs more than {hi * 1e3:g} ms")
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    ap = harness.parser(__doc__, "500 requests per benchmark, 7 bisection steps")
    args = ap.parse_args()
    n, iterations = (500, 7) if args.quick else (1000, 14)
    out = harness.Outputs.for_run(args, "fit_ray_control_plane")
    t0 = time.perf_counter()
    latency = latency_model()
    work = workloads(n)
    sharegpt = work["sharegpt"]
    before, after = PUBLISHED["sharegpt"]
    engine_seq_s = solve(lambda s: throughput(latency, sharegpt, STEP_S, s), after, 0.002, iterations)
    ray_step_s = solve(lambda s: throughput(latency, sharegpt, STEP_S + TP * s, engine_seq_s), before, 0.02, iterations)
    ray_seq_s = solve(lambda s: throughput(latency, sharegpt, STEP_S, engine_seq_s + TP * s), before, 0.0005, iterations)
    call_s, per_seq_s, per_token_s = measured_shape()

    def measured(w: tuple[list[Request], int], k: float) -> float:
        return throughput(latency, w, STEP_S + TP * k * call_s, engine_seq_s + TP * k * (per_seq_s + per_token_s * held_tokens(w[0])))

    k = solve(lambda x: measured(sharegpt, x), before, 2.0, iterations)
    sharegpt_tokens = held_tokens(sharegpt[0])
    checks = {}
    for name, w in work.items():
        pub = PUBLISHED["sharegpt" if name == "sharegpt" else "fixed-1031-317"]
        sim = {"after": throughput(latency, w, STEP_S, engine_seq_s),
               "before (per step)": throughput(latency, w, STEP_S + TP * ray_step_s, engine_seq_s),
               "before (per sequence)": throughput(latency, w, STEP_S, engine_seq_s + TP * ray_seq_s),
               "before (measured shape)": measured(w, k)}
        checks[name] = {"published_before": pub[0], "published_after": pub[1], **{k: round(v, 3) for k, v in sim.items()},
                        "num_requests": len(w[0]), "max_num_seqs": w[1], "held_tokens": round(held_tokens(w[0]), 1)}
    validation = {k: v for k, v in checks.items() if k != "sharegpt"}
    error = {form: round(sum(abs(c[f"before ({form})"] / c["published_before"] - 1) for c in validation.values()) / len(validation), 3)
             for form in ("per step", "per sequence", "measured shape")}
    figures: dict[str, Any] = {
        "quick": args.quick, "source": PR, "tp": TP, "num_requests": n, "kv_tokens": latency.max_kv_tokens(TP, 1, 0.9),
        "engine_step_ms": STEP_S * 1e3, "engine_seq_ms": round(engine_seq_s * 1e3, 4),
        "engine_seq_ms_from_tp1_traces": ALIGNED_OVERHEADS_S["vllm"][1] * 1e3,
        "ray_step_ms_per_worker": round(ray_step_s * 1e3, 3), "ray_seq_ms_per_worker": round(ray_seq_s * 1e3, 4),
        # the measured shape x k: per call, per sequence (holding ShareGPT's tokens), per token held
        "measured_shape_ms": {"call": call_s * 1e3, "seq": per_seq_s * 1e3, "token": per_token_s * 1e3}, "measured_k": round(k, 4),
        "ray_measured_ms_per_worker": {"call": round(k * call_s * 1e3, 4),
                                       "seq": round(k * (per_seq_s + per_token_s * sharegpt_tokens) * 1e3, 5)},
        "checks": checks, "validation_error": error, "better_form": min(error, key=error.get),  # type: ignore[arg-type]
        "in_setting": {"ray_step_ms_per_worker": VLLM_RAY_STEP_S * 1e3, "ray_seq_ms_per_worker": VLLM_RAY_SEQ_S * 1e3,
                       "ray_measured_ms_per_worker": [x * 1e3 for x in VLLM_RAY_MEASURED_S]},
    }
    figures["wall_s"] = round(time.perf_counter() - t0, 2)
    rows = [[name, str(c["num_requests"]), str(c["max_num_seqs"]), f"{c['published_after']:.2f}", f"{c['after']:.2f}",
             f"{c['published_before']:.2f}", f"{c['before (per step)']:.2f}", f"{c['before (per sequence)']:.2f}",
             f"{c['before (measured shape)']:.2f}"]
            for name, c in checks.items()]
    cols = ["benchmark", "requests", "seqs", "after", "sim", "before", "per step", "per seq", "measured shape"]
    harness.rich_table(f"LLaMA-70B TP{TP} on A100-40G, req/s ({PR})", cols, rows, left=("benchmark",))
    lines = [f"# vLLM's Ray control plane before v0.2.7, fitted to {PR}", "",
             f"LLaMA-70B on {TP} A100-40G (roofline), vLLM v0.2.3's scheduler defaults, every request at t = 0; {n} requests. "
             f"vLLM's engine overhead: {STEP_S * 1e3:g} ms per step (DistServe's TP1 traces) + **{engine_seq_s * 1e3:.3f} ms per "
             f"sequence** fitted to the *after* ShareGPT figure (DistServe's TP1 traces: {ALIGNED_OVERHEADS_S['vllm'][1] * 1e3:g} ms). "
             f"The Ray control plane on top, fitted to the *before* ShareGPT figure: **{ray_step_s * 1e3:.2f} ms per step per "
             f"worker** ({TP * ray_step_s * 1e3:.1f} ms per step at TP{TP}), or **{ray_seq_s * 1e3:.4f} ms per sequence per "
             f"worker**; or, in the shape `bench_ray_step_calls.py` measured with real Ray actors ({call_s * 1e3:.2f} ms per call "
             f"+ {per_seq_s * 1e3:.4f} ms per sequence + {per_token_s * 1e6:.3f} µs per token held, per worker, on its machine) "
             f"times **k = {k:.3f}**: {k * call_s * 1e3:.3f} ms per call + "
             f"{k * (per_seq_s + per_token_s * sharegpt_tokens) * 1e3:.4f} ms per sequence (holding ShareGPT's "
             f"{sharegpt_tokens:.0f} tokens) per worker. Checked on the other benchmark (mean |simulated/published − 1| "
             f"of *before*): per step {error['per step']:.3f}, per sequence {error['per sequence']:.3f}, measured shape "
             f"{error['measured shape']:.3f}.", "",
             "Columns: requests and the sequence cap of each run; *after* and *before* in req/s, published and simulated "
             "(*sim*: the engine fit alone; *per step*, *per seq*, *measured shape*: with the Ray control plane in that form).", "",
             "| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    out.json(figures)
    out.markdown(lines + [""])
    harness.finish(figures)


if __name__ == "__main__":
    main()
