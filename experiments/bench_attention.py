"""Decode attention over a paged KV cache: padded vs exact (split-K) vs cascade (shared prefixes read once).

Kernel, padded vs exact: a batch of 16 decodes with contexts spread over 128-4096 tokens (evenly;
seeded uniform with --spread random), SmolLM2-135M's attention shapes (9 heads, 3 KV heads,
head_dim 64, block size 16), one layer's KV cache on shuffled blocks; also batches at ~300 and
~1000 tokens and one sequence of 4096. Both backends (``kernels.decode_attention``) run in this
process on the same inputs, alternating call by call; a time is the median over --repeats calls.
KV bytes read are counted from the block ids each backend's plan gathers (padding included):
padded reads batch x longest context, exact Σ over its chunks; the Σctx bytes are the floor. Both
backends also write the gathered blocks to a copy and read that back, so the bytes they move are
3x those they read from the cache.

Kernel, cascade (``experiments/cascade_sweep.py``): cascade forced on every shared node vs exact
and padded on --requests x --prefixes batches sharing one prompt and on two-level trees (--trees:
a system prompt for all, then one of two documents per half), each request with its own ragged
suffix (--suffix), in bf16 and fp32; per-layer time = forward + plan / 30 layers. The headline
(--headline) is 32 requests on a 4096-token prompt. Then the cost rule: one group of
--rule-members sharing --rule-prefixes tokens; ``CascadeRule(min_saved_tokens, member_cost_tokens)``
is fit to where cascade stops paying (over the sweep and the grid's one-level batches), printed,
scored against the rule without a per-member term, vLLM's (>= 256 tokens and >= 8 requests) and
the one ``kernels`` holds, and every batch is marked with its decision and whether it was the
faster one. A configuration that other processes disturbed is measured again (marked if it stays
disturbed). The plot (PNG): attention time vs requests per prefix length, exact vs cascade.

Model: one decode step (``ModelRunner.execute``, sampling included) of a real model at batch 16
with contexts ~300 and ~1000 (±5%, seeded) and spread 128-4096, padded vs exact; and 32 requests
on a 2048-token shared prompt (--step-cascade), exact vs cascade (the registered backend with the
default rule; the JSON says whether it planned a cascade). All over a KV cache of random values
(prefilling real prompts that long would dominate the run). On such a cache the model amplifies
any rounding difference: in bf16 two backends' logits differ by up to ~20 (one attention-kernel
ulp, 30 layers; the padded path against itself on a reordered batch: 0), so "argmax same" is only
a sanity figure there; greedy parity on real prompts is tested in tests/engine and measured by
bench_engine.py.

Writes JSON + markdown + PNG under --out-dir; the last stdout line is one JSON object of the
figures (``cascade_speedup_headline``, ``cascade_rule_min_saved_tokens``, ``step_speedup_cascade``, ...).
"""

from __future__ import annotations

import random
from typing import Any

import torch

import harness
from distserve.cli.arg_types import positive_int
from distserve.config import SamplingParams
from distserve.dtypes import torch_dtype
from distserve.engine.model_runner import ModelRunner
from distserve.engine.step_plan import ScheduledChunk, StepPlan
from distserve.engine.weights import load_model
from cascade_sweep import MAX_OTHER_CORES, RETRIES, SMOLLM2, SharedBatch, alternate, measure_quietly, cascade_grid, derive_rule, mark, one_level, plot, rule_sweep
from harness import LoadWatch, Outputs
from kernels.backends import default_decode_attention, get_decode_attention
from kernels.cascade_attention import CascadePlan, CascadeRule
from kernels.paged_attention import AttentionMetadata, paged_attention

BACKENDS = ("padded", "exact")
DISTURBED = " (disturbed)"


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



