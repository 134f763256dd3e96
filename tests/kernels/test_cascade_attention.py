"""Cascade (shared-prefix) decode attention: the log-sum-exp merge on its own, prefix-tree detection
from block tables on random trees, and cascade equal to reference attention and the padded backend."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.backends import get_decode_attention
from kernels.cascade_attention import ALWAYS, CascadeDecodeAttention, CascadePlan, CascadeRule, PrefixTree, find_prefix_tree
from kernels.decode_attention import DecodePlan, _flash_attention_with_lse
from kernels.merge_attention import lse_from_base2, lse_to_base2, merge_attention_states
from kernels.paged_attention import reference_attention, write_kv


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, D] over k, v [L, H, D] → ([H, D], [H]) by the CPU flash kernel."""
    o, lse = _flash_attention_with_lse(q[None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=0.25)
    return o[0, :, 0], lse[0, :, 0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_merging_parts_equals_attention_over_the_whole(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 16, generator=gen).to(dtype)
    k = (torch.randn(50, 4, 16, generator=gen) * 3).to(dtype)
    v = torch.randn(50, 4, 16, generator=gen).to(dtype)
    whole, whole_lse = attend(q, k, v)
    for cuts in ([20], [7, 33], [1, 2, 49]):
        bounds = [0, *cuts, 50]
        parts = [attend(q, k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])]
        out, lse = merge_attention_states([o for o, _ in parts], [s for _, s in parts])
        assert out.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.float(), whole.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse, whole_lse.float(), atol=1e-5, rtol=1e-5)


def test_empty_parts_weigh_nothing() -> None:
    gen = torch.Generator().manual_seed(1)
    o = torch.randn(3, 5, 8, generator=gen)
    lse = torch.randn(3, 5, generator=gen)
    o_empty = torch.full((5, 8), float("nan"))  # an empty part's output is garbage
    empty = torch.full((5,), float("-inf"))
    out, merged_lse = merge_attention_states([o[0], o_empty, o[1]], [lse[0], empty, lse[1]])
    ref, ref_lse = merge_attention_states(o[:2], lse[:2])
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(merged_lse, ref_lse)
    alone, alone_lse = merge_attention_states([o[2], o_empty], [lse[2], empty])
    torch.testing.assert_close(alone, o[2])
    torch.testing.assert_close(alone_lse, lse[2])
    nothing, nothing_lse = merge_attention_states([o_empty, o_empty], [empty, empty])
    assert (nothing == 0).all() and torch.isneginf(nothing_lse).all()
    with pytest.raises(ValueError, match="do not match"):
        merge_attention_states(o, lse[:, :4])


def test_base2_lse_conversion() -> None:
    s = torch.randn(7, 30)
    lse2 = torch.log2(torch.exp(s).sum(-1))  # FlashInfer's convention
    torch.testing.assert_close(lse_from_base2(lse2), torch.logsumexp(s, -1))
    torch.testing.assert_close(lse_to_base2(torch.logsumexp(s, -1)), lse2)


