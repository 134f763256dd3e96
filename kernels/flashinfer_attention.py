"""Cascade decode attention on FlashInfer's ``MultiLevelCascadeAttentionWrapper`` (CUDA, optional).

**Untested here.** This machine has no GPU and no FlashInfer: the CUDA path (``forward`` and the
wrapper's ``plan``) is written to FlashInfer's documented API (``flashinfer/cascade.py``,
``docs/tutorials/kv_layout.rst``) and has never run. What *is* tested here, on CPU, is everything
the kernel is fed: ``flashinfer_cascade_arrays`` builds the per-level arrays in pure torch, and
``tests/kernels/test_flashinfer_attention.py`` runs them through a torch emulation of the
documented multi-level semantics against reference attention. The end-to-end test there runs only
where CUDA and ``flashinfer`` are present. Install with ``pip install flashinfer-python`` (or the
``distserve[flashinfer]`` extra).

How a step maps onto FlashInfer. The tree and the kept nodes are ``plan_cascade``'s (the same
``CascadeRule`` as the torch ``cascade`` backend). Level ``p`` holds the kept nodes of the
``p``-th kept depth; the last level holds each sequence's *rest* (its blocks no kept node
covers). FlashInfer's ``qo_indptr`` of every level partitions *all* queries into contiguous
ranges, one range per group, so the queries run permuted: sorted by their path of kept nodes
(DFS order of the tree), a node's members are contiguous at every level. ``forward`` permutes
the query, runs, and un-permutes the output.

A sequence with no kept node at some level (or no rest) still needs a range there: it gets an
*empty* group, 0 pages and ``last_page_len = 0`` (consecutive such sequences share one). The page
table docs ask for ``1 <= last_page_len <= page_size``, but empty KV is a supported kernel case:
``flashinfer.page.get_seq_lens`` clamps the page count at 0 so the length comes out 0, and
FlashInfer PRs #353 and #440 fixed the prefill kernels' output and log-sum-exp for empty
KV-caches (lse = -inf, which weighs 0 when merged). The alternatives do not cover every tree:
moving a sequence's rest into its missing levels needs as many pages as missing levels, and
merging levels re-reads shared segments. One hazard remains and the level order avoids it:
``run`` starts from the last level and merges levels 0, 1, ... into it with
``merge_state_in_place``, which (before a later guard) turns two empty states into NaN. A
sequence is empty at the last level only if it has no rest; then every block it holds is in a
kept node, so its root is kept and level 0 is not empty for it: no step merges two empty states.

The wrapper is planned in ``forward`` (on the step's first layer, then reused by every layer):
FlashInfer's plan needs the head counts, dtypes and softmax scale, which ``DecodeAttention.plan``
is not given. Wrappers and their 128 MB workspace are per thread and device, reused across steps;
a plan other than the one the wrapper last saw is re-planned, so an old plan is never run wrong.
FlashInfer's log-sum-exp is base 2 (``kernels.merge_attention.lse_to_base2`` converts); ``run``
merges the levels itself and returns only the output.
"""

from __future__ import annotations

import importlib.util
import itertools
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.cascade_attention import CascadePlan, CascadeRule, plan_cascade
from kernels.decode_attention import DecodeAttention

INSTALL_HINT = "pip install flashinfer-python (or the distserve[flashinfer] extra)"
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
_SERIAL = itertools.count()


class FlashInferUnavailable(ImportError, ValueError):
    """FlashInfer is not installed. An ImportError, and a ValueError as ``get_decode_attention``
    promises for a backend whose library is missing."""


