"""Shared-prefix (cascade) decode attention: read a shared prompt's KV once for every sequence sharing it.

Sequences that share leading *physical* blocks (prefix caching hands the same block to every
sequence with the same leading tokens) form a tree: a system prompt shared by all, a document
shared by a sub-group, then each sequence's own suffix. ``find_prefix_tree`` reads that tree off
the block tables. ``CascadeDecodeAttention`` then attends, for every tree node, the queries of all
its member sequences to the node's KV in one flash call (the ``G = H / KVH`` query heads of every
member as rows of a ``[KVH, members × G, D]`` query, so the shared KV is read once for the group),
each sequence's suffix by the ``exact`` split-K backend, and merges each sequence's parts with
``merge_attention_states`` by their log-sum-exp. Only full blocks are shared: a partly filled block
is still being written by one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels.decode_attention import DecodePlan, ExactDecodeAttention, _flash_attention_with_lse, gather_blocks
from kernels.merge_attention import merge_attention_states


@dataclass
class PrefixNode:
    """A run of full blocks that every member sequence holds at the same table positions."""

    start_block: int  # index in the members' block tables of the segment's first block
    block_ids: list[int]  # the segment's physical blocks
    members: list[int]  # sequence indices (in the batch) that share it, ascending
    children: list[PrefixNode] = field(default_factory=list)

    @property
    def end_block(self) -> int:
        return self.start_block + len(self.block_ids)


@dataclass
class PrefixTree:
    """The shared-prefix forest of a batch; a sequence's own suffix starts at ``suffix_start[i]`` blocks."""

    roots: list[PrefixNode]
    suffix_start: list[int]  # [nd] first block index not covered by a shared node

    @property
    def levels(self) -> list[list[PrefixNode]]:
        """Nodes by depth: level 0 the roots, level 1 their children, ..."""
        levels, level = [], self.roots
        while level:
            levels.append(level)
            level = [c for n in level for c in n.children]
        return levels

    def nodes(self) -> list[PrefixNode]:
        return [n for level in self.levels for n in level]


