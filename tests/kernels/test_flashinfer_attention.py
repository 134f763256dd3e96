"""FlashInfer cascade backend: the per-level arrays it feeds ``MultiLevelCascadeAttentionWrapper``,
run through a torch emulation of FlashInfer's documented multi-level semantics and compared with
reference attention (CPU); the real kernel end to end only where CUDA and flashinfer exist."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from kernels.backends import get_decode_attention
from kernels.cascade_attention import ALWAYS, CascadeRule, find_prefix_tree
from kernels.flashinfer_attention import (
    FlashInferCascadeArrays,
    FlashInferCascadeDecodeAttention,
    FlashInferUnavailable,
    flashinfer_cascade_arrays,
)
from kernels.merge_attention import lse_from_base2, lse_to_base2, merge_attention_states
from kernels.paged_attention import reference_attention
from tests.kernels.test_cascade_attention import make_cache, random_tree_tables

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def emulate_multilevel_cascade(
    query: torch.Tensor,  # [nd, H, D] in the arrays' permuted order
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,
    arrays: FlashInferCascadeArrays,
    scale: float,
) -> torch.Tensor:  # [nd, H, D] permuted, fp32
    """``MultiLevelCascadeAttentionWrapper.run`` as FlashInfer documents it: at every level each
    ``qo_indptr`` range of queries attends to its paged KV (``kv_indptr``/``kv_indices``/
    ``kv_last_page_len``, length ``max(pages - 1, 0) · page_size + last_page_len``), returning a
    base-2 log-sum-exp (-inf for empty KV); ``run`` starts from the last level and merges the others
    into it in order 0, 1, ... Checks the arrays' contract on the way, and that no merge sees two
    empty states (``merge_state_in_place`` made that NaN before FlashInfer guarded it)."""
    nd, num_heads, _ = query.shape
    num_blocks, bs, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    states = []
    for qo, kv, pages, last in zip(arrays.qo_indptr, arrays.kv_indptr, arrays.kv_indices, arrays.kv_last_page_len):
        assert qo.dtype == kv.dtype == pages.dtype == last.dtype == torch.int32
        assert qo[0] == 0 and qo[-1] == nd and (qo.diff() >= 1).all()  # every query in exactly one group
        assert kv[0] == 0 and kv[-1] == pages.numel() and (kv.diff() >= 0).all() and len(kv) == len(qo) == len(last) + 1
        assert ((pages >= 0) & (pages < num_blocks)).all()
        num_pages = kv.diff()
        assert ((last >= 1) & (last <= bs) | (last == 0) & (num_pages == 0)).all()  # 0 only for empty groups
        o = torch.zeros(nd, num_heads, query.shape[2])
        lse2 = torch.full((nd, num_heads), float("-inf"))
        for g in range(len(last)):
            n = int(num_pages[g])
            kv_len = max(n - 1, 0) * bs + int(last[g])
            if kv_len == 0:
                continue
            blocks = pages[kv[g] : kv[g + 1]].long()
            k = k_cache[blocks].flatten(0, 1)[:kv_len].float().repeat_interleave(group, dim=1)  # [L, H, D]
            v = v_cache[blocks].flatten(0, 1)[:kv_len].float().repeat_interleave(group, dim=1)
            rows = slice(int(qo[g]), int(qo[g + 1]))
            scores = torch.einsum("mhd,lhd->mhl", query[rows].float(), k) * scale
            o[rows] = torch.einsum("mhl,lhd->mhd", scores.softmax(-1), v)
            lse2[rows] = lse_to_base2(scores.logsumexp(-1))
        states.append((o, lse2))
    out, lse2 = states[-1]
    for o, s in states[:-1]:
        assert not (torch.isneginf(lse2) & torch.isneginf(s)).any(), "a merge of two empty states"
        out, lse = merge_attention_states([out, o], [lse_from_base2(lse2), lse_from_base2(s)])
        lse2 = lse_to_base2(lse)
    assert not torch.isneginf(lse2).any()  # every query attended to something
    return out


def check_against_reference(
    arrays: FlashInferCascadeArrays, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, full_k: list, full_v: list
) -> None:
    order, inverse = arrays.order.long(), arrays.inverse.long()
    assert sorted(order.tolist()) == list(range(len(full_k))) and (order[inverse] == torch.arange(len(full_k))).all()
    out = emulate_multilevel_cascade(query[order], k_cache, v_cache, arrays, 0.25)[inverse]
    truth = torch.cat([reference_attention(query[i : i + 1].float(), k.float(), v.float(), 0.25) for i, (k, v) in enumerate(zip(full_k, full_v))])
    torch.testing.assert_close(out, truth, atol=1e-5, rtol=1e-5)


def check_reads(arrays: FlashInferCascadeArrays, lens: list[int], block_size: int) -> None:
    """Every kept segment once and each sequence's rest: the same reads as the torch cascade."""
    plan = arrays.cascade
    if plan is None:
        assert arrays.kv_tokens_read() == sum(-(-c // block_size) for c in lens) * block_size
        return
    shared = sum(b.numel() for b in plan.node_blocks) * block_size
    rest = sum(-(-n // block_size) for n in plan.rest_lens) * block_size
    assert arrays.kv_tokens_read() == shared + rest == plan.kv_tokens_read() + rest
    assert arrays.num_levels == plan.num_parts - 1 + (plan.rest_seqs.numel() > 0)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2)])
def test_arrays_equal_reference_on_random_trees(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    rng, gen = random.Random(7 * block_size + num_heads), torch.Generator().manual_seed(block_size + num_heads)
    depth, partial, empty_groups = 0, 0, 0
    for trial in range(16):
        tables, lens, _ = random_tree_tables(rng, block_size)
        k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, block_size, num_kv_heads, 16, torch.float32)
        query = torch.randn(len(lens), num_heads, 16, generator=gen)
        # Every shared node, or a cost rule that keeps only some of them.
        rule = CascadeRule(min_saved_tokens=[0, 4, 8, 16][trial % 4] * block_size, member_cost_tokens=0)
        arrays = flashinfer_cascade_arrays(lens, table, block_size, rule)
        check_against_reference(arrays, query, k_cache, v_cache, full_k, full_v)
        check_reads(arrays, lens, block_size)
        if arrays.cascade is not None:
            depth = max(depth, arrays.num_levels)
            partial += len(arrays.cascade.nodes) < len(arrays.cascade.tree.nodes())
            empty_groups += sum(int((last == 0).sum()) for last in arrays.kv_last_page_len)
    assert depth >= 3 and partial >= 1 and empty_groups >= 1  # multi-level, partly kept, empty groups ran


def test_cost_rule_keeps_the_document_and_reads_the_header_with_the_rest() -> None:
    """The short root header does not pay, the sub-group's document does: level 0 is the document
    (the fourth sequence there as an empty group), level 1 each sequence's header and own blocks."""
    gen, bs = torch.Generator().manual_seed(4), 16
    header, doc = [1], list(range(10, 18))
    tables = [header + doc + [40 + i] for i in range(3)] + [header + [50, 51]]
    lens = [16 + 128 + 5 + i for i in range(3)] + [16 + 20]
    k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, bs, 3, 16, torch.float32)
    arrays = flashinfer_cascade_arrays(lens, table, bs, CascadeRule(min_saved_tokens=2 * 128, member_cost_tokens=0))
    assert arrays.num_levels == 2 and arrays.order.tolist() == [3, 0, 1, 2]  # no document first
    assert arrays.qo_indptr[0].tolist() == [0, 1, 4] and arrays.kv_indptr[0].tolist() == [0, 0, 8]
    assert arrays.kv_last_page_len[0].tolist() == [0, 16]
    assert arrays.qo_indptr[1].tolist() == [0, 1, 2, 3, 4] and arrays.kv_indptr[1].tolist() == [0, 3, 5, 7, 9]
    assert arrays.kv_last_page_len[1].tolist() == [4, 5, 6, 7]
    check_against_reference(arrays, torch.randn(4, 9, 16, generator=gen), k_cache, v_cache, full_k, full_v)
    check_reads(arrays, lens, bs)