def bench_model_step(model: str, dtype: str, cases: list[tuple[SharedBatch, tuple[str, str]]], repeats: int,
                     seed: int, retries: int) -> list[dict[str, Any]]:
    """One decode step of the whole model (``ModelRunner.execute``) per case, with each of its two
    backends (the baseline first)."""
    loaded = load_model(model, dtype)
    config = loaded.config
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch, backends in cases:
        runner = ModelRunner(config, loaded.state_dict, batch.num_blocks, SMOLLM2["block_size"])
        runner.kv_cache.normal_(generator=gen)  # values do not change the cost; finite and varied
        greedy = SamplingParams(temperature=0.0)
        plan = StepPlan([
            ScheduledChunk(f"s{i}", [int(torch.randint(10, config.vocab_size, (1,), generator=gen))], c - 1, t, True, greedy, 1)
            for i, (c, t) in enumerate(zip(batch.contexts, batch.tables))
        ])
        tokens: dict[str, list[int]] = {}

        def step(backend: str) -> None:
            runner.decode_attention = backend
            tokens[backend] = [s.token_id for s in runner.execute(plan)]

        seconds, others, disturbed = measure_quietly(f"model step {batch.name}", retries,
                                                     lambda: alternate({b: (lambda b=b: step(b)) for b in backends}, repeats))
        base, new = backends
        rows.append({
            "case": batch.name, "model": model, "dtype": dtype, "batch": len(batch.contexts),
            "mean_ctx": sum(batch.contexts) / len(batch.contexts), "max_ctx": max(batch.contexts),
            "base": base, "new": new, **{f"{b}_ms": seconds[b] * 1e3 for b in backends}, "speedup": seconds[base] / seconds[new],
            "others_cores": others, "disturbed": disturbed,
            "greedy_same": sum(a == b for a, b in zip(tokens[base], tokens[new])) / len(batch.contexts),  # see the docstring
            # Whether the registered cascade backend (the default rule) ran a cascade, not an exact step.
            "cascade_planned": "cascade" in backends and isinstance(
                get_decode_attention("cascade").plan(batch.contexts, batch.table(), SMOLLM2["block_size"]), CascadePlan),
        })
    return rows


def shuffled_batch(name: str, contexts: list[int], gen: torch.Generator) -> SharedBatch:
    """Contexts on shuffled blocks, nothing shared."""
    tables, num_blocks = shuffled_tables(contexts, SMOLLM2["block_size"], 16, gen)
    return SharedBatch(name, contexts, tables, num_blocks, sum(contexts))


def cascade_markdown(grid: list[dict[str, Any]], sweep: list[dict[str, Any]], rules: dict[str, Any]) -> list[str]:
    """The cascade tables: the grid (with the rule's decision) and the rule sweep."""
    md = ["", "## Cascade vs per-request decode attention (shared prefixes)", "",
          "Per-layer ms = forward + plan / 30 layers. Cascade forced on every shared node (`CascadeRule(0)`); "
          "`rule` = what the derived rule decides for the batch (cascade: some shared node pays, and only those are kept; "
          "exact: none does), `right` = whether that was the faster backend.", "",
          "| case | dtype | Σctx | exact ms | cascade ms | padded ms | cascade speedup vs exact | vs padded "
          "| KV MB read exact | cascade | padded | distinct KV MB | plan µs exact | cascade | max abs diff | rule | right |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['case']} | {r['dtype']} | {r['sum_ctx']} | {r['exact_layer_ms']:.2f} | {r['cascade_layer_ms']:.2f} "
           f"| {r['padded_layer_ms']:.2f} | **{r['speedup']:.2f}x** | {r['padded_layer_ms'] / r['cascade_layer_ms']:.1f}x "
           f"| {r['exact_kv_mb_read']:.1f} | {r['cascade_kv_mb_read']:.1f} | {r['padded_kv_mb_read']:.1f} | {r['unique_kv_mb']:.1f} "
           f"| {r['exact_plan_us']:.0f} | {r['cascade_plan_us']:.0f} | {r['cascade_max_abs_diff']:.1e} | {r['rule']} "
           f"| {'yes' if r['rule_right'] else 'NO'}{DISTURBED if r['disturbed'] else ''} |" for r in grid]
    md += ["", "### Where cascade stops paying: one group of `members` requests sharing `prefix` tokens", "",
           f"Derived rule (least time lost, {rules['dtype']}): **{rules['derived']}**; "
           f"rules scored over the {rules['dtype']} one-level batches, this sweep's and the grid's (loss = Σ chosen/faster - 1; "
           f"wrong = configurations where the "
           f"rule picked the slower backend):", "", "| rule | loss | wrong |", "|---|---|---|",
           *[f"| {s['rule']} | {s['loss']:.2f} | {s['wrong']} |" for s in rules["scored"]], "",
           "A run derives its own pair; the one in `kernels` (`CascadeRule`'s defaults) lost least over several full runs "
           "together (cascade's speed varies between runs on this shared machine; see its docstring).", "",
           "| members | prefix | saved tokens | dtype | exact ms | cascade ms | cascade speedup | rule | right |",
           "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['members']} | {r['prefix']} | {r['saved_tokens']} | {r['dtype']} | {r['exact_layer_ms']:.3f} "
           f"| {r['cascade_layer_ms']:.3f} | {r['speedup']:.2f}x | {r['rule']} | {'yes' if r['rule_right'] else 'NO'}"
           f"{DISTURBED if r['disturbed'] else ''} |" for r in sweep]
    if any(r["disturbed"] for r in grid + sweep):
        md += ["", f"{DISTURBED}: other processes used > {MAX_OTHER_CORES} cores during every attempt ({RETRIES + 1})."]
    return md