def random_tree_tables(rng: random.Random, block_size: int) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Sequences on a random prefix tree: (block tables, context lengths, the true shared groups as
    sorted member lists). Each tree level is a segment of 1-3 fresh blocks shared by a random subset."""
    next_block = iter(rng.sample(range(10_000), 10_000))
    n = rng.randint(2, 14)
    tables: list[list[int]] = [[] for _ in range(n)]
    groups: list[list[int]] = []

    def grow(members: list[int]) -> None:
        rng.shuffle(members)
        while len(members) >= 2 and rng.random() < 0.8:
            size = rng.randint(2, len(members))
            sub, members = sorted(members[:size]), members[size:]
            segment = [next(next_block) for _ in range(rng.randint(1, 3))]
            for i in sub:
                tables[i] += segment
            groups.append(list(sub))
            if rng.random() < 0.6:
                grow(sub)

    grow(list(range(n)))
    lens = []
    for t in tables:
        own = rng.randint(0, 4 * block_size)  # 0: the context ends exactly on a shared block
        t += [next(next_block) for _ in range(-(-own // block_size))]
        lens.append(len(t) * block_size - (-own % block_size) if own else len(t) * block_size)
        if not t:  # every sequence has at least one token
            t.append(next(next_block))
            lens[-1] = rng.randint(1, block_size)
    return tables, lens, groups


@pytest.mark.parametrize("seed", range(20))
def test_prefix_tree_finds_the_shared_groups(seed: int) -> None:
    rng = random.Random(seed)
    tables, lens, groups = random_tree_tables(rng, 16)
    tree = find_prefix_tree(tables, lens, 16)
    nodes = tree.nodes()
    assert sorted(n.members for n in nodes) == _merged(groups)
    for node in nodes:
        assert len(node.members) >= 2
        for i in node.members:
            assert tables[i][node.start_block : node.end_block] == node.block_ids
            assert node.end_block * 16 <= lens[i]  # only full blocks
        for child in node.children:
            assert set(child.members) < set(node.members)
            assert child.start_block == node.end_block
    for i, start in enumerate(tree.suffix_start):
        path = [n for n in nodes if i in n.members]
        assert start == max((n.end_block for n in path), default=0)
        # No other sequence shares this sequence's block at its suffix start (the segment is maximal).
        if start < lens[i] // 16:
            assert all(tables[j][: start + 1] != tables[i][: start + 1] for j in range(len(tables)) if j != i)


def _merged(groups: list[list[int]]) -> list[list[int]]:
    """The true groups, a group with its parent's very members folded into it (their segments are
    contiguous, so they are one node)."""
    seen: list[list[int]] = []
    for g in groups:
        if g not in seen:
            seen.append(g)
    return sorted(seen)


def test_prefix_tree_partial_blocks_are_not_shared() -> None:
    tree = find_prefix_tree([[5, 6], [5, 6], [5, 7]], [20, 32, 17], 16)  # block 6 full only in seq 1
    assert [(n.block_ids, n.members) for n in tree.nodes()] == [([5], [0, 1, 2])]
    assert tree.suffix_start == [1, 1, 1] and tree.levels == [tree.roots]
    two_level = find_prefix_tree([[1, 2, 3], [1, 2, 4], [1, 9, 8], [7]], [48, 48, 48, 3], 16)
    assert [[(n.block_ids, n.members) for n in level] for level in two_level.levels] == [
        [([1], [0, 1, 2])], [([2], [0, 1])]
    ]
    assert two_level.suffix_start == [2, 2, 1, 0]
    assert find_prefix_tree([], [], 16) == PrefixTree([], [])
    with pytest.raises(ValueError, match="block tables"):
        find_prefix_tree([[1]], [3, 4], 16)


def make_cache(gen: torch.Generator, tables: list[list[int]], lens: list[int], block_size: int, kvh: int, d: int, dtype: torch.dtype):
    """A cache holding each table's blocks (physical ids remapped densely), garbage elsewhere; the
    contiguous keys/values of every sequence."""
    ids = sorted({b for t in tables for b in t})
    remap = {b: i for i, b in enumerate(ids)}
    nb = len(ids) + 3
    k_cache = (torch.randn(nb, block_size, kvh, d, generator=gen) * 100).to(dtype)
    v_cache = (torch.randn(nb, block_size, kvh, d, generator=gen) * 100).to(dtype)
    written: set[int] = set()
    for t, c in zip(tables, lens):  # a shared block is written once, by whoever reaches it first
        for b in t:
            if remap[b] not in written:
                written.add(remap[b])
                write_kv(torch.randn(block_size, kvh, d, generator=gen).to(dtype), torch.randn(block_size, kvh, d, generator=gen).to(dtype),
                         k_cache, v_cache, torch.arange(remap[b] * block_size, (remap[b] + 1) * block_size))
    dense = [[remap[b] for b in t] for t in tables]
    full_k = [k_cache[t].flatten(0, 1)[:c] for t, c in zip(dense, lens)]  # [ctx, KVH, D]
    full_v = [v_cache[t].flatten(0, 1)[:c] for t, c in zip(dense, lens)]
    width = max(len(t) for t in dense)
    table = torch.tensor([t + [0] * (width - len(t)) for t in dense], dtype=torch.int64)
    return k_cache, v_cache, table, full_k, full_v


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_equals_reference_on_random_trees(block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    rng, gen = random.Random(block_size + num_heads), torch.Generator().manual_seed(block_size + num_heads)
    cascade, padded = CascadeDecodeAttention(ALWAYS), get_decode_attention("padded")
    num_shared, depth = 0, 0
    for _ in range(8):
        tables, lens, _ = random_tree_tables(rng, block_size)
        k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, block_size, num_kv_heads, 16, dtype)
        query = torch.randn(len(lens), num_heads, 16, generator=gen).to(dtype)
        plan = cascade.plan(lens, table, block_size)
        if isinstance(plan, DecodePlan):  # no shared block in this batch: an exact step
            assert not find_prefix_tree(tables, lens, block_size).roots
            continue
        num_shared += len(plan.node_blocks)
        depth = max(depth, len(plan.tree.levels))
        out = cascade.forward(query, k_cache, v_cache, plan, 0.25)
        truth = torch.cat([reference_attention(query[i : i + 1].float(), k.float(), v.float(), 0.25) for i, (k, v) in enumerate(zip(full_k, full_v))])
        pad = padded.forward(query, k_cache, v_cache, padded.plan(lens, table, block_size), 0.25)
        if dtype == torch.float32:
            torch.testing.assert_close(out, truth, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out, pad, atol=1e-5, rtol=1e-5)
        else:  # as the exact backend's bf16 tests: no worse than padded, which rounds too
            err, err_pad = (out.float() - truth).abs(), (pad.float() - truth).abs()
            assert err.max() <= 2 * err_pad.max() + 2e-2, (err.max(), err_pad.max())
            assert err.mean() <= 2 * err_pad.mean() + 1e-3, (err.mean(), err_pad.mean())
        shared = [b for n in plan.tree.nodes() for b in n.block_ids]
        assert len(shared) == len(set(shared))  # every shared block is read once per step
    assert num_shared >= 4 and depth >= 2  # the shared path ran, on a multi-level tree


def test_cascade_reads_a_shared_prefix_once() -> None:
    block_size, n = 16, 8
    tables = [list(range(8)) + [100 + i] for i in range(n)]  # 128 shared tokens, 1-16 own
    lens = [128 + 1 + i for i in range(n)]
    table = torch.tensor(tables)
    plan = CascadeDecodeAttention(ALWAYS).plan(lens, table, block_size)
    assert isinstance(plan, CascadePlan) and [n.members for n in plan.tree.nodes()] == [list(range(n))]
    assert plan.kv_tokens_read() == 128 + n * block_size


def test_cascade_without_any_suffix() -> None:
    """Contexts that end exactly on shared blocks: the shared parts alone, no suffix call."""
    gen = torch.Generator().manual_seed(3)
    tables, lens = [[4, 5], [4, 5], [4, 6], [4, 6]], [32] * 4
    k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, 16, 3, 16, torch.float32)
    query = torch.randn(4, 9, 16, generator=gen)
    cascade = CascadeDecodeAttention(ALWAYS)
    plan = cascade.plan(lens, table, 16)
    assert isinstance(plan, CascadePlan) and plan.rest_plan is None and plan.tree.suffix_start == [2, 2, 2, 2] and len(plan.tree.levels) == 2
    out = cascade.forward(query, k_cache, v_cache, plan, 0.25)
    truth = torch.cat([reference_attention(query[i : i + 1], k, v, 0.25) for i, (k, v) in enumerate(zip(full_k, full_v))])
    torch.testing.assert_close(out, truth, atol=1e-5, rtol=1e-5)


def test_cost_rule_keeps_only_nodes_that_pay_and_reads_the_rest_per_sequence() -> None:
    """A 2-level tree where only the sub-group's long document pays: the short root header is read
    per sequence, with its own blocks, and the result still equals reference attention."""
    gen, bs = torch.Generator().manual_seed(4), 16
    header, doc = [1], list(range(10, 18))  # 16 shared by all four; 128 by the first three
    tables = [header + doc + [40 + i] for i in range(3)] + [header + [50, 51]]
    lens = [16 + 128 + 5 + i for i in range(3)] + [16 + 20]
    k_cache, v_cache, table, full_k, full_v = make_cache(gen, tables, lens, bs, 3, 16, torch.float32)
    query = torch.randn(4, 9, 16, generator=gen)
    rule = CascadeRule(min_saved_tokens=2 * 128, member_cost_tokens=0)  # (3 - 1) × 128 pays; (4 - 1) × 16 does not
    assert rule.pays(128, 3) and not rule.pays(16, 4) and not rule.pays(128, 1)
    cascade = CascadeDecodeAttention(rule)
    plan = cascade.plan(lens, table, bs)
    assert isinstance(plan, CascadePlan)
    assert [len(n.members) for n in plan.tree.nodes()] == [4, 3]  # both found
    assert [n.members for n in plan.nodes] == [[0, 1, 2]] and plan.node_part == [0] and plan.num_parts == 2
    assert plan.rest_seqs.tolist() == [0, 1, 2, 3] and plan.rest_lens == [16 + 5, 16 + 6, 16 + 7, 36]
    remap = {b: i for i, b in enumerate(sorted({b for t in tables for b in t}))}
    assert plan.rest_tables[0, :2].tolist() == [remap[1], remap[40]]  # the header, then its own block
    assert plan.kv_tokens_read() == 128 + plan.rest_plan.kv_tokens_read()
    out = cascade.forward(query, k_cache, v_cache, plan, 0.25)
    truth = torch.cat([reference_attention(query[i : i + 1], k, v, 0.25) for i, (k, v) in enumerate(zip(full_k, full_v))])
    torch.testing.assert_close(out, truth, atol=1e-5, rtol=1e-5)
    # Nothing pays: an exact step, same result.
    none = CascadeDecodeAttention(CascadeRule(min_saved_tokens=10**9))
    exact_plan = none.plan(lens, table, bs)
    assert isinstance(exact_plan, DecodePlan)
    torch.testing.assert_close(none.forward(query, k_cache, v_cache, exact_plan, 0.25), truth, atol=1e-5, rtol=1e-5)


def test_cost_rule_charges_every_member() -> None:
    """The per-member term: a segment no longer than it never pays however many share it, and of two
    groups saving about as much the one with fewer members on a longer segment is the one kept."""
    rule = CascadeRule(min_saved_tokens=640, member_cost_tokens=384)
    assert not rule.pays(384, 10_000) and not rule.pays(256, 16)
    assert not rule.pays(1024, 2) and rule.pays(1024, 3) and rule.pays(2048, 2)  # 1024 < 640 + 768; 2048 >= 640 + 1152
    assert not rule.pays(512, 8) and rule.pays(512, 12)  # 3584 < 640 + 3072; 5632 >= 640 + 4608
    assert CascadeRule().pays(4096, 32) and not CascadeRule().pays(64, 2) and ALWAYS.pays(16, 2)
    bs = 16
    small = [list(range(16)) + [500 + i] for i in range(16)]  # 16 members on 256 tokens: 3840 saved
    large = [list(range(100, 164)) + [600 + i] for i in range(3)]  # 3 members on 1024 tokens: 2048 saved
    lens = [256 + 5] * 16 + [1024 + 5] * 3
    table = torch.tensor([t + [0] * (65 - len(t)) for t in small + large])
    plan = CascadeDecodeAttention(rule).plan(lens, table, bs)
    assert isinstance(plan, CascadePlan) and [n.members for n in plan.nodes] == [[16, 17, 18]]
    saving_only = CascadeDecodeAttention(CascadeRule(min_saved_tokens=2048, member_cost_tokens=0)).plan(lens, table, bs)
    assert isinstance(saving_only, CascadePlan) and sorted(len(n.members) for n in saving_only.nodes) == [3, 16]