def test_no_shared_blocks_is_one_level_of_per_sequence_pages() -> None:
    gen = torch.Generator().manual_seed(5)
    tables, lens = [[3, 4], [5], [6, 7, 8]], [20, 16, 33]
    k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, 16, 2, 16, torch.float32)
    assert not find_prefix_tree(tables, lens, 16).roots
    arrays = flashinfer_cascade_arrays(lens, table, 16, ALWAYS)
    assert arrays.cascade is None and arrays.num_levels == 1 and arrays.order.tolist() == [0, 1, 2]
    assert arrays.qo_indptr[0].tolist() == [0, 1, 2, 3] and arrays.kv_indptr[0].tolist() == [0, 2, 3, 6]
    assert arrays.kv_last_page_len[0].tolist() == [4, 16, 1]
    check_against_reference(arrays, torch.randn(3, 8, 16, generator=gen), k_cache, v_cache, full_k, full_v)
    # Shared blocks that do not pay are the same single level.
    shared = flashinfer_cascade_arrays([40, 40], torch.tensor([[1, 2, 3], [1, 2, 4]]), 16, CascadeRule(min_saved_tokens=10**9))
    assert shared.cascade is None and shared.kv_indices[0].tolist() == [1, 2, 3, 1, 2, 4]


def test_no_rest_at_all_has_no_rest_level() -> None:
    """Contexts that end exactly on shared blocks: two kept levels and no rest level."""
    gen = torch.Generator().manual_seed(3)
    tables, lens = [[4, 5], [4, 6], [4, 5], [4, 6]], [32] * 4
    k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, 16, 3, 16, torch.float32)
    arrays = flashinfer_cascade_arrays(lens, table, 16, ALWAYS)
    assert arrays.num_levels == 2 and arrays.order.tolist() == [0, 2, 1, 3]
    assert arrays.qo_indptr[0].tolist() == [0, 4] and arrays.qo_indptr[1].tolist() == [0, 2, 4]
    assert arrays.kv_last_page_len[1].tolist() == [16, 16]
    check_against_reference(arrays, torch.randn(4, 9, 16, generator=gen), k_cache, v_cache, full_k, full_v)
    check_reads(arrays, lens, 16)