@dataclass
class FlashInferCascadeArrays:
    """One step's cascade as ``MultiLevelCascadeAttentionWrapper.plan`` takes it, over the queries
    in permuted order. Per level: ``G`` groups, each a contiguous range of permuted rows attending
    to one paged KV (pages ``kv_indices[kv_indptr[g]:kv_indptr[g + 1]]``, all full but the last,
    which holds ``kv_last_page_len[g]`` tokens; a group with no pages has ``kv_last_page_len = 0``).
    The indptr and last-page arrays stay on the CPU (FlashInfer's plan reads them on the host);
    ``kv_indices`` and the permutation live on the block tables' device."""

    num_decodes: int
    block_size: int
    order: torch.Tensor  # [nd] int32: permuted row j holds sequence order[j]
    inverse: torch.Tensor  # [nd] int32: sequence i sits at permuted row inverse[i]
    qo_indptr: list[torch.Tensor]  # per level: [G + 1] int32, ends at nd
    kv_indptr: list[torch.Tensor]  # per level: [G + 1] int32
    kv_indices: list[torch.Tensor]  # per level: [kv_indptr[-1]] int32 cache blocks
    kv_last_page_len: list[torch.Tensor]  # per level: [G] int32 in [0, block_size]
    cascade: CascadePlan | None  # the kept nodes; None when none pays (one per-sequence level)
    serial: int = field(default_factory=lambda: next(_SERIAL))  # tells the wrapper's planner plans apart

    @property
    def num_levels(self) -> int:
        return len(self.qo_indptr)

    def kv_tokens_read(self) -> int:
        """Token slots each layer reads from the K cache: every level's pages, once."""
        return sum(int(p[-1]) for p in self.kv_indptr) * self.block_size


# A permuted row's group at one level: (group key, pages, tokens in the last page). Consecutive rows
# with one key form one group; EMPTY rows (no KV at this level) share a group too.
_Row = tuple[Hashable, list[int], int]
EMPTY: Hashable = None


def flashinfer_cascade_arrays(
    context_lens: list[int],  # [nd]
    block_tables: torch.Tensor,  # [>= nd, max_blocks] int64, padded with 0
    block_size: int,
    rule: CascadeRule | None = None,
) -> FlashInferCascadeArrays:
    """The per-level arrays of a step's decodes: ``plan_cascade``'s kept nodes by depth, then each
    sequence's rest; one level of per-sequence pages when no node pays (see the module docstring)."""
    nd = len(context_lens)
    if nd == 0 or min(context_lens) < 1:
        raise ValueError(f"context_lens must hold at least one decode with at least one token, got {context_lens}")
    if block_tables.shape[0] < nd or block_tables.shape[1] * block_size < max(context_lens):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} cannot hold {nd} contexts of up to "
            f"{max(context_lens)} tokens in blocks of {block_size}"
        )
    plan = plan_cascade(context_lens, block_tables, block_size, rule or CascadeRule(), rest=None)
    if plan is None:
        rows = block_tables[:nd].tolist()
        order = list(range(nd))
        level = [(("seq", i), *_pages(rows[i], context_lens[i], block_size)) for i in order]
        return _build(nd, block_size, order, [level], None, block_tables.device)

    num_kept_levels = plan.num_parts - 1
    node_at = [[-1] * num_kept_levels for _ in range(nd)]  # kept node of each sequence at each level
    for k, (members, part) in enumerate(zip(plan.node_members, plan.node_part)):
        for i in members.tolist():
            node_at[i][part] = k
    # DFS order: members of a node share every kept node above it, so sorting by the path of
    # kept nodes makes each node's members contiguous at every level.
    order = sorted(range(nd), key=lambda i: (node_at[i], i))
    node_blocks = [b.tolist() for b in plan.node_blocks]
    levels: list[list[_Row]] = []
    for part in range(num_kept_levels):
        level: list[_Row] = []
        for i in order:
            k = node_at[i][part]
            level.append((EMPTY, [], 0) if k < 0 else (("node", k), node_blocks[k], block_size))
        levels.append(level)
    if plan.rest_seqs.numel():
        rest = {i: _pages(row, n, block_size) for i, row, n in zip(plan.rest_seqs.tolist(), plan.rest_tables.tolist(), plan.rest_lens)}
        levels.append([(("seq", i), *rest[i]) if i in rest else (EMPTY, [], 0) for i in order])
    return _build(nd, block_size, order, levels, plan, block_tables.device)


