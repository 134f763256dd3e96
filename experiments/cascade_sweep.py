"""The cascade part of ``bench_attention.py``: shared-prefix batches, cascade vs per-request decode
attention on them, the cost rule derived from where cascade stops paying, and the plot.

A batch is a prefix tree laid out on a shuffled block cache: named shared segments (a system
prompt, a document) whose blocks every request naming them holds at the same table positions, as
prefix caching and prefix-aware migration leave them, then each request's own suffix (seeded
ragged lengths). Backends run on one layer's cache (SmolLM2 shapes) through their own ``plan`` and
``forward``, alternating call by call; a backend's *per-layer* time is its ``forward`` plus its
``plan`` divided by the model's layers (a plan is built once per step and shared by every layer).

The rule: every configuration of the rule sweep is one group of ``members`` requests sharing a
``prefix``; ``CascadeRule`` keeps such a node when ``(members - 1) × prefix >= min_saved_tokens +
member_cost_tokens × members``. The derived pair is the one that loses the least time over the
sweep and the grid's one-level batches (the loss of a configuration: the chosen backend's time over
the faster's, minus 1). The
rule without the per-member term, vLLM's and the one ``kernels`` holds are scored the same way.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from harness import LoadWatch
from kernels.cascade_attention import ALWAYS, CascadeDecodeAttention, CascadePlan, CascadeRule
from kernels.decode_attention import DecodeAttention, ExactDecodeAttention, PaddedDecodeAttention

SMOLLM2 = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, num_layers=30)
# A configuration during which the rest of the machine used more than MAX_OTHER_CORES (plus
# SLACK_S of CPU time: the jiffy counters are too coarse for a window of a few ms) is measured again.
MAX_OTHER_CORES = 0.3
SLACK_S = 0.03
RETRIES = 3
T = TypeVar("T")


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


def measure_quietly(what: str, retries: int, fn: Callable[[], T]) -> tuple[T, float, bool]:
    """``fn()``, redone (up to ``retries`` times, after a pause) while the rest of this shared machine
    used more than ``MAX_OTHER_CORES`` meanwhile. Returns the result, the cores others used during
    the one kept, and whether it was still disturbed."""
    for attempt in range(retries + 1):
        with LoadWatch(period=None) as watch:  # no polling thread: it would disturb the timings
            result = fn()
        disturbed = watch.other_cores * watch.seconds > MAX_OTHER_CORES * watch.seconds + SLACK_S
        if not disturbed:
            break
        print(f"  {what}: others used {watch.other_cores:.2f} cores meanwhile"
              + ("; measuring again" if attempt < retries else "; keeping it, marked disturbed"), flush=True)
        time.sleep(2.0 * (attempt + 1))
    return result, watch.other_cores, disturbed


@dataclass
class SharedBatch:
    """A decode batch whose block tables share segments; context ``i`` ends in its own suffix."""

    name: str
    contexts: list[int]  # [n]
    tables: list[list[int]]  # [n][blocks] physical block ids
    num_blocks: int  # blocks in the cache
    num_unique_tokens: int  # tokens of the distinct blocks' contents (shared segments once)

    def table(self) -> torch.Tensor:  # [n, max blocks] int64, padded with 0
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int64)


def tree_batch(name: str, segments: dict[str, int], paths: Sequence[Sequence[str]], own_tokens: Sequence[int],
               block_size: int, gen: torch.Generator) -> SharedBatch:
    """Request ``i`` holds the blocks of ``paths[i]``'s segments (same name, same physical blocks;
    each a whole number of blocks long) in order, then ``own_tokens[i]`` tokens of its own."""
    for seg, tokens in segments.items():
        if tokens % block_size:
            raise ValueError(f"segment {seg!r} has {tokens} tokens, not a multiple of the block size {block_size}")
    own_blocks = [-(-t // block_size) for t in own_tokens]
    num_blocks = sum(t // block_size for t in segments.values()) + sum(own_blocks) + 16
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seg_blocks = {seg: [perm.pop() for _ in range(tokens // block_size)] for seg, tokens in segments.items()}
    tables = [[b for seg in path for b in seg_blocks[seg]] + [perm.pop() for _ in range(nb)] for path, nb in zip(paths, own_blocks)]
    contexts = [sum(segments[s] for s in path) + own for path, own in zip(paths, own_tokens)]
    return SharedBatch(name, contexts, tables, num_blocks, sum(segments.values()) + sum(own_tokens))


def one_level(num_requests: int, prefix: int, suffix: tuple[int, int], block_size: int, rng: random.Random,
              gen: torch.Generator) -> SharedBatch:
    """``num_requests`` sharing one ``prefix``-token prompt, own suffixes uniform in ``suffix``."""
    own = [rng.randint(*suffix) for _ in range(num_requests)]
    return tree_batch(f"{num_requests} x {prefix}", {"prompt": prefix}, [("prompt",)] * num_requests, own, block_size, gen)


def two_level(num_requests: int, root: int, num_docs: int, doc: int, suffix: tuple[int, int], block_size: int,
              rng: random.Random, gen: torch.Generator) -> SharedBatch:
    """A ``root``-token system prompt shared by all, then one of ``num_docs`` ``doc``-token documents
    (each shared by ``num_requests / num_docs``), then own suffixes."""
    segments = {"system": root, **{f"doc{d}": doc for d in range(num_docs)}}
    paths = [("system", f"doc{i * num_docs // num_requests}") for i in range(num_requests)]
    own = [rng.randint(*suffix) for _ in range(num_requests)]
    return tree_batch(f"{num_requests}: {root} + {num_docs} docs x {doc}", segments, paths, own, block_size, gen)


def compare(batch: SharedBatch, backends: dict[str, DecodeAttention], dtype: torch.dtype, repeats: int,
            seed: int, retries: int = RETRIES) -> dict[str, Any]:
    """Every backend's plan and forward on ``batch`` over one layer's random cache: times (median of
    alternating calls), KV read, and each output's largest difference from ``exact``'s."""
    h, kvh, d, bs = (SMOLLM2[k] for k in ("num_heads", "num_kv_heads", "head_dim", "block_size"))
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(batch.num_blocks, bs, kvh, d, generator=gen).to(dtype)  # [NB, BS, KVH, D]
    v_cache = torch.randn(batch.num_blocks, bs, kvh, d, generator=gen).to(dtype)
    n = len(batch.contexts)
    query = torch.randn(n, h, d, generator=gen).to(dtype)  # [n, H, D]
    table = batch.table()
    plans = {b: be.plan(batch.contexts, table, bs) for b, be in backends.items()}
    run = {b: (lambda be=be, p=plans[b]: be.forward(query, k_cache, v_cache, p, d**-0.5)) for b, be in backends.items()}
    outs = {b: fn().float() for b, fn in run.items()}  # type: ignore[union-attr]
    (plan_s, fwd_s), others, disturbed = measure_quietly(
        f"{batch.name} {str(dtype).removeprefix('torch.')}", retries,
        lambda: (alternate({b: (lambda be=be: be.plan(batch.contexts, table, bs)) for b, be in backends.items()}, repeats),
                 alternate(run, repeats)))
    token_bytes = 2 * kvh * d * torch.finfo(dtype).bits // 8  # K and V of one token in one layer
    row: dict[str, Any] = {
        "case": batch.name, "dtype": str(dtype).removeprefix("torch."), "requests": n, "sum_ctx": sum(batch.contexts),
        "unique_kv_mb": batch.num_unique_tokens * token_bytes / 1e6, "others_cores": others,
        "disturbed": disturbed,
    }
    for b, plan in plans.items():
        row[f"{b}_ms"] = fwd_s[b] * 1e3
        row[f"{b}_plan_us"] = plan_s[b] * 1e6
        row[f"{b}_layer_ms"] = (fwd_s[b] + plan_s[b] / SMOLLM2["num_layers"]) * 1e3  # the plan is shared by all layers
        row[f"{b}_kv_mb_read"] = plan.kv_tokens_read() * token_bytes / 1e6
        if isinstance(plan, CascadePlan):  # every shared node as (tokens, members): what a rule decides on
            row["nodes"] = [(n.num_blocks * bs, len(n.members)) for n in plan.tree.nodes()]
        if b != "exact":
            row[f"{b}_max_abs_diff"] = (outs[b] - outs["exact"]).abs().max().item()
    return row


def kernel_backends() -> dict[str, DecodeAttention]:
    """What the sweep compares: per-request ``exact`` and ``padded``, and cascade forced on every shared node."""
    return {"exact": ExactDecodeAttention(), "cascade": CascadeDecodeAttention(ALWAYS), "padded": PaddedDecodeAttention()}


def cascade_grid(requests: Sequence[int], prefixes: Sequence[int], trees: Sequence[tuple[int, int, int, int]],
                 suffix: tuple[int, int], dtype: torch.dtype, repeats: int, seed: int,
                 retries: int = RETRIES) -> list[dict[str, Any]]:
    """Cascade vs exact and padded on one-level batches (``requests`` × ``prefixes``) and two-level
    trees (``(requests, root, docs, doc)``)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    bs = SMOLLM2["block_size"]
    backends = kernel_backends()
    rows = []
    batches = [(one_level(n, p, suffix, bs, rng, gen), p) for p in prefixes for n in requests]
    batches += [(two_level(n, root, docs, doc, suffix, bs, rng, gen), root + doc) for n, root, docs, doc in trees]
    for batch, shared in batches:
        row = compare(batch, backends, dtype, repeats, seed, retries)
        row["prefix"], row["tree"] = shared, len(row["nodes"]) > 1
        row["speedup"] = row["exact_layer_ms"] / row["cascade_layer_ms"]
        row["kv_read_ratio"] = row["exact_kv_mb_read"] / row["cascade_kv_mb_read"]
        rows.append(row)
    return rows