def write_outputs(out: Outputs, kernel: list[dict[str, Any]], model: list[dict[str, Any]], cascade_md: list[str],
                  data: dict[str, Any], figures: dict[str, Any], title: str) -> None:
    out.json({"figures": figures, "kernel": kernel, "model_step": model, **data})
    md = [title, "",
          "| case | dtype | Σctx | max ctx | padded ms | exact ms | speedup | KV MB read padded | exact | Σctx MB "
          "| bytes/Σctx padded | exact | exact chunks | build µs padded | exact | max abs diff |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['case']} | {r['dtype']} | {r['sum_ctx']} | {r['max_ctx']} | {r['padded_ms']:.2f} | {r['exact_ms']:.2f} "
           f"| {r['speedup']:.2f}x | {r['padded_kv_mb_read']:.1f} | {r['exact_kv_mb_read']:.1f} | {r['sum_ctx_mb']:.1f} "
           f"| {r['bytes_ratio_padded']:.2f} | {r['bytes_ratio_exact']:.3f} | {r['exact_num_chunks']} x {r['exact_chunk_len']} "
           f"| {r['padded_build_us']:.0f} | {r['exact_build_us']:.0f} | {r['max_abs_diff']:.1e} |" for r in kernel]
    md += cascade_md
    if model:
        md += ["", "## Whole-model decode step (ModelRunner.execute) over a random KV cache", "",
               "Argmax agreement there is only a sanity figure in bf16 (see the script docstring).", "",
               "| model | dtype | case | batch | mean ctx | max ctx | baseline | ms | new | ms | speedup | argmax same (random KV) |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['model']} | {r['dtype']} | {r['case']} | {r['batch']} | {r['mean_ctx']:.0f} | {r['max_ctx']} "
               f"| {r['base']} | {r[r['base'] + '_ms']:.1f} | {r['new']} | {r[r['new'] + '_ms']:.1f} | {r['speedup']:.2f}x "
               f"| {r['greedy_same']:.0%}{DISTURBED if r['disturbed'] else ''} |" for r in model]
    md += ["", f"Cores kept busy by other processes meanwhile: {figures['other_processes_busy_cores']}"]
    out.markdown(md)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(":", ",").split(",") if x]