def _pages(row: list[int], num_tokens: int, block_size: int) -> tuple[list[int], int]:
    """The first pages of ``row`` holding ``num_tokens`` tokens, and the tokens in the last one."""
    num_pages = -(-num_tokens // block_size)
    return row[:num_pages], num_tokens - (num_pages - 1) * block_size


def _build(
    nd: int, block_size: int, order: list[int], levels: list[list[_Row]], plan: CascadePlan | None, device: torch.device
) -> FlashInferCascadeArrays:
    qo_indptrs, kv_indptrs, kv_indices, last_page_lens = [], [], [], []
    for rows in levels:
        qo, kv, pages, last = [0], [0], [], []
        for r, (key, segment, tail) in enumerate(rows):
            if r and key == rows[r - 1][0]:
                qo[-1] = r + 1  # one more row of the previous group
                continue
            qo.append(r + 1)
            pages += segment
            kv.append(len(pages))
            last.append(tail)
        qo_indptrs.append(torch.tensor(qo, dtype=torch.int32))
        kv_indptrs.append(torch.tensor(kv, dtype=torch.int32))
        kv_indices.append(torch.tensor(pages, dtype=torch.int32, device=device))
        last_page_lens.append(torch.tensor(last, dtype=torch.int32))
    inverse = [0] * nd
    for row, i in enumerate(order):
        inverse[i] = row
    return FlashInferCascadeArrays(
        nd, block_size,
        order=torch.tensor(order, dtype=torch.int32, device=device),
        inverse=torch.tensor(inverse, dtype=torch.int32, device=device),
        qo_indptr=qo_indptrs, kv_indptr=kv_indptrs, kv_indices=kv_indices, kv_last_page_len=last_page_lens,
        cascade=plan,
    )


class _Wrappers(threading.local):
    """This thread's FlashInfer wrappers by (device, levels), sharing one float workspace per
    device, and what each was last planned for."""

    def __init__(self) -> None:
        self.workspace: dict[torch.device, torch.Tensor] = {}
        self.wrappers: dict[tuple[torch.device, int], list[Any]] = {}  # -> [wrapper, planned key]


class FlashInferCascadeDecodeAttention(DecodeAttention):
    """Cascade decode on FlashInfer's multi-level cascade kernel (CUDA only; untested here, see the
    module docstring): kept shared segments once per group, each sequence's rest on its own."""

    kv_read = "cascade"

    def __init__(self, rule: CascadeRule | None = None, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        if importlib.util.find_spec("flashinfer") is None:
            raise FlashInferUnavailable(
                f"decode attention 'flashinfer' needs FlashInfer (CUDA only): {INSTALL_HINT}", name="flashinfer"
            )
        self.rule = rule or CascadeRule()
        self.workspace_bytes = workspace_bytes
        self._local = _Wrappers()

    def plan(self, context_lens: list[int], block_tables: torch.Tensor, block_size: int) -> FlashInferCascadeArrays:
        return flashinfer_cascade_arrays(context_lens, block_tables, block_size, self.rule)

    def forward(
        self,
        query: torch.Tensor,  # [nd, H, D]
        k_cache: torch.Tensor,  # [NB, BS, KVH, D] FlashInfer's "NHD" paged layout
        v_cache: torch.Tensor,  # [NB, BS, KVH, D]
        plan: FlashInferCascadeArrays,
        scale: float,
    ) -> torch.Tensor:  # [nd, H, D]
        if query.device.type != "cuda":
            raise ValueError(f"decode attention 'flashinfer' runs on CUDA only, got a query on {query.device}")
        wrapper = self._planned_wrapper(query, k_cache, plan, scale)
        out = wrapper.run(query.index_select(0, plan.order), (k_cache, v_cache))  # [nd, H, D] permuted
        return out.index_select(0, plan.inverse)

    def _planned_wrapper(self, query: torch.Tensor, k_cache: torch.Tensor, plan: FlashInferCascadeArrays, scale: float) -> Any:
        """This thread's wrapper for ``plan``'s level count on the query's device, planned for
        ``plan`` and these shapes (re-planned only when they change: once a step)."""
        import flashinfer

        device = query.device
        _, num_heads, head_dim = query.shape
        key = (plan.serial, num_heads, k_cache.shape[2], head_dim, query.dtype, k_cache.dtype, scale)
        slot = self._local.wrappers.get((device, plan.num_levels))
        if slot is None:
            workspace = self._local.workspace.get(device)
            if workspace is None:
                workspace = self._local.workspace[device] = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
            wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(plan.num_levels, workspace, kv_layout="NHD")
            slot = self._local.wrappers[(device, plan.num_levels)] = [wrapper, None]
        if slot[1] != key:
            # kv_data_type only when it differs: older FlashInfer releases lack the argument.
            kv_dtype = {} if k_cache.dtype == query.dtype else {"kv_data_type": k_cache.dtype}
            slot[0].plan(
                plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len,
                num_heads, k_cache.shape[2], head_dim, plan.block_size,
                causal=False, sm_scale=scale, q_data_type=query.dtype, **kv_dtype,
            )
            slot[1] = key
        return slot[0]
