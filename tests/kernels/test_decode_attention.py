"""Decode-attention backends: ``exact`` (split-K) equals the padded path and plain attention on random
mixed batches; its chunk plan reads Σctx, not batch × longest context."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from kernels.backends import (
    available_decode_attentions,
    default_decode_attention,
    get_decode_attention,
    register_decode_attention,
    unregister_decode_attention,
)
from kernels.decode_attention import (
    MAX_CHUNK_TOKENS,
    MAX_PADDING_FRACTION,
    ExactDecodeAttention,
    choose_chunk_len,
)
from kernels.paged_attention import AttentionMetadata, paged_attention, reference_attention, write_kv


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    new_k: torch.Tensor  # [T, KVH, D]
    new_v: torch.Tensor
    k_cache: torch.Tensor  # [NB, BS, KVH, D]
    v_cache: torch.Tensor
    shapes: list[tuple[int, int]]  # (context_len, query_len), decodes first
    tables: list[list[int]]
    slots: list[int]
    full_k: list[torch.Tensor]  # [ctx, KVH, D] per sequence, the contiguous truth
    full_v: list[torch.Tensor]
    block_size: int

    def meta(self, backend: str) -> AttentionMetadata:
        return AttentionMetadata.build(
            [q for _, q in self.shapes], [c for c, _ in self.shapes], self.slots, self.tables, self.block_size,
            decode_attention=backend,
        )

    def run(self, backend: str) -> torch.Tensor:  # [T, H, D]
        d = self.query.shape[-1]
        return paged_attention(self.query, self.new_k, self.new_v, self.k_cache, self.v_cache, self.meta(backend), d**-0.5)

    def reference(self) -> torch.Tensor:  # [T, H, D] fp32
        d = self.query.shape[-1]
        rows, start = [], 0
        for (_, q), k, v in zip(self.shapes, self.full_k, self.full_v):
            rows.append(reference_attention(self.query[start : start + q].float(), k.float(), v.float(), d**-0.5))
            start += q
        return torch.cat(rows)


def make_batch(
    gen: torch.Generator,
    shapes: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    block_size: int = 4,
    head_dim: int = 16,
    spare_blocks: int = 8,
) -> Batch:
    """Sequences on shuffled (non-contiguous) blocks, earlier tokens already cached, this step's written."""
    need = [-(-ctx // block_size) for ctx, _ in shapes]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    # Garbage, not zeros, in unwritten slots: padding must be masked, not merely small.
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) * 100
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) * 100
    tables = [[perm.pop() for _ in range(n)] for n in need]
    full_k = [torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype) for ctx, _ in shapes]
    full_v = [torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype) for ctx, _ in shapes]
    slots_of = [[t[p // block_size] * block_size + p % block_size for p in range(ctx)] for (ctx, _), t in zip(shapes, tables)]
    for (ctx, q), slots, k, v in zip(shapes, slots_of, full_k, full_v):
        if ctx > q:
            write_kv(k[: ctx - q], v[: ctx - q], k_cache, v_cache, torch.tensor(slots[: ctx - q]))
    new_slots = [s for (ctx, q), slots in zip(shapes, slots_of) for s in slots[ctx - q :]]
    new_k = torch.cat([k[ctx - q :] for (ctx, q), k in zip(shapes, full_k)])
    new_v = torch.cat([v[ctx - q :] for (ctx, q), v in zip(shapes, full_v)])
    write_kv(new_k, new_v, k_cache, v_cache, torch.tensor(new_slots))
    query = torch.randn(new_k.shape[0], num_heads, head_dim, generator=gen).to(dtype)
    return Batch(query, new_k, new_v, k_cache, v_cache, shapes, tables, new_slots, full_k, full_v, block_size)


def random_shapes(rng: random.Random, max_ctx: int) -> list[tuple[int, int]]:
    """1..12 decodes of context 1..max_ctx, then 0..2 prefill chunks (fresh or over a cached prefix)."""
    shapes = [(rng.randint(1, max_ctx), 1) for _ in range(rng.randint(1, 12))]
    for _ in range(rng.randint(0, 2)):
        q = rng.randint(2, 9)
        shapes.append((q + rng.choice([0, rng.randint(1, max_ctx)]), q))
    return shapes


HEADS = [(4, 4), (8, 2), (9, 3)]  # MHA, GQA 4, SmolLM2's GQA 3


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_exact_matches_reference_and_padded_fp32(num_heads: int, num_kv_heads: int) -> None:
    rng, gen = random.Random(num_heads), torch.Generator().manual_seed(num_heads)
    num_split = 0
    for i in range(12):
        batch = make_batch(gen, random_shapes(rng, 400 if i % 2 else 40), num_heads, num_kv_heads, torch.float32)
        plan = batch.meta("exact").decode_plan
        num_split += plan is not None and plan.merge_slot is not None
        exact = batch.run("exact")
        torch.testing.assert_close(exact, batch.reference(), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(exact, batch.run("padded"), atol=2e-5, rtol=2e-5)
    assert num_split >= 3  # the per-step chunk choice did split sequences (the merge path ran)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_exact_is_as_close_to_fp32_attention_as_padded_in_bf16(num_heads: int, num_kv_heads: int) -> None:
    """bf16 caches: both paths round; the split-K merge (of bf16 partial outputs) may add about an ulp."""
    rng, gen = random.Random(100 + num_heads), torch.Generator().manual_seed(100 + num_heads)
    for i in range(12):
        batch = make_batch(gen, random_shapes(rng, 400 if i % 2 else 40), num_heads, num_kv_heads, torch.bfloat16)
        truth = batch.reference()
        err_exact = (batch.run("exact").float() - truth).abs()
        err_padded = (batch.run("padded").float() - truth).abs()
        assert err_exact.max() <= 2 * err_padded.max() + 2e-2, (err_exact.max(), err_padded.max())
        assert err_exact.mean() <= 2 * err_padded.mean() + 1e-3, (err_exact.mean(), err_padded.mean())


@pytest.mark.parametrize("chunk_blocks", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_splits_merge_exactly(chunk_blocks: int, dtype: torch.dtype) -> None:
    """Every sequence split into many chunks (the merge path) still equals the padded path."""
    rng, gen = random.Random(chunk_blocks), torch.Generator().manual_seed(chunk_blocks)
    register_decode_attention("_test_split", ExactDecodeAttention(chunk_len=4 * chunk_blocks))
    try:
        for _ in range(6):
            batch = make_batch(gen, random_shapes(rng, 60), 9, 3, dtype)
            plan = batch.meta("_test_split").decode_plan
            assert plan is not None and plan.unit_len == 4 * chunk_blocks
            if dtype == torch.float32:
                torch.testing.assert_close(batch.run("_test_split"), batch.run("padded"), atol=2e-5, rtol=2e-5)
            else:
                torch.testing.assert_close(batch.run("_test_split").float(), batch.reference(), atol=3e-2, rtol=3e-2)
    finally:
        unregister_decode_attention("_test_split")


def test_exact_plan_reads_sum_of_contexts_padded_reads_batch_times_longest() -> None:
    ctx = [int(c) for c in torch.linspace(128, 4096, 16).round()]  # the bench's spread
    tables = [list(range(sum(-(-c // 16) for c in ctx[:i]), sum(-(-c // 16) for c in ctx[: i + 1]))) for i in range(len(ctx))]
    slots = [t[(c - 1) // 16] * 16 + (c - 1) % 16 for t, c in zip(tables, ctx)]
    exact = AttentionMetadata.build([1] * 16, ctx, slots, tables, 16, decode_attention="exact").decode_plan
    padded = AttentionMetadata.build([1] * 16, ctx, slots, tables, 16, decode_attention="padded").decode_plan
    assert exact is not None and padded is not None
    assert sum(ctx) <= exact.kv_tokens_read() <= (1 + MAX_PADDING_FRACTION) * sum(ctx)
    assert padded.kv_tokens_read() == 16 * 4096
    # The blocks it reads are exactly each sequence's own, in order (padding only in last chunks).
    valid = exact.valid.view(exact.num_units, -1) if exact.valid is not None else None
    assert valid is not None
    tokens = exact.block_ids.repeat_interleave(16, dim=1)[valid]  # block of every attended token
    expected = [t[p // 16] for t, c in zip(tables, ctx) for p in range(c)]
    assert tokens.tolist() == expected


@pytest.mark.parametrize("seed", range(5))
def test_chunk_len_bounds_padding(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        bs = rng.choice([4, 16])
        lens = [rng.randint(1, rng.choice([40, 600, 5000])) for _ in range(rng.randint(1, 40))]
        chunk = choose_chunk_len(lens, bs)
        ctx = torch.tensor(lens)
        assert chunk % bs == 0 and bs <= chunk <= max(bs, MAX_CHUNK_TOKENS)
        padding = int(((ctx + chunk - 1) // chunk).sum()) * chunk - int(ctx.sum())
        block_floor = int(((ctx + bs - 1) // bs).sum()) * bs - int(ctx.sum())
        assert padding <= max(MAX_PADDING_FRACTION * int(ctx.sum()), 64 * len(ctx)) or chunk == bs
        assert padding >= block_floor


def test_one_chunk_per_sequence_needs_no_merge() -> None:
    ctx = [300 + i for i in range(16)]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(16)]
    slots = [t[(c - 1) // 16] * 16 + (c - 1) % 16 for t, c in zip(tables, ctx)]
    plan = AttentionMetadata.build([1] * 16, ctx, slots, tables, 16, decode_attention="exact").decode_plan
    assert plan is not None and plan.num_units == 16 and plan.merge_slot is None and plan.unit_len == 320


def test_gather_buffers_are_reused_across_calls_and_inference_mode() -> None:
    """Later gathers into the scratch buffers (other shapes, inference mode or not) leave earlier outputs intact."""
    gen = torch.Generator().manual_seed(7)
    big = make_batch(gen, [(70, 1), (3, 1), (41, 1)], 9, 3, torch.float32)
    small = make_batch(gen, [(5, 1), (9, 1)], 9, 3, torch.float32)
    first = big.run("exact")
    with torch.inference_mode():
        inner = small.run("exact")
    second = small.run("exact")
    torch.testing.assert_close(first, big.reference(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(inner, small.reference(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(second, inner)


def test_backends_by_name() -> None:
    assert default_decode_attention("cpu") == "cascade"
    assert AttentionMetadata.build([1], [3], [2], [[0]], 4).decode_attention is get_decode_attention("cascade")
    cpu = available_decode_attentions("cpu")
    assert cpu[:3] == ["padded", "exact", "cascade"] and "flashinfer" not in cpu
    assert {n: get_decode_attention(n).kv_read for n in cpu[:3]} == {"padded": "padded", "exact": "sum", "cascade": "cascade"}
    with pytest.raises(ValueError, match="unknown decode attention"):
        get_decode_attention("flash9")
    with pytest.raises(ValueError, match="multiple of the block size"):
        ExactDecodeAttention(chunk_len=6).plan([5], torch.zeros(1, 2, dtype=torch.int64), 4)