def main() -> None:
    ap = harness.parser(__doc__, "batch 4 at contexts 16-256, tiny cascade grid and rule sweep, tiny model steps, 3 repeats")
    ap.add_argument("--batch", type=positive_int, default=16)
    ap.add_argument("--min-ctx", type=positive_int, default=128)
    ap.add_argument("--max-ctx", type=positive_int, default=4096)
    ap.add_argument("--spread", choices=("even", "random"), default="even", help="contexts evenly spaced or seeded uniform")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="KV cache dtypes of the kernel benchmarks (the first is the headline)")
    ap.add_argument("--repeats", type=positive_int, default=15)
    ap.add_argument("--requests", default="8,16,32,64", help="cascade grid: requests sharing a prefix")
    ap.add_argument("--prefixes", default="512,1024,4096", help="cascade grid: shared prefix tokens")
    ap.add_argument("--suffix", default="64,192", help="own suffix tokens of each request: uniform in [lo, hi]")
    ap.add_argument("--trees", default="16:1024:2:2048,32:1024:2:2048",
                    help="two-level trees requests:root:docs:doc (a root prompt for all, each doc shared by requests/docs)")
    ap.add_argument("--headline", default="32:4096", help="requests:prefix of the headline cascade figure")
    ap.add_argument("--rule-members", default="2,3,4,6,8,12,16", help="rule sweep: requests of the one group")
    ap.add_argument("--rule-prefixes", default="64,128,256,512,1024,2048", help="rule sweep: shared tokens")
    ap.add_argument("--rule-repeats", type=positive_int, default=25)
    ap.add_argument("--model", default="smollm2-135m", help="model of the whole-step benchmark")
    ap.add_argument("--model-dtype", default="bfloat16")
    ap.add_argument("--step-contexts", default="300,1000", help="mean contexts of the padded/exact whole-step benchmark ('' skips it)")
    ap.add_argument("--step-cascade", default="32:2048", help="requests:prefix of the exact/cascade whole-step benchmark ('' skips it)")
    ap.add_argument("--step-repeats", type=positive_int, default=7)
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.min_ctx, args.max_ctx, args.repeats = 4, 16, 256, 3
        args.requests, args.prefixes, args.suffix, args.trees, args.headline = "2,4", "32,64", "8,24", "4:16:2:32", "4:64"
        args.rule_members, args.rule_prefixes, args.rule_repeats = "2,4", "16,64", 3
        args.model, args.model_dtype, args.step_contexts, args.step_cascade, args.step_repeats = "tiny", "float32", "40,120", "8:960", 3
    if args.max_ctx < args.min_ctx:
        ap.error(f"--max-ctx must be >= --min-ctx, got {args.max_ctx} < {args.min_ctx}")
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    spread = spread_contexts(args.batch, args.min_ctx, args.max_ctx, args.spread, rng)
    kernel_cases = {f"spread {args.min_ctx}-{args.max_ctx}": spread}
    if not args.quick:
        kernel_cases.update({"~300": around(args.batch, 300, rng), "~1000": around(args.batch, 1000, rng),
                             f"1 x {args.max_ctx}": [args.max_ctx]})
    dtypes = [torch_dtype(d) for d in args.dtypes.split(",") if d]
    lo, hi = ints(args.suffix)
    trees = [tuple(ints(t)) for t in args.trees.split(",") if t]
    head_n, head_p = ints(args.headline)
    retries = 0 if args.quick else RETRIES  # the quick run only checks that everything runs

    with LoadWatch(period=None) as watch:  # no polling thread: it would disturb the timings
        kernel = [bench_kernel(name, ctx, dtype, args.repeats, args.seed) for dtype in dtypes for name, ctx in kernel_cases.items()]
        sweeps = {str(dt).removeprefix("torch."): rule_sweep(ints(args.rule_members), ints(args.rule_prefixes), (lo, hi), dt,
                                                             args.rule_repeats, args.seed, retries) for dt in dtypes}
        grid = [r for dt in dtypes for r in cascade_grid(ints(args.requests), ints(args.prefixes), trees, (lo, hi), dt,
                                                         args.repeats, args.seed, retries)]
        # The rule is fit on every one-level batch of a dtype: the sweep's small groups and the grid's large ones.
        derived = {dt: derive_rule(rows + [r for r in grid if r["dtype"] == dt and not r["tree"]]) for dt, rows in sweeps.items()}
        rules_dtype = str(dtypes[0]).removeprefix("torch.")
        rule, scored = derived[rules_dtype]  # the headline dtype's
        gen = torch.Generator().manual_seed(args.seed)
        step_cases = [(shuffled_batch(f"~{c}", around(args.batch, int(c), rng), gen), BACKENDS) for c in args.step_contexts.split(",") if c]
        if step_cases:
            step_cases.append((shuffled_batch(f"spread {args.min_ctx}-{args.max_ctx}", spread, gen), BACKENDS))
        if args.step_cascade:
            n, p = ints(args.step_cascade)
            step_cases.append((one_level(n, p, (lo, hi), SMOLLM2["block_size"], rng, gen), ("exact", "cascade")))
        model = bench_model_step(args.model, args.model_dtype, step_cases, args.step_repeats, args.seed, retries) if step_cases else []
    sweep = [r for rows in sweeps.values() for r in rows]
    for r in sweep + grid:
        mark(r, rule)

    head = kernel[0]
    casc = next(r for r in grid if r["requests"] == head_n and r["prefix"] == head_p and not r["tree"])
    tree = next((r for r in grid if r["tree"] and r["requests"] == head_n), next((r for r in grid if r["tree"]), None))
    step = next((r for r in model if r["new"] == "cascade"), None)
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
        "cascade_headline": f"{casc['case']} {casc['dtype']}, own suffixes {lo}-{hi}",
        "cascade_speedup_headline": round(casc["speedup"], 2),
        "cascade_vs_padded_headline": round(casc["padded_layer_ms"] / casc["cascade_layer_ms"], 2),
        "cascade_ms_headline": round(casc["cascade_layer_ms"], 3), "exact_ms_headline": round(casc["exact_layer_ms"], 3),
        "cascade_kv_read_ratio_headline": round(casc["kv_read_ratio"], 2),
        "cascade_tree": None if tree is None else f"{tree['case']} {tree['dtype']}",
        "cascade_speedup_tree": None if tree is None else round(tree["speedup"], 2),
        "cascade_max_abs_diff": max(r["cascade_max_abs_diff"] for r in grid + sweep),
        "cascade_grid": {f"{r['case']} {r['dtype']}": {k: round(r[k], 3) if isinstance(r[k], float) else r[k] for k in
                         ("exact_layer_ms", "cascade_layer_ms", "padded_layer_ms", "speedup", "kv_read_ratio", "rule", "rule_right")}
                         for r in grid},
        "cascade_rule_min_saved_tokens": rule.min_saved_tokens,
        "cascade_rule_member_cost_tokens": rule.member_cost_tokens,
        "cascade_rule_by_dtype": {dt: [r.min_saved_tokens, r.member_cost_tokens] for dt, (r, _) in derived.items()},
        "cascade_rule_default": [CascadeRule().min_saved_tokens, CascadeRule().member_cost_tokens],
        "cascade_rule_scored": scored,
        "cascade_disturbed": sum(r["disturbed"] for r in grid + sweep),
        "cascade_rule_right": round(sum(r["rule_right"] for r in grid + sweep) / len(grid + sweep), 3),
        "step_cascade_case": None if step is None else f"{step['model']} {step['dtype']} {step['case']}",
        "step_speedup_cascade": None if step is None else round(step["speedup"], 2),
        "step_cascade_planned": None if step is None else step["cascade_planned"],
        "model_step": {f"{r['model']} {r['dtype']} {r['case']} {r['base']}/{r['new']}":
                       {k: round(r[k], 3) for k in (f"{r['base']}_ms", f"{r['new']}_ms", "speedup", "greedy_same")} for r in model},
        "other_processes_busy_cores": round(watch.other_cores, 2),
    }
    for r in kernel:
        print(f"{r['case']:>16} {r['dtype']:>8}: padded {r['padded_ms']:8.2f} ms ({r['bytes_ratio_padded']:.2f}x Σctx bytes)"
              f"  exact {r['exact_ms']:7.2f} ms ({r['bytes_ratio_exact']:.3f}x, {r['exact_num_chunks']} chunks of {r['exact_chunk_len']})"
              f"  speedup {r['speedup']:.2f}x  max|diff| {r['max_abs_diff']:.1e}")
    for r in grid:
        print(f"cascade {r['case']:>28} {r['dtype']:>8}: exact {r['exact_layer_ms']:7.2f} ms  cascade {r['cascade_layer_ms']:6.2f} ms"
              f"  padded {r['padded_layer_ms']:7.2f} ms  speedup {r['speedup']:5.2f}x  KV read {r['kv_read_ratio']:5.1f}x less"
              f"  rule: {r['rule']} ({'right' if r['rule_right'] else 'WRONG'})")
    print(f"cost rule (derived per dtype, min_saved_tokens + member_cost_tokens x members: "
          f"{'; '.join(f'{dt}: {r.min_saved_tokens} + {r.member_cost_tokens}' for dt, (r, _) in derived.items())}): cascade a shared "
          f"node when (members - 1) x shared tokens >= {rule.min_saved_tokens} + {rule.member_cost_tokens} x members")
    for s in scored:
        print(f"  {s['rule']}: loss {s['loss']:.2f}, wrong {s['wrong']}")
    for r in model:
        print(f"model step {r['model']} {r['dtype']} {r['case']:>16}: {r['base']} {r[r['base'] + '_ms']:7.1f} ms"
              f"  {r['new']} {r[r['new'] + '_ms']:7.1f} ms  speedup {r['speedup']:.2f}x  argmax same {r['greedy_same']:.0%} (random KV)"
              + ("" if r["new"] != "cascade" else f"  (cascade plan: {r['cascade_planned']})"))
    title = (f"# Decode attention, SmolLM2-135M shapes (9 heads, 3 KV heads, head_dim 64, block 16), {args.threads} threads, "
             f"median of {args.repeats} alternating calls\n\nPadded vs exact on batch {args.batch}. KV MB read: from the cache, "
             f"per layer, padding included (each backend also writes them to a copy and reads that back).")
    out = Outputs.for_run(args, "bench_attention")
    rules = {"dtype": rules_dtype, "scored": scored, "derived": f"cascade a shared node when (members - 1) x shared tokens >= "
             f"{rule.min_saved_tokens} + {rule.member_cost_tokens} x members"}
    write_outputs(out, kernel, model, cascade_markdown(grid, sweep, rules), {"cascade_grid": grid, "rule_sweep": sweep}, figures, title)
    out.png(plot(grid, harness.pyplot(), f"Decode attention per layer, SmolLM2 shapes, {args.threads} threads: cascade vs exact"))
    harness.finish(figures)


if __name__ == "__main__":
    main()