# ---- the cost rule ---------------------------------------------------------------------------------------
def rule_sweep(members: Sequence[int], prefixes: Sequence[int], suffix: tuple[int, int], dtype: torch.dtype,
               repeats: int, seed: int, retries: int = RETRIES) -> list[dict[str, Any]]:
    """Cascade (forced) vs exact on one group of ``members`` sharing ``prefix`` tokens, per configuration."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    backends = {"exact": ExactDecodeAttention(), "cascade": CascadeDecodeAttention(ALWAYS)}
    rows = []
    for p in prefixes:
        for m in members:
            row = compare(one_level(m, p, suffix, SMOLLM2["block_size"], rng, gen), backends, dtype, repeats, seed, retries)
            row.update(members=m, prefix=p, saved_tokens=(m - 1) * p, speedup=row["exact_layer_ms"] / row["cascade_layer_ms"])
            rows.append(row)
    return rows


def decides_cascade(row: dict[str, Any], pays: Callable[[int, int], bool]) -> bool:
    """Whether a rule ``pays(tokens, members)`` keeps any shared node of the row's batch (else the
    step runs ``exact``)."""
    return any(pays(tokens, members) for tokens, members in row["nodes"])


def rule_loss(rows: list[dict[str, Any]], pays: Callable[[int, int], bool]) -> tuple[float, int]:
    """Σ over configurations of (time of the backend ``pays(tokens, members)`` picks / the faster
    one's) - 1, and the number of configurations where it picked the slower."""
    loss, wrong = 0.0, 0
    for r in rows:
        chosen = r["cascade_layer_ms"] if decides_cascade(r, pays) else r["exact_layer_ms"]
        best = min(r["cascade_layer_ms"], r["exact_layer_ms"])
        loss, wrong = loss + chosen / best - 1, wrong + (chosen > best)
    return loss, wrong


def derive_rule(rows: list[dict[str, Any]]) -> tuple[CascadeRule, list[dict[str, Any]]]:
    """The ``CascadeRule`` that loses least over ``rows`` (one-level batches: the sweep's and the
    grid's; ``min_saved_tokens`` in steps of 128,
    ``member_cost_tokens`` of 32; of the pairs that tie, the one nearest their centroid, so the
    rule sits inside the region that decides as well, not on its edge), and how it and other rules
    score: the best without a per-member term, vLLM's, and the one in ``kernels`` now."""
    top = max((m - 1) * t for r in rows for t, m in r["nodes"]) + 128
    grid = [(t, m) for t in range(0, top, 128) for m in range(0, 1024, 32)]
    losses = {tm: rule_loss(rows, CascadeRule(*tm).pays)[0] for tm in grid}
    least = min(losses.values())
    ties = [tm for tm, v in losses.items() if v <= least + 1e-9]
    mid_t, mid_m = (statistics.fmean(x[i] for x in ties) for i in (0, 1))
    rule = CascadeRule(*min(ties, key=lambda tm: ((tm[0] - mid_t) / 128) ** 2 + ((tm[1] - mid_m) / 32) ** 2))
    one_term = min((t for t, m in grid if m == 0), key=lambda t: (losses[(t, 0)], t))
    rules: list[tuple[str, Callable[[int, int], bool]]] = [
        (f"derived: (members - 1) x tokens >= {rule.min_saved_tokens} + {rule.member_cost_tokens} x members", rule.pays),
        (f"saving only: (members - 1) x tokens >= {one_term}", CascadeRule(one_term, 0).pays),
        ("vLLM: tokens >= 256 and members >= 8", lambda tokens, members: tokens >= 256 and members >= 8),
        (f"kernels' default now: >= {CascadeRule().min_saved_tokens} + {CascadeRule().member_cost_tokens} x members", CascadeRule().pays),
    ]
    return rule, [{"rule": name, **dict(zip(("loss", "wrong"), rule_loss(rows, pays)))} for name, pays in rules]


def mark(row: dict[str, Any], rule: CascadeRule) -> None:
    """Record what ``rule`` decides for the row's batch (a cascade plan or an exact step) and
    whether that was the faster backend."""
    pays = decides_cascade(row, rule.pays)
    row["rule"] = "cascade" if pays else "exact"
    row["rule_right"] = (row["cascade_layer_ms"] <= row["exact_layer_ms"]) == pays


# ---- the plot --------------------------------------------------------------------------------------------
def plot(rows: list[dict[str, Any]], pyplot: Any, title: str) -> Any:
    """Attention time per layer vs requests, a line per prefix (exact dashed, cascade solid), one panel per dtype."""
    plt = pyplot
    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: d != "bfloat16")
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        one = [r for r in rows if r["dtype"] == dtype and not r["tree"]]
        for i, prefix in enumerate(sorted({r["prefix"] for r in one})):
            pts = sorted((r["requests"], r["exact_layer_ms"], r["cascade_layer_ms"]) for r in one if r["prefix"] == prefix)
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "--o", color=color, label=f"exact, {prefix} prefix")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "-s", color=color, label=f"cascade, {prefix} prefix")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("requests sharing the prefix (128±64-token own suffixes)")
        ax.set_ylabel("attention ms per layer (plan amortized)")
        ax.set_title(dtype)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