def find_prefix_tree(block_tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int) -> PrefixTree:
    """Groups of at least two sequences whose leading *full* blocks are the same physical blocks,
    as a tree: a node's segment runs as long as all its members agree; where they part, every
    subgroup of two or more becomes a child and the rest keep the remainder as their own suffix."""
    if len(block_tables) != len(context_lens):
        raise ValueError(f"{len(block_tables)} block tables but {len(context_lens)} context lengths")
    full = [min(c // block_size, len(t)) for t, c in zip(block_tables, context_lens)]  # shareable blocks
    suffix_start = [0] * len(context_lens)

    def split(members: list[int], depth: int) -> list[PrefixNode]:
        groups: dict[int, list[int]] = {}
        for i in members:
            if full[i] > depth:
                groups.setdefault(block_tables[i][depth], []).append(i)
        nodes = []
        for group in groups.values():
            if len(group) < 2:
                continue
            ref = block_tables[group[0]]
            end = min(full[i] for i in group)
            for i in group[1:]:
                end = _common_prefix_end(ref, block_tables[i], depth + 1, end)
            for i in group:
                suffix_start[i] = end
            node = PrefixNode(depth, [block_tables[group[0]][b] for b in range(depth, end)], group)
            node.children = split(group, end)
            nodes.append(node)
        return nodes

    roots = split(list(range(len(context_lens))), 0)
    return PrefixTree(roots, suffix_start)


def _common_prefix_end(a: Sequence[int], b: Sequence[int], lo: int, hi: int) -> int:
    """The largest ``end`` in ``[lo, hi]`` with ``a[:end] == b[:end]``, given ``a[:lo] == b[:lo]``
    (binary search over slice comparisons, which run in C: a 4k-token prefix is 256 blocks a member)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class CascadePlan:
    """A step's cascade: the tree, each node's index tensors, and the suffixes' ``exact`` plan."""

    num_decodes: int
    block_size: int
    tree: PrefixTree
    node_blocks: list[torch.Tensor]  # per node (tree.nodes() order): [nb] int64
    node_members: list[torch.Tensor]  # per node: [m] int64
    node_part: list[int]  # per node: its merge slot (its depth)
    num_parts: int  # tree depth + 1 (the last slot holds the suffix)
    suffix_seqs: torch.Tensor  # [ns] int64 sequences with a non-empty suffix
    suffix_plan: DecodePlan | None  # exact plan over those suffixes; None if none

    def kv_tokens_read(self) -> int:
        """Token slots each layer reads from the K cache: every shared segment once, plus the suffixes."""
        shared = sum(b.numel() for b in self.node_blocks) * self.block_size
        return shared + (self.suffix_plan.kv_tokens_read() if self.suffix_plan is not None else 0)


class CascadeDecodeAttention:
    """Cascade decode: shared segments once per group, suffixes by ``exact``, merged by log-sum-exp.
    The same plan/forward halves as a ``DecodeAttention`` backend; not yet in its registry (the
    engine, the cost rule and the simulator's latency term come with wiring it in)."""

    def __init__(self, suffix_chunk_len: int | None = None) -> None:
        self.suffix = ExactDecodeAttention(chunk_len=suffix_chunk_len)

    def plan(self, context_lens: list[int], block_tables: torch.Tensor, block_size: int) -> CascadePlan:
        nd = len(context_lens)
        # One tolist of the table: a per-row copy costs ~5 µs a sequence.
        rows = [r[: -(-c // block_size)] for r, c in zip(block_tables[:nd].tolist(), context_lens)]
        tree = find_prefix_tree(rows, context_lens, block_size)
        device = block_tables.device
        levels = tree.levels
        nodes = [n for level in levels for n in level]
        parts = [d for d, level in enumerate(levels) for _ in level]
        suffix_lens = [c - s * block_size for c, s in zip(context_lens, tree.suffix_start)]
        seqs = [i for i, n in enumerate(suffix_lens) if n > 0]
        suffix_plan = None
        if seqs:
            width = max(-(-suffix_lens[i] // block_size) for i in seqs)
            own = [rows[i][tree.suffix_start[i] :] for i in seqs]
            suffix_table = torch.tensor([r + [0] * (width - len(r)) for r in own], dtype=torch.int64, device=device)
            suffix_plan = self.suffix.plan([suffix_lens[i] for i in seqs], suffix_table, block_size)
        return CascadePlan(
            nd, block_size, tree,
            node_blocks=[torch.tensor(n.block_ids, dtype=torch.int64, device=device) for n in nodes],
            node_members=[torch.tensor(n.members, dtype=torch.int64, device=device) for n in nodes],
            node_part=parts, num_parts=len(levels) + 1,
            suffix_seqs=torch.tensor(seqs, dtype=torch.int64, device=device), suffix_plan=suffix_plan,
        )

    def forward(
        self,
        query: torch.Tensor,  # [nd, H, D]
        k_cache: torch.Tensor,  # [NB, BS, KVH, D]
        v_cache: torch.Tensor,  # [NB, BS, KVH, D]
        plan: CascadePlan,
        scale: float,
    ) -> torch.Tensor:  # [nd, H, D]
        nd, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        q = query.view(nd, num_kv_heads, group, head_dim)  # [nd, KVH, G, D]
        o_grid = torch.zeros((plan.num_parts, nd, num_kv_heads, group, head_dim), dtype=torch.float32, device=query.device)
        lse_grid = torch.full((plan.num_parts, nd, num_kv_heads, group), float("-inf"), device=query.device)
        for blocks, members, part in zip(plan.node_blocks, plan.node_members, plan.node_part):
            m = members.numel()
            k = gather_blocks(k_cache, blocks, workspace="k").unsqueeze(0)  # [1, KVH, L, D]
            v = gather_blocks(v_cache, blocks, workspace="v").unsqueeze(0)
            # Every member's heads of a KV head as rows: [1, KVH, m * G, D]; the segment is read once.
            rows = q.index_select(0, members).permute(1, 0, 2, 3).reshape(1, num_kv_heads, m * group, head_dim)
            o, lse = _flash_attention_with_lse(rows, k, v, scale=scale)  # [1, KVH, m*G, D], [1, KVH, m*G]
            o_grid[part].index_copy_(0, members, o.view(num_kv_heads, m, group, head_dim).transpose(0, 1).float())
            lse_grid[part].index_copy_(0, members, lse.view(num_kv_heads, m, group).transpose(0, 1))
        if plan.suffix_plan is not None:
            o, lse = self.suffix.forward_with_lse(query.index_select(0, plan.suffix_seqs), k_cache, v_cache, plan.suffix_plan, scale)
            o_grid[-1].index_copy_(0, plan.suffix_seqs, o.view(-1, num_kv_heads, group, head_dim).float())
            lse_grid[-1].index_copy_(0, plan.suffix_seqs, lse.view(-1, num_kv_heads, group))
        out, _ = merge_attention_states(o_grid, lse_grid)  # [nd, KVH, G, D] fp32
        return out.to(query.dtype).view(nd, num_heads, head_dim)
