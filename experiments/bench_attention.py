"""Decode attention over a paged KV cache: the padded path (the default before) vs the exact (split-K) kernel.

Kernel: a batch of 16 decodes with contexts spread over 128-4096 tokens (evenly; seeded uniform
with --spread random), SmolLM2-135M's attention shapes (9 heads, 3 KV heads, head_dim 64, block
size 16), one layer's KV cache on shuffled blocks; also batches at ~300 and ~1000 tokens and one
sequence of 4096. Both backends (``kernels.decode_attention``) run in this process on the same inputs, alternating
call by call; a time is the median over --repeats calls. KV bytes read are counted from the block
ids each backend's plan gathers (padding included): padded reads batch x longest context, exact
Σ over its chunks; the Σctx bytes are the floor. Both backends also write the gathered blocks to
a copy and read that back, so the bytes they move are 3x those they read from the cache.

Model: one decode step (``ModelRunner.execute``, sampling included) of a real model at batch 16
with contexts ~300 and ~1000 (±5%, seeded) and spread 128-4096, with each backend, over a KV cache
of random values (prefilling real prompts that long would dominate the run). On such a cache the
model amplifies any rounding difference: in bf16 the two backends' logits differ by up to ~20
(one attention-kernel ulp, 30 layers; the padded path against itself on a reordered batch: 0), so
"argmax same" is only a sanity figure there; greedy parity on real prompts is tested in
tests/engine and measured by bench_engine.py.

Writes JSON + markdown under --out-dir; the last stdout line is one JSON object of the figures.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import harness
from distserve.config import SamplingParams
from distserve.engine.model import TORCH_DTYPES
from distserve.engine.model_runner import ModelRunner
from distserve.engine.step_plan import ScheduledChunk, StepPlan
from distserve.engine.weights import load_model
from harness import LoadWatch, Outputs
from kernels.backends import default_decode_attention
from kernels.paged_attention import AttentionMetadata, paged_attention

BACKENDS = ("padded", "exact")
SMOLLM2 = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)


def spread_contexts(batch: int, lo: int, hi: int, spread: str, rng: random.Random) -> list[int]:
    if spread == "even":
        return [round(lo + (hi - lo) * i / max(1, batch - 1)) for i in range(batch)]
    return [rng.randint(lo, hi) for _ in range(batch)]


def around(batch: int, ctx: int, rng: random.Random) -> list[int]:
    """``batch`` contexts within ±5% of ``ctx``."""
    return [max(1, round(ctx * rng.uniform(0.95, 1.05))) for _ in range(batch)]


def shuffled_tables(contexts: list[int], block_size: int, spare: int, gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Block tables on a random permutation of the cache's blocks, and the number of blocks."""
    need = [-(-c // block_size) for c in contexts]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    return [[perm.pop() for _ in range(n)] for n in need], num_blocks


def alternate(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, calls alternating (order flipped every round) after a warm-up."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_kernel(name: str, contexts: list[int], dtype: torch.dtype, repeats: int, seed: int) -> dict[str, Any]:
    """Both backends on one layer's cache; times, KV bytes read and their agreement."""
    h, kvh, d, bs = SMOLLM2["num_heads"], SMOLLM2["num_kv_heads"], SMOLLM2["head_dim"], SMOLLM2["block_size"]
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_tables(contexts, bs, 64, gen)
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype)  # [NB, BS, KVH, D]
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype)
    query = torch.randn(len(contexts), h, d, generator=gen).to(dtype)  # [B, H, D]
    slots = [t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(tables, contexts)]
    key = k_cache.view(-1, kvh, d)[slots]  # [B, KVH, D] this step's (already cached) tokens
    value = v_cache.view(-1, kvh, d)[slots]
    n = len(contexts)

    def build(backend: str) -> AttentionMetadata:
        return AttentionMetadata.build([1] * n, contexts, slots, tables, bs, decode_attention=backend)

    metas = {b: build(b) for b in BACKENDS}
    build_s = alternate({b: (lambda b=b: build(b)) for b in BACKENDS}, max(repeats, 20))
    run = {b: (lambda m=metas[b]: paged_attention(query, key, value, k_cache, v_cache, m, d**-0.5)) for b in BACKENDS}
    outs = {b: fn().float() for b, fn in run.items()}  # type: ignore[union-attr]
    seconds = alternate(run, repeats)
    token_bytes = 2 * kvh * d * torch.finfo(dtype).bits // 8  # K and V of one token in one layer
    sum_ctx = sum(contexts)
    row: dict[str, Any] = {
        "case": name, "dtype": str(dtype).removeprefix("torch."), "batch": n, "sum_ctx": sum_ctx,
        "max_ctx": max(contexts), "sum_ctx_mb": sum_ctx * token_bytes / 1e6,
        "max_abs_diff": (outs["exact"] - outs["padded"]).abs().max().item(),
    }
    for b in BACKENDS:
        plan = metas[b].decode_plan
        assert plan is not None
        read = plan.kv_tokens_read() * token_bytes
        row[f"{b}_ms"] = seconds[b] * 1e3
        row[f"{b}_build_us"] = build_s[b] * 1e6
        row[f"{b}_kv_mb_read"] = read / 1e6
        row[f"bytes_ratio_{b}"] = read / (sum_ctx * token_bytes)
        row[f"{b}_read_gb_s"] = read / seconds[b] / 1e9
    exact_plan = metas["exact"].decode_plan
    assert exact_plan is not None
    row["exact_chunk_len"], row["exact_num_chunks"] = exact_plan.unit_len, exact_plan.num_units
    row["speedup"] = row["padded_ms"] / row["exact_ms"]
    return row


def bench_model_step(model: str, dtype: str, cases: dict[str, list[int]], repeats: int, seed: int) -> list[dict[str, Any]]:
    """One decode step of the whole model (``ModelRunner.execute``) per backend, per context case."""
    loaded = load_model(model, dtype)
    config = loaded.config
    bs = SMOLLM2["block_size"]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for name, contexts in cases.items():
        tables, num_blocks = shuffled_tables(contexts, bs, 16, gen)
        runner = ModelRunner(config, loaded.state_dict, num_blocks, bs)
        runner.kv_cache.normal_(generator=gen)  # values do not change the cost; finite and varied
        greedy = SamplingParams(temperature=0.0)
        plan = StepPlan([
            ScheduledChunk(f"s{i}", [int(torch.randint(10, config.vocab_size, (1,), generator=gen))], c - 1, t, True, greedy, 1)
            for i, (c, t) in enumerate(zip(contexts, tables))
        ])
        tokens: dict[str, list[int]] = {}

        def step(backend: str) -> None:
            runner.decode_attention = backend
            tokens[backend] = [s.token_id for s in runner.execute(plan)]

        seconds = alternate({b: (lambda b=b: step(b)) for b in BACKENDS}, repeats)
        same = sum(a == b for a, b in zip(tokens["padded"], tokens["exact"])) / len(contexts)
        rows.append({
            "case": name, "model": model, "dtype": dtype, "batch": len(contexts), "mean_ctx": sum(contexts) / len(contexts),
            "max_ctx": max(contexts), **{f"{b}_ms": seconds[b] * 1e3 for b in BACKENDS},
            "speedup": seconds["padded"] / seconds["exact"], "greedy_same": same,  # "argmax same" (see the docstring)
        })
        del runner
    return rows


def write_outputs(out: Outputs, kernel: list[dict[str, Any]], model: list[dict[str, Any]],
                  figures: dict[str, Any], title: str) -> None:
    out.json({"figures": figures, "kernel": kernel, "model_step": model})
    md = [title, "",
          "| case | dtype | Σctx | max ctx | padded ms | exact ms | speedup | KV MB read padded | exact | Σctx MB "
          "| bytes/Σctx padded | exact | exact chunks | build µs padded | exact | max abs diff |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['case']} | {r['dtype']} | {r['sum_ctx']} | {r['max_ctx']} | {r['padded_ms']:.2f} | {r['exact_ms']:.2f} "
           f"| {r['speedup']:.2f}x | {r['padded_kv_mb_read']:.1f} | {r['exact_kv_mb_read']:.1f} | {r['sum_ctx_mb']:.1f} "
           f"| {r['bytes_ratio_padded']:.2f} | {r['bytes_ratio_exact']:.3f} | {r['exact_num_chunks']} x {r['exact_chunk_len']} "
           f"| {r['padded_build_us']:.0f} | {r['exact_build_us']:.0f} | {r['max_abs_diff']:.1e} |" for r in kernel]
    if model:
        md += ["", "Whole-model decode step (ModelRunner.execute) over a random KV cache; argmax agreement there "
               "is only a sanity figure in bf16 (see the script docstring):", "",
               "| model | dtype | case | batch | mean ctx | max ctx | padded ms | exact ms | speedup | argmax same (random KV) |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['model']} | {r['dtype']} | {r['case']} | {r['batch']} | {r['mean_ctx']:.0f} | {r['max_ctx']} "
               f"| {r['padded_ms']:.1f} | {r['exact_ms']:.1f} | {r['speedup']:.2f}x | {r['greedy_same']:.0%} |" for r in model]
    md += ["", f"Cores kept busy by other processes meanwhile: {figures['other_processes_busy_cores']}"]
    out.markdown(md)


def main() -> None:
    ap = harness.parser(__doc__, "batch 4 at contexts 16-256, tiny model steps, 3 repeats")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--min-ctx", type=int, default=128)
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--spread", choices=("even", "random"), default="even", help="contexts evenly spaced or seeded uniform")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="KV cache dtypes of the kernel benchmark (the first is the headline)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--model", default="smollm2-135m", help="model of the whole-step benchmark")
    ap.add_argument("--model-dtype", default="bfloat16")
    ap.add_argument("--step-contexts", default="300,1000", help="mean contexts of the whole-step benchmark ('' skips it)")
    ap.add_argument("--step-repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.min_ctx, args.max_ctx, args.repeats = 4, 16, 256, 3
        args.model, args.model_dtype, args.step_contexts, args.step_repeats = "tiny", "float32", "40,120", 3
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    spread = spread_contexts(args.batch, args.min_ctx, args.max_ctx, args.spread, rng)
    kernel_cases = {f"spread {args.min_ctx}-{args.max_ctx}": spread}
    if not args.quick:
        kernel_cases.update({"~300": around(args.batch, 300, rng), "~1000": around(args.batch, 1000, rng),
                             f"1 x {args.max_ctx}": [args.max_ctx]})
    dtypes = [TORCH_DTYPES[d] for d in args.dtypes.split(",") if d]

    with LoadWatch(period=None) as watch:  # no polling thread: it would disturb the timings
        kernel = [bench_kernel(name, ctx, dtype, args.repeats, args.seed) for dtype in dtypes for name, ctx in kernel_cases.items()]
        step_cases = {f"~{c}": around(args.batch, int(c), rng) for c in args.step_contexts.split(",") if c}
        if step_cases:
            step_cases[f"spread {args.min_ctx}-{args.max_ctx}"] = spread
        model = bench_model_step(args.model, args.model_dtype, step_cases, args.step_repeats, args.seed) if step_cases else []

    head = kernel[0]
    figures: dict[str, Any] = {
        "batch": args.batch, "contexts": spread, "dtype": head["dtype"], "threads": args.threads,
        "default_decode_attention": default_decode_attention("cpu"),
        "padded_ms": round(head["padded_ms"], 3), "exact_ms": round(head["exact_ms"], 3),
        "speedup": round(head["speedup"], 2),
        "bytes_ratio_exact": round(head["bytes_ratio_exact"], 4), "bytes_ratio_padded": round(head["bytes_ratio_padded"], 4),
        "sum_ctx_mb": round(head["sum_ctx_mb"], 2), "exact_kv_mb_read": round(head["exact_kv_mb_read"], 2),
        "padded_kv_mb_read": round(head["padded_kv_mb_read"], 2),
        "exact_chunk_len": head["exact_chunk_len"], "exact_num_chunks": head["exact_num_chunks"],
        "exact_build_us": round(head["exact_build_us"], 1), "padded_build_us": round(head["padded_build_us"], 1),
        "max_abs_diff": max(r["max_abs_diff"] for r in kernel),
        "kernel": {f"{r['case']} {r['dtype']}": {k: round(r[k], 3) for k in ("padded_ms", "exact_ms", "speedup", "bytes_ratio_exact")}
                   for r in kernel},
        "model_step": {f"{r['model']} {r['dtype']} {r['case']}": {k: round(r[k], 3) for k in ("padded_ms", "exact_ms", "speedup", "greedy_same")}
                       for r in model},
        "other_processes_busy_cores": round(watch.other_cores, 2),
    }
    for r in kernel:
        print(f"{r['case']:>16} {r['dtype']:>8}: padded {r['padded_ms']:8.2f} ms ({r['bytes_ratio_padded']:.2f}x Σctx bytes)"
              f"  exact {r['exact_ms']:7.2f} ms ({r['bytes_ratio_exact']:.3f}x, {r['exact_num_chunks']} chunks of {r['exact_chunk_len']})"
              f"  speedup {r['speedup']:.2f}x  max|diff| {r['max_abs_diff']:.1e}")
    for r in model:
        print(f"model step {r['model']} {r['dtype']} {r['case']:>16}: padded {r['padded_ms']:7.1f} ms  exact {r['exact_ms']:7.1f} ms"
              f"  speedup {r['speedup']:.2f}x  argmax same {r['greedy_same']:.0%} (random KV)")
    title = (f"Decode attention, SmolLM2-135M shapes (9 heads, 3 KV heads, head_dim 64, block 16), batch {args.batch}, "
             f"{args.threads} threads, median of {args.repeats} alternating calls. KV MB read: from the cache, per layer, "
             f"padding included (each backend also writes them to a copy and reads that back).")
    write_outputs(Outputs.for_run(args, "bench_attention"), kernel, model, figures, title)
    harness.finish(figures)


if __name__ == "__main__":
    main()
