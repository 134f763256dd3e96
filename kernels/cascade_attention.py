"""Shared-prefix (cascade) decode attention: read a shared prompt's KV once for every sequence sharing it.

Sequences that share leading *physical* blocks (prefix caching hands the same block to every
sequence with the same leading tokens; prefix-aware migration does the same on a decode instance)
form a tree: a system prompt shared by all, a document shared by a sub-group, then each sequence's
own suffix. ``find_prefix_tree`` reads that tree off the block tables. ``CascadeDecodeAttention``
keeps the tree's nodes that pay by its ``CascadeRule``, attends, for every kept node, the queries of
all its member sequences to the node's KV in one flash call (the ``G = H / KVH`` query heads of
every member as rows of a ``[KVH, members × G, D]`` query, so the shared KV is read once for the
group), each sequence's remaining blocks by the ``exact`` split-K backend, and merges each
sequence's parts with ``merge_attention_states`` by their log-sum-exp. When no node pays, the step
runs the ``exact`` backend unchanged. Only full blocks are shared: a partly filled block is still
being written by one sequence.

The plan (tree, kept nodes, each sequence's remaining blocks) is the same for every backend that
runs a cascade (``kernels.triton_attention``, ``kernels.flashinfer_attention``); only ``forward``
differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels.decode_attention import (
    DecodeAttention,
    DecodePlan,
    ExactDecodeAttention,
    _flash_attention_with_lse,
    gather_blocks,
)
from kernels.merge_attention import merge_attention_states


@dataclass
class PrefixNode:
    """A run of full blocks that every member sequence holds at the same table positions."""

    start_block: int  # index in the members' block tables of the segment's first block
    block_ids: list[int]  # the segment's physical blocks
    members: list[int]  # sequence indices (in the batch) that share it, ascending
    children: list[PrefixNode] = field(default_factory=list)
    depth: int = 0  # 0 for a root

    @property
    def end_block(self) -> int:
        return self.start_block + len(self.block_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


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

    def split(members: list[int], start: int, depth: int) -> list[PrefixNode]:
        groups: dict[int, list[int]] = {}
        for i in members:
            if full[i] > start:
                groups.setdefault(block_tables[i][start], []).append(i)
        nodes = []
        for group in groups.values():
            if len(group) < 2:
                continue
            ref = block_tables[group[0]]
            end = min(full[i] for i in group)
            for i in group[1:]:
                end = _common_prefix_end(ref, block_tables[i], start + 1, end)
            for i in group:
                suffix_start[i] = end
            node = PrefixNode(start, [ref[b] for b in range(start, end)], group, depth=depth)
            node.children = split(group, end, depth + 1)
            nodes.append(node)
        return nodes

    roots = split(list(range(len(context_lens))), 0, 0)
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


@dataclass(frozen=True)
class CascadeRule:
    """Whether attending a shared segment once for its group pays this step.

    A kept node of ``tokens`` shared tokens and ``members`` sequences saves reading
    ``(members - 1) × tokens`` KV token slots per layer; it costs one more attention call, and each
    member costs its rows in that call, its slot in the merge and the copies in and out. The node is
    kept when ``(members - 1) × tokens >= min_saved_tokens + member_cost_tokens × members``: both
    costs in the token slots they take as long as to read.

    The defaults are measured on this machine (2-core EPYC, SmolLM2 shapes, bf16, 64-192 own tokens a
    sequence) by ``experiments/bench_attention.py``: it times cascade against ``exact`` on one group of
    2-16 members sharing 64-2048 tokens and of 8-64 sharing 512-4096, and prints the pair that loses
    the least time over them (results in ``experiments/results/bench_attention.md``). Cascade's speed
    varied by up to ~30% between runs on this shared VM, and single runs derived pairs from
    640 + 384 to 2688 + 288; the defaults are the pair that lost least over five full runs together
    (at most 5 of 42 configurations decided wrong in any run, each costing at most 14%). The
    per-member term is what a saving threshold alone misses: 16 members on 256 shared tokens (3840
    saved) ran 0.82-0.94x of ``exact`` in every run, while 3 members on 2048 (4096 saved) ran
    1.14-1.28x. So no segment of ``member_cost_tokens`` tokens or fewer pays, and small groups need
    long ones: 2 members >= 1792 tokens, 3 >= 1056, 4 >= 811, 8 >= 531, 16 >= 419, 32 >= 368.
    vLLM's fixed rule for its one level is >= 256 shared tokens and >= 8 requests; 8 members on 256
    tokens ran 0.79-0.96x of ``exact`` here.
    """

    min_saved_tokens: int = 1152
    member_cost_tokens: int = 320

    def pays(self, tokens: int, members: int) -> bool:
        return (members - 1) * tokens >= self.min_saved_tokens + self.member_cost_tokens * members

    def kept(self, tree: PrefixTree, block_size: int) -> list[PrefixNode]:
        """The nodes of ``tree`` that pay, by depth: what a cascade step reads once per group."""
        return [n for n in tree.nodes() if self.pays(n.num_blocks * block_size, len(n.members))]


ALWAYS = CascadeRule(min_saved_tokens=0, member_cost_tokens=0)  # every shared node (tests, benchmarks)


@dataclass
class CascadePlan:
    """A step's cascade: the kept shared nodes' index tensors and each sequence's remaining blocks.

    Sequence ``i`` reads the blocks of every kept node it is a member of, and its *rest*: the
    blocks of its table no kept node covers, in table order (the partly filled last block last).
    """

    num_decodes: int
    block_size: int
    tree: PrefixTree  # every shared node found, kept or not
    nodes: list[PrefixNode]  # the kept ones, by depth
    node_blocks: list[torch.Tensor]  # per kept node: [nb] int64
    node_members: list[torch.Tensor]  # per kept node: [m] int64
    node_part: list[int]  # per kept node: its merge slot (its rank among the kept depths)
    num_parts: int  # kept depths + 1 (the last slot holds the rest)
    rest_seqs: torch.Tensor  # [ns] int64 sequences with blocks left to read on their own
    rest_lens: list[int]  # [ns] their token counts
    rest_tables: torch.Tensor  # [ns, w] int64 their blocks, padded with 0
    rest_plan: DecodePlan | None  # the exact plan over them; None if none

    def kv_tokens_read(self) -> int:
        """Token slots each layer reads from the K cache: every kept segment once, plus the rests."""
        shared = sum(b.numel() for b in self.node_blocks) * self.block_size
        return shared + (self.rest_plan.kv_tokens_read() if self.rest_plan is not None else 0)


def plan_cascade(
    context_lens: list[int],
    block_tables: torch.Tensor,  # [>= nd, max_blocks] int64
    block_size: int,
    rule: CascadeRule,
    rest: ExactDecodeAttention | None,
) -> CascadePlan | None:
    """The cascade of a step's decodes under ``rule``; None when no shared node pays. ``rest``
    plans the remaining blocks (None: leave ``rest_plan`` unset, for backends of their own)."""
    nd = len(context_lens)
    # One tolist of the table: a per-row copy costs ~5 µs a sequence.
    rows = [r[: -(-c // block_size)] for r, c in zip(block_tables[:nd].tolist(), context_lens)]
    tree = find_prefix_tree(rows, context_lens, block_size)
    kept = rule.kept(tree, block_size)
    if not kept:
        return None
    depths = sorted({n.depth for n in kept})
    part_of = {d: p for p, d in enumerate(depths)}
    covered: list[list[tuple[int, int]]] = [[] for _ in range(nd)]
    for n in kept:
        for i in n.members:
            covered[i].append((n.start_block, n.end_block))
    seqs, lens, own_rows = [], [], []
    for i, (row, ctx) in enumerate(zip(rows, context_lens)):
        spans = sorted(covered[i])
        own, at, shared = [], 0, 0
        for s, e in spans:
            own += row[at:s]
            at, shared = e, shared + (e - s) * block_size
        own += row[at:]
        if ctx > shared:
            seqs.append(i)
            lens.append(ctx - shared)
            own_rows.append(own)
    device = block_tables.device
    width = max((len(r) for r in own_rows), default=1)
    rest_tables = torch.tensor([r + [0] * (width - len(r)) for r in own_rows] or [[0]], dtype=torch.int64, device=device)
    rest_tables = rest_tables[: len(own_rows)]
    return CascadePlan(
        nd, block_size, tree, kept,
        node_blocks=[torch.tensor(n.block_ids, dtype=torch.int64, device=device) for n in kept],
        node_members=[torch.tensor(n.members, dtype=torch.int64, device=device) for n in kept],
        node_part=[part_of[n.depth] for n in kept], num_parts=len(depths) + 1,
        rest_seqs=torch.tensor(seqs, dtype=torch.int64, device=device), rest_lens=lens, rest_tables=rest_tables,
        rest_plan=rest.plan(lens, rest_tables, block_size) if rest is not None and seqs else None,
    )


class CascadeDecodeAttention(DecodeAttention):
    """Cascade decode in torch: kept shared segments once per group, the rest by ``exact``, merged
    by log-sum-exp; a step where no shared segment pays is an ``exact`` step."""

    kv_read = "cascade"

    def __init__(self, rule: CascadeRule | None = None, rest_chunk_len: int | None = None) -> None:
        self.rule = rule or CascadeRule()
        self.rest = ExactDecodeAttention(chunk_len=rest_chunk_len)

    def plan(self, context_lens: list[int], block_tables: torch.Tensor, block_size: int) -> CascadePlan | DecodePlan:
        plan = plan_cascade(context_lens, block_tables, block_size, self.rule, self.rest)
        return plan if plan is not None else self.rest.plan(context_lens, block_tables, block_size)

    def forward(
        self,
        query: torch.Tensor,  # [nd, H, D]
        k_cache: torch.Tensor,  # [NB, BS, KVH, D]
        v_cache: torch.Tensor,  # [NB, BS, KVH, D]
        plan: CascadePlan | DecodePlan,
        scale: float,
    ) -> torch.Tensor:  # [nd, H, D]
        if isinstance(plan, DecodePlan):
            return self.rest.forward(query, k_cache, v_cache, plan, scale)
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
        if plan.rest_plan is not None:
            o, lse = self.rest.forward_with_lse(query.index_select(0, plan.rest_seqs), k_cache, v_cache, plan.rest_plan, scale)
            o_grid[-1].index_copy_(0, plan.rest_seqs, o.view(-1, num_kv_heads, group, head_dim).float())
            lse_grid[-1].index_copy_(0, plan.rest_seqs, lse.view(-1, num_kv_heads, group))
        out, _ = merge_attention_states(o_grid, lse_grid)  # [nd, KVH, G, D] fp32
        return out.to(query.dtype).view(nd, num_heads, head_dim)
