"""Engine throughput: our colocated LLMEngine vs HF transformers ``generate`` on the same prompts.

Both sides run in this process with the same torch thread count, greedy, a fixed number of output
tokens per prompt (EOS ignored), at batch 16 and batch 1, in float32 and bfloat16. Prints a table,
writes JSON + markdown under --out-dir, and ends with one JSON line of the measured figures.
"""

from __future__ import annotations

import gc
import resource
import time

import torch

import harness
from distserve.cli.arg_types import positive_int
from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.dtypes import cpu_has_fast_bf16
from distserve.engine.tiny_model import build_tiny_hf_model
from distserve.engine.weights import load_model, resolve_model_dir
from harness import Outputs

# vLLM's CPU backend on this kind of machine (2 cores, one engine core), SmolLM2-135M, batch 16:
# about 130 output tokens/s (figure given in the issue; vLLM is not installable here to re-measure).
VLLM_CPU_REFERENCE_TOK_S = 130.0

TOPICS = [
    "a dragon who guarded a library", "the history of the printing press", "how bees make honey",
    "a detective in a rainy city", "why the sky is blue", "the rules of chess",
    "a journey across the Sahara", "how a compiler works", "the life of a lighthouse keeper",
    "photosynthesis in simple words", "a robot learning to paint", "the causes of the French Revolution",
    "how vaccines train the immune system", "a cat that could talk", "the water cycle",
    "building a wooden boat",
]


def make_prompts(n: int) -> list[str]:
    # Mixed lengths on purpose: continuous batching should not pay for padding.
    return [f"Write a short essay about {TOPICS[i % len(TOPICS)]}." + " Be vivid." * (i % 4) for i in range(n)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def bench_ours(model: str, dtype: str, prompts: list[str], max_tokens: int) -> dict[str, object]:
    loaded = load_model(model, dtype)
    engine = LLMEngine(loaded, cache_config=CacheConfig(kv_cache_memory_gb=0.25))
    # min_tokens = max_tokens masks EOS exactly like HF's min_new_tokens, so both emit the same tokens.
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    t_batch = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(prompts[:1], sp)
    t_single = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    result = {
        "tok_s_batch": n / t_batch,
        "tok_s_b1": max_tokens / t_single,
        "token_ids": [o.token_ids for o in outs],
        "mean_ttft_s": sum(o.metrics.ttft_s or 0.0 for o in outs) / len(outs),
    }
    del engine, loaded
    gc.collect()
    return result


def bench_hf(model: str, dtype: str, prompts: list[str], max_tokens: int) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    if model == "tiny":
        hf, tok = build_tiny_hf_model()
        hf = hf.to(getattr(torch, dtype))
        hf_tok = tok.hf
    else:
        from transformers import AutoTokenizer

        folder = resolve_model_dir(model)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        hf_tok = AutoTokenizer.from_pretrained(folder)
    hf_tok.padding_side = "left"
    if hf_tok.pad_token is None:
        hf_tok.pad_token = hf_tok.eos_token

    def run(batch: list[str]) -> tuple[float, list[list[int]]]:
        enc = hf_tok(batch, return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                **enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                pad_token_id=hf_tok.pad_token_id,
            )
        elapsed = time.perf_counter() - t0
        return elapsed, out[:, enc["input_ids"].shape[1] :].tolist()

    run(prompts[:2])
    t_batch, ids = run(prompts)
    t_single, _ = run(prompts[:1])
    gc.collect()
    return {"tok_s_batch": len(prompts) * max_tokens / t_batch, "tok_s_b1": max_tokens / t_single, "token_ids": ids}


def main() -> None:
    ap = harness.parser(__doc__, "tiny model, 4 prompts x 8 tokens")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=positive_int, default=16)
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads(), help="torch threads, both sides")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    if args.quick:
        args.model, args.num_prompts, args.max_tokens = "tiny", 4, 8
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts)
    dtypes = [d for d in args.dtypes.split(",") if d]

    figures: dict[str, object] = {
        "model": args.model, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
        "threads": args.threads, "cpu_fast_bf16": cpu_has_fast_bf16(),
        "vllm_cpu_reference_tok_s_b16": VLLM_CPU_REFERENCE_TOK_S,
    }
    rows = []
    for dtype in dtypes:
        ours = bench_ours(args.model, dtype, prompts, args.max_tokens)
        figures[f"peak_rss_mb_after_ours_{dtype}"] = round(peak_rss_mb(), 1)
        hf = bench_hf(args.model, dtype, prompts, args.max_tokens)
        same = sum(a == b for a, b in zip(ours["token_ids"], hf["token_ids"])) / len(prompts)  # type: ignore[arg-type]
        ratio = ours["tok_s_batch"] / hf["tok_s_batch"]  # type: ignore[operator]
        figures[f"ours_tok_s_batch_{dtype}"] = round(ours["tok_s_batch"], 2)  # type: ignore[arg-type]
        figures[f"hf_tok_s_batch_{dtype}"] = round(hf["tok_s_batch"], 2)  # type: ignore[arg-type]
        figures[f"ratio_batch_{dtype}"] = round(ratio, 3)
        figures[f"ours_tok_s_b1_{dtype}"] = round(ours["tok_s_b1"], 2)  # type: ignore[arg-type]
        figures[f"hf_tok_s_b1_{dtype}"] = round(hf["tok_s_b1"], 2)  # type: ignore[arg-type]
        figures[f"greedy_same_as_hf_{dtype}"] = same
        rows.append((dtype, ours, hf, ratio, same))
    best = max(rows, key=lambda r: r[1]["tok_s_batch"])
    figures["ours_best_tok_s_batch"] = round(best[1]["tok_s_batch"], 2)
    figures["ours_best_dtype"] = best[0]
    if "float32" in dtypes:
        hf32 = figures["hf_tok_s_batch_float32"]
        figures["ratio_ours_best_vs_hf_float32"] = round(best[1]["tok_s_batch"] / hf32, 3)  # type: ignore[operator]
    figures["ratio_ours_best_vs_vllm_cpu_reference"] = round(best[1]["tok_s_batch"] / VLLM_CPU_REFERENCE_TOK_S, 3)
    figures["peak_rss_mb"] = round(peak_rss_mb(), 1)

    harness.rich_table(
        f"{args.model}: {args.num_prompts} prompts x {args.max_tokens} tokens, {args.threads} threads",
        ["dtype", f"ours tok/s (b{args.num_prompts})", "HF tok/s", "ratio", "ours b1", "HF b1", "greedy = HF"],
        [[dtype, f"{ours['tok_s_batch']:.1f}", f"{hf['tok_s_batch']:.1f}", f"{ratio:.2f}x",
          f"{ours['tok_s_b1']:.1f}", f"{hf['tok_s_b1']:.1f}", f"{same:.0%}"] for dtype, ours, hf, ratio, same in rows],
    )

    out = Outputs.for_run(args, "bench_engine")
    out.json(figures)
    md = ["| dtype | ours tok/s | HF tok/s | ratio | ours b1 | HF b1 | greedy = HF |", "|---|---|---|---|---|---|---|"]
    md += [
        f"| {d} | {o['tok_s_batch']:.1f} | {h['tok_s_batch']:.1f} | {r:.2f}x | {o['tok_s_b1']:.1f} | {h['tok_s_b1']:.1f} | {s:.0%} |"
        for d, o, h, r, s in rows
    ]
    out.markdown(md)
    harness.finish(figures)


if __name__ == "__main__":
    main()
