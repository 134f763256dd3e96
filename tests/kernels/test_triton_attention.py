"""The Triton cascade decode backend (under Triton's CPU interpreter): its merge kernel against
``merge_attention_states``, and its attention against reference attention and the torch cascade
backend on random prefix trees, GQA shapes, block sizes, head dims and dtypes, and through
``AttentionMetadata`` / ``paged_attention``."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported: @triton.jit reads it

import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the `test` extra installs it)")

from kernels.backends import (
    available_decode_attentions,
    get_decode_attention,
    register_decode_attention,
    unregister_decode_attention,
)
from kernels.cascade_attention import ALWAYS, CascadeDecodeAttention, CascadeRule
from kernels.merge_attention import merge_attention_states
from kernels.paged_attention import AttentionMetadata, paged_attention, reference_attention, write_kv
from kernels.triton_attention import (
    INTERPRETED,
    MAX_UNIT_ROWS,
    TritonCascadeDecodeAttention,
    TritonCascadePlan,
    triton_merge_attention_states,
)
from tests.kernels.test_cascade_attention import make_cache, random_tree_tables

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="triton was imported before TRITON_INTERPRET=1 was set: these tests run the kernels on CPU tensors")


def reference(query: torch.Tensor, full_k: list[torch.Tensor], full_v: list[torch.Tensor]) -> torch.Tensor:  # [nd, H, D] fp32
    return torch.cat([reference_attention(query[i : i + 1].float(), k.float(), v.float(), 0.25) for i, (k, v) in enumerate(zip(full_k, full_v))])


def check(out: torch.Tensor, truth: torch.Tensor, other: torch.Tensor) -> None:
    """fp32: equal to the truth and to ``other`` (another backend's output) within 1e-5; bf16: no
    worse than ``other``, which rounds too (as the torch cascade tests)."""
    assert out.dtype == other.dtype and out.shape == truth.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, truth, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, other, atol=1e-5, rtol=1e-5)
    else:
        err, err_other = (out.float() - truth).abs(), (other.float() - truth).abs()
        assert err.max() <= 2 * err_other.max() + 2e-2, (err.max(), err_other.max())
        assert err.mean() <= 2 * err_other.mean() + 1e-3, (err.mean(), err_other.mean())


def run_case(backend: TritonCascadeDecodeAttention, gen: torch.Generator, tables: list[list[int]], lens: list[int], block_size: int,
             num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> TritonCascadePlan:
    """Plan and run ``backend`` on one batch; check it against reference attention, the padded
    backend and the torch cascade backend under the same rule. Returns the plan."""
    k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, block_size, num_kv_heads, head_dim, dtype)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    plan = backend.plan(lens, table, block_size)
    out = backend.forward(query, k_cache, v_cache, plan, 0.25)
    truth = reference(query, full_k, full_v)
    padded = get_decode_attention("padded")
    check(out, truth, padded.forward(query, k_cache, v_cache, padded.plan(lens, table, block_size), 0.25))
    torch_cascade = CascadeDecodeAttention(backend.rule)
    check(out, truth, torch_cascade.forward(query, k_cache, v_cache, torch_cascade.plan(lens, table, block_size), 0.25))
    return plan


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_merge_kernel_equals_torch_merge(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    o = torch.randn(3, 5, 7, 24, generator=gen).to(dtype)
    lse = torch.randn(3, 5, 7, generator=gen) * 4
    lse[1, 2] = float("-inf")  # an empty part, with garbage output
    o[1, 2] = float("nan")
    lse[:, 4, 3] = float("-inf")  # every part empty
    out, merged = triton_merge_attention_states(o, lse)
    ref, ref_lse = merge_attention_states(o, lse)
    assert out.dtype == dtype and merged.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)  # bf16: the interpreter truncates (<= 1 ulp)
    torch.testing.assert_close(merged, ref_lse, atol=1e-6, rtol=1e-6)
    assert (out[4, 3] == 0).all() and torch.isneginf(merged[4, 3]).all()
    listed, listed_lse = triton_merge_attention_states(list(o[:2]), list(lse[:2]))  # parts as a list
    torch.testing.assert_close(listed.float(), merge_attention_states(o[:2], lse[:2])[0].float(), atol=tol, rtol=tol)
    assert torch.isneginf(listed_lse[4, 3]).all()
    with pytest.raises(ValueError, match="do not match"):
        triton_merge_attention_states(o, lse[..., :4])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_reference_on_random_trees(block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    rng, gen = random.Random(block_size + num_heads), torch.Generator().manual_seed(block_size + num_heads)
    backend = TritonCascadeDecodeAttention(ALWAYS)
    num_shared, parts = 0, 0
    for _ in range(3):
        tables, lens, _ = random_tree_tables(rng, block_size)
        plan = run_case(backend, gen, tables, lens, block_size, num_heads, num_kv_heads, 16, dtype)
        num_shared += len(plan.cascade.nodes) if plan.cascade is not None else 0
        parts = max(parts, plan.num_parts)
    assert num_shared >= 2 and parts >= 2  # the shared path ran


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (24, 8)])
def test_other_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    """64 (a model's head dim); 24 and 8 are not powers of two / below tl.dot's 16: padded and masked."""
    rng, gen = random.Random(head_dim), torch.Generator().manual_seed(head_dim)
    tables, lens, _ = random_tree_tables(rng, block_size)
    while len(lens) < 4:
        tables, lens, _ = random_tree_tables(rng, block_size)
    shared = list(range(9000, 9003))  # make sure a shared node exists
    tables = [shared + t for t in tables]
    lens = [len(shared) * block_size + n for n in lens]
    plan = run_case(TritonCascadeDecodeAttention(ALWAYS), gen, tables, lens, block_size, 8, 2, head_dim, torch.float32)
    assert plan.cascade is not None


def test_cost_rule_keeps_only_the_nodes_that_pay() -> None:
    """Only the sub-group's long document pays; the short root header is read in each rest."""
    header, doc = [1], list(range(10, 18))  # 16 tokens shared by all four; 128 by the first three
    tables = [header + doc + [40 + i] for i in range(3)] + [header + [50, 51]]
    lens = [16 + 128 + 5 + i for i in range(3)] + [16 + 20]
    backend = TritonCascadeDecodeAttention(CascadeRule(min_saved_tokens=2 * 128, member_cost_tokens=0))
    plan = run_case(backend, torch.Generator().manual_seed(4), tables, lens, 16, 9, 3, 16, torch.float32)
    assert [n.members for n in plan.cascade.nodes] == [[0, 1, 2]] and plan.num_parts == 2
    shared, rest = plan.batches
    assert shared.rows.tolist() == [[0, 1, 2]] and shared.slots.tolist() == [[0, 1, 2]] and shared.lens.tolist() == [128]
    assert rest.rows.tolist() == [[0], [1], [2], [3]] and rest.slots.tolist() == [[4], [5], [6], [7]]  # part 1 × 4 sequences
    assert rest.lens.tolist() == [21, 22, 23, 36]
    assert plan.kv_tokens_read() == 128 + (2 + 2 + 2 + 3) * 16


def test_no_shared_node_is_one_part_per_sequence() -> None:
    tables, lens = [[3, 4], [5], [6, 7, 8]], [20, 9, 40]
    plan = run_case(TritonCascadeDecodeAttention(ALWAYS), torch.Generator().manual_seed(5), tables, lens, 16, 8, 2, 16, torch.float32)
    assert plan.cascade is None and plan.num_parts == 1 and len(plan.batches) == 1
    assert plan.batches[0].rows.tolist() == [[0], [1], [2]] and plan.batches[0].lens.tolist() == lens
    # Shared blocks that do not pay under the default rule: the same, one unit per sequence.
    plan = run_case(TritonCascadeDecodeAttention(), torch.Generator().manual_seed(6), [[1, 2], [1, 3]], [30, 25], 16, 4, 4, 16, torch.bfloat16)
    assert plan.cascade is None and plan.batches[0].blocks.shape == (2, 2)


def test_no_rest_at_all() -> None:
    """Contexts that end exactly on shared blocks (a two-level tree): no one-row units."""
    tables, lens = [[4, 5], [4, 5], [4, 6], [4, 6]], [32] * 4
    plan = run_case(TritonCascadeDecodeAttention(ALWAYS), torch.Generator().manual_seed(3), tables, lens, 16, 9, 3, 16, torch.float32)
    assert plan.num_parts == 3 and len(plan.batches) == 1 and plan.cascade.rest_seqs.numel() == 0
    assert plan.batches[0].rows.tolist() == [[0, 1, 2, 3], [0, 1, -1, -1], [2, 3, -1, -1]]  # the root, then its children


def test_a_big_group_is_split_into_units() -> None:
    n = MAX_UNIT_ROWS + 3
    tables, lens = [[0, 1] + [10 + i] for i in range(n)], [32 + 1 + i % 16 for i in range(n)]
    plan = run_case(TritonCascadeDecodeAttention(ALWAYS), torch.Generator().manual_seed(7), tables, lens, 16, 8, 2, 16, torch.float32)
    assert [sum(r >= 0 for r in row) for row in plan.batches[0].rows.tolist()] == [MAX_UNIT_ROWS, 3]
    assert plan.kv_tokens_read() == 2 * 32 + n * 16  # the shared prefix once per unit


def test_registry_and_paged_attention_on_a_mixed_batch() -> None:
    assert isinstance(get_decode_attention("triton"), TritonCascadeDecodeAttention)
    assert "triton" in available_decode_attentions("cpu")
    register_decode_attention("triton-always", TritonCascadeDecodeAttention(ALWAYS))
    try:
        for name in ("triton", "triton-always"):
            _check_mixed_batch(name)
    finally:
        unregister_decode_attention("triton-always")


def _check_mixed_batch(decode_attention: str) -> None:
    """Three decodes sharing a 2-block prompt, a fresh prompt and a chunked continuation, through ``AttentionMetadata.build`` and ``paged_attention``."""
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, d, bs = 9, 3, 16, 4
    shapes = [(12, 1), (10, 1), (9, 1), (7, 7), (13, 5)]  # (context_len, query_len)
    k_cache, v_cache = torch.zeros(40, bs, kv_heads, d), torch.zeros(40, bs, kv_heads, d)
    prompt = torch.randn(8, kv_heads, d, generator=gen), torch.randn(8, kv_heads, d, generator=gen)
    tables = [[0, 1, 2], [0, 1, 3], [0, 1, 10], [4, 5], [6, 7, 8, 9]]
    full_k, full_v = [], []
    for i, (ctx, _) in enumerate(shapes):
        k, v = torch.randn(ctx, kv_heads, d, generator=gen), torch.randn(ctx, kv_heads, d, generator=gen)
        if i < 3:  # the decodes' shared prompt
            k[:8], v[:8] = prompt
        full_k.append(k)
        full_v.append(v)
    slots = [[t[p // bs] * bs + p % bs for p in range(ctx)] for (ctx, _), t in zip(shapes, tables)]
    for (ctx, q), s, k, v in zip(shapes, slots, full_k, full_v):  # what earlier steps wrote
        write_kv(k[: ctx - q], v[: ctx - q], k_cache, v_cache, torch.tensor(s[: ctx - q], dtype=torch.int64))
    new = [s[ctx - q :] for (ctx, q), s in zip(shapes, slots)]
    meta = AttentionMetadata.build([q for _, q in shapes], [c for c, _ in shapes], [slot for s in new for slot in s], tables, bs, decode_attention=decode_attention)
    new_k = torch.cat([k[c - q :] for (c, q), k in zip(shapes, full_k)])
    new_v = torch.cat([v[c - q :] for (c, q), v in zip(shapes, full_v)])
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    query = torch.randn(sum(q for _, q in shapes), heads, d, generator=gen)
    out = paged_attention(query, new_k, new_v, k_cache, v_cache, meta, scale=0.25)
    starts = meta.query_start_loc
    expected = torch.cat([reference_attention(query[a:b], k, v, 0.25) for a, b, k, v in zip(starts, starts[1:], full_k, full_v)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert isinstance(meta.decode_plan, TritonCascadePlan)
    assert (meta.decode_plan.cascade is not None) == (decode_attention == "triton-always")


@pytest.mark.integration  # a subprocess: triton imported without TRITON_INTERPRET
def test_cpu_without_the_interpreter_is_a_clear_error() -> None:
    code = (
        "import torch\n"
        "from kernels.triton_attention import TritonCascadeDecodeAttention\n"
        "b = TritonCascadeDecodeAttention()\n"
        "plan = b.plan([3], torch.tensor([[0]]), 4)\n"
        "try:\n"
        "    b.forward(torch.zeros(1, 2, 16), torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16), plan, 0.25)\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "TRITON_INTERPRET=1" in done.stdout