def test_no_sequence_merges_two_empty_states() -> None:
    """A sequence that ends on the root has no child node and no rest: empty at the last level, so
    level 0 (``run`` merges it first) must hold its root, never another empty level."""
    gen = torch.Generator().manual_seed(6)
    tables, lens = [[4], [4, 5, 7], [4, 5, 8]], [16, 40, 40]
    k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, 16, 2, 16, torch.float32)
    arrays = flashinfer_cascade_arrays(lens, table, 16, ALWAYS)
    assert arrays.num_levels == 3 and [last.tolist() for last in arrays.kv_last_page_len] == [[16], [0, 16], [0, 8, 8]]
    check_against_reference(arrays, torch.randn(3, 8, 16, generator=gen), k_cache, v_cache, full_k, full_v)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="context_lens"):
        flashinfer_cascade_arrays([], torch.zeros(1, 1, dtype=torch.int64), 16)
    with pytest.raises(ValueError, match="context_lens"):
        flashinfer_cascade_arrays([0], torch.zeros(1, 1, dtype=torch.int64), 16)
    with pytest.raises(ValueError, match="block_tables"):
        flashinfer_cascade_arrays([40], torch.zeros(1, 2, dtype=torch.int64), 16)


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer is installed")
def test_missing_flashinfer_is_a_clear_error() -> None:
    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        FlashInferCascadeDecodeAttention()
    with pytest.raises(ValueError, match="pip install flashinfer-python"):
        get_decode_attention("flashinfer")
    assert issubclass(FlashInferUnavailable, ValueError)


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_FLASHINFER, reason="needs CUDA and flashinfer (pip install flashinfer-python)")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (8, 8)])
def test_flashinfer_backend_end_to_end(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    rng, gen = random.Random(block_size + num_heads), torch.Generator().manual_seed(block_size)
    backend = FlashInferCascadeDecodeAttention(ALWAYS)
    for trial in range(8):
        tables, lens, _ = random_tree_tables(rng, block_size)
        k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, block_size, num_kv_heads, 64, torch.float16)
        query = torch.randn(len(lens), num_heads, 64, generator=gen).half()
        plan = backend.plan(lens, table.cuda(), block_size)
        out = backend.forward(query.cuda(), k_cache.cuda(), v_cache.cuda(), plan, 0.125)
        truth = torch.cat([reference_attention(query[i : i + 1].float(), k.float(), v.float(), 0.125) for i, (k, v) in enumerate(zip(full_k, full_v))])
        torch.testing.assert_close(out.float().cpu(), truth, atol=2e-2, rtol=2e-2)
        again = backend.forward(query.cuda(), k_cache.cuda(), v_cache.cuda(), plan, 0.125)  # a second layer: no re-plan
        torch.testing.assert_close(again, out)
