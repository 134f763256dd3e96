"""Cascade (shared-prefix) decode attention as two ``@triton.jit`` kernels: the ``triton`` backend.

It computes what ``kernels.cascade_attention.CascadeDecodeAttention`` computes, from the same plan
(``plan_cascade`` and its ``CascadeRule``): every kept shared node's KV is read once for all its
member sequences, each sequence's remaining blocks (its *rest*) on their own, and each sequence's
parts are merged by their natural-log log-sum-exp (the convention of ``kernels.merge_attention``).

The plan becomes *units*: a unit is some query rows (member sequences), a list of cache blocks and a
token count, and a merge part. A kept node is a unit whose rows are its members (split into units of
at most ``MAX_UNIT_ROWS`` members) and whose blocks are the node's full blocks; a sequence's rest is
a unit of one row. When no shared node pays, every sequence is one unit over its whole table and
there is one part. Kernel 1 (``_partial_attention_kernel``) runs one program per (unit, KV head):
the unit's rows × the ``G = H / KVH`` query heads of that KV head form one query tile (grouped-query
heads as rows, so a shared block is loaded once for every member and head), it walks the unit's
blocks through the block table with an fp32 online softmax, and writes the partial output and its
log-sum-exp into a ``[num_parts, nd]`` grid of slots. Kernel 2 (``_merge_kernel``) merges each
(sequence, head)'s parts by log-sum-exp (an empty part, ``lse = -inf``, weighs 0) and writes the
output in the query's dtype; ``triton_merge_attention_states`` exposes it with the signature of
``merge_attention_states``. With one part (no shared node) kernel 1 writes the output directly.

``tl.arange`` sizes must be powers of two: head dim, block size and group are padded to the next
power of two and masked (head dim, block size and a tile's rows to at least 16, ``tl.dot``'s
minimum on GPUs). Scores and products are fp32
(``input_precision="ieee"``; 16-bit K/V are widened on load), which is exact but leaves tensor cores
unused on GPUs. On CUDA the kernels compile natively, but they are untested there (no GPU here). On
CPU they run only under Triton's interpreter, ``TRITON_INTERPRET=1`` set before ``triton`` is first
imported: slow (numpy per program), for tests. The interpreter rounds fp32 → bf16 by truncation
(≤ 1 ulp off torch's round-to-nearest) and cannot multiply bf16 tiles, hence the widening.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.cascade_attention import CascadePlan, CascadeRule, plan_cascade
from kernels.decode_attention import DecodeAttention

MAX_UNIT_ROWS = 16  # member sequences per program: a bigger node is split (its KV read once per split)
MIN_DOT_DIM = 16  # tl.dot on GPUs wants every dimension >= 16
MERGE_ROWS = 32  # (sequence, head) rows per merge program


@triton.jit
def _partial_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,  # query [nd, H, D]; caches [NB, BS, KVH, D]; out [slots, H, D]; lse [slots, H]
    rows_ptr, slots_ptr, blocks_ptr, lens_ptr,  # the unit tensors of a UnitBatch
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_os, stride_oh, stride_ls,
    rows_width, blocks_width, scale,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    MP: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, BSP: tl.constexpr,
):
    unit = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = tl.arange(0, MP * GP)  # tile row = member * GP + g
    member, g = r // GP, r % GP
    seq = tl.load(rows_ptr + unit * rows_width + member, mask=member < rows_width, other=-1)  # [R]
    slot = tl.load(slots_ptr + unit * rows_width + member, mask=member < rows_width, other=-1)
    row_ok = (seq >= 0) & (g < G)
    head = kv_head * G + g
    d = tl.arange(0, DP)
    d_ok = d < D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + seq[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    q = q.to(tl.float32) * scale  # [R, DP]
    t = tl.arange(0, BSP)
    num_tokens = tl.load(lens_ptr + unit)
    m_i = tl.full([MP * GP], float("-inf"), tl.float32)  # running max score
    l_i = tl.zeros([MP * GP], tl.float32)  # running Σ exp(score - m_i)
    acc = tl.zeros([MP * GP, DP], tl.float32)
    for b in range(tl.cdiv(num_tokens, BS)):
        block = tl.load(blocks_ptr + unit * blocks_width + b).to(tl.int64)
        kv_ok = (t < BS) & (b * BS + t < num_tokens)  # [BSP]
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + block * stride_vb + t[:, None] * stride_vt + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # [R, BSP]
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds at least one token
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + slot[:, None] * stride_os + head[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + slot * stride_ls + head, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _merge_kernel(
    o_ptr, lse_ptr, out_ptr, out_lse_ptr,  # parts [P, N, D], [P, N]; merged [N, D], [N]
    num_parts, num_rows,
    stride_op, stride_on, stride_od, stride_lp, stride_ln, stride_outn,
    D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < num_rows
    d = tl.arange(0, DP)
    mask = n_ok[:, None] & (d < D)[None, :]
    peak = tl.full([BN], float("-inf"), tl.float32)
    for p in range(num_parts):
        peak = tl.maximum(peak, tl.load(lse_ptr + p * stride_lp + n * stride_ln, mask=n_ok, other=float("-inf")).to(tl.float32))
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # every part empty: avoid -inf - -inf
    total = tl.zeros([BN], tl.float32)
    acc = tl.zeros([BN, DP], tl.float32)
    for p in range(num_parts):
        w = tl.exp(tl.load(lse_ptr + p * stride_lp + n * stride_ln, mask=n_ok, other=float("-inf")).to(tl.float32) - peak)
        # An empty part's output is not read: it may be garbage (NaN), and 0 · NaN is NaN.
        o = tl.load(o_ptr + p * stride_op + n[:, None] * stride_on + d[None, :] * stride_od, mask=mask & (w > 0)[:, None], other=0.0)
        acc += o.to(tl.float32) * w[:, None]
        total += w
    out = acc / tl.maximum(total, 1.1754943508222875e-38)[:, None]
    tl.store(out_ptr + n[:, None] * stride_outn + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    lse = tl.where(total > 0, tl.log(tl.maximum(total, 1.1754943508222875e-38)) + peak, float("-inf"))
    tl.store(out_lse_ptr + n, lse, mask=n_ok)


INTERPRETED = isinstance(_partial_attention_kernel, InterpretedFunction)


def _pow2(n: int) -> int:
    return max(MIN_DOT_DIM, triton.next_power_of_2(n))


def _merge_into(
    outputs: torch.Tensor,  # [P, N, D]
    lses: torch.Tensor,  # [P, N]
    out: torch.Tensor,  # [N, D] written, in its own dtype
    out_lse: torch.Tensor,  # [N] fp32, written
) -> None:
    num_parts, num_rows, head_dim = outputs.shape
    if num_rows == 0:
        return
    _merge_kernel[(triton.cdiv(num_rows, MERGE_ROWS),)](
        outputs, lses, out, out_lse, num_parts, num_rows,
        outputs.stride(0), outputs.stride(1), outputs.stride(2), lses.stride(0), lses.stride(1), out.stride(0),
        D=head_dim, DP=triton.next_power_of_2(head_dim), BN=MERGE_ROWS,
    )


def triton_merge_attention_states(
    outputs: torch.Tensor | Sequence[torch.Tensor],  # P × [..., D] (or stacked [P, ..., D])
    lses: torch.Tensor | Sequence[torch.Tensor],  # P × [...] natural-log LSE (or stacked [P, ...])
) -> tuple[torch.Tensor, torch.Tensor]:  # ([..., D] in outputs' dtype, [...] fp32)
    """``kernels.merge_attention.merge_attention_states`` as a Triton kernel: the same arguments,
    results and empty-part rules (``lse = -inf`` weighs 0; all parts empty gives 0 and ``-inf``)."""
    o = outputs if isinstance(outputs, torch.Tensor) else torch.stack(list(outputs))
    s = lses if isinstance(lses, torch.Tensor) else torch.stack(list(lses))
    if o.shape[:-1] != s.shape:
        raise ValueError(f"outputs {tuple(o.shape)} and lses {tuple(s.shape)} do not match (parts first, head dim last)")
    lead, head_dim = o.shape[1:-1], o.shape[-1]
    out = torch.empty((*lead, head_dim), dtype=o.dtype, device=o.device)
    out_lse = torch.empty(lead, dtype=torch.float32, device=o.device)
    _merge_into(o.reshape(o.shape[0], -1, head_dim), s.float().reshape(s.shape[0], -1), out.view(-1, head_dim), out_lse.view(-1))
    return out, out_lse


@dataclass
class UnitBatch:
    """Units launched together (one kernel-1 grid of ``[U, KVH]`` programs)."""

    rows: torch.Tensor  # [U, W] int64 query rows (sequence indices), padded with -1
    slots: torch.Tensor  # [U, W] int64 where each row's partial result goes: part * nd + sequence, -1 padding
    blocks: torch.Tensor  # [U, NB] int64 cache blocks in order, padded with 0
    lens: torch.Tensor  # [U] int64 tokens (the last block may be partly filled)

    @classmethod
    def build(cls, units: list[tuple[list[int], list[int], int, int]], num_decodes: int, device: torch.device) -> UnitBatch:
        """From ``(rows, blocks, tokens, part)`` per unit."""
        width = max(len(r) for r, _, _, _ in units)
        num_blocks = max(len(b) for _, b, _, _ in units)
        rows = [r + [-1] * (width - len(r)) for r, _, _, _ in units]
        slots = [[p * num_decodes + i for i in r] + [-1] * (width - len(r)) for r, _, _, p in units]
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            slots=torch.tensor(slots, dtype=torch.int64, device=device),
            blocks=torch.tensor([b + [0] * (num_blocks - len(b)) for _, b, _, _ in units], dtype=torch.int64, device=device),
            lens=torch.tensor([n for _, _, n, _ in units], dtype=torch.int64, device=device),
        )


@dataclass
class TritonCascadePlan:
    """A step's units for the Triton kernels, built once per step and shared by every layer."""

    num_decodes: int
    block_size: int
    num_parts: int  # merge parts per sequence: kept node depths + 1 (the rest); 1 without a cascade
    batches: list[UnitBatch]  # shared-node units (many rows), then one-row units (rests / whole sequences)
    cascade: CascadePlan | None  # the cascade it came from; None when no shared node paid

    def kv_tokens_read(self) -> int:
        """Token slots each layer reads from the K cache (and as many from V): the whole blocks of every unit."""
        bs = self.block_size
        return sum(int(((b.lens + bs - 1) // bs).sum()) * bs for b in self.batches)


class TritonCascadeDecodeAttention(DecodeAttention):
    """Cascade decode by two Triton kernels (partial attention per unit, log-sum-exp merge); see the
    module docstring."""

    kv_read = "cascade"

    def __init__(self, rule: CascadeRule | None = None) -> None:
        self.rule = rule or CascadeRule()

    def plan(self, context_lens: list[int], block_tables: torch.Tensor, block_size: int) -> TritonCascadePlan:
        nd = len(context_lens)
        cascade = plan_cascade(context_lens, block_tables, block_size, self.rule, rest=None)
        if cascade is None:
            own = [(row[: -(-c // block_size)], c) for row, c in zip(block_tables[:nd].tolist(), context_lens)]
            units = [([i], blocks, c, 0) for i, (blocks, c) in enumerate(own)]
            return TritonCascadePlan(nd, block_size, 1, [UnitBatch.build(units, nd, block_tables.device)], None)
        shared = [
            (node.members[s : s + MAX_UNIT_ROWS], node.block_ids, node.num_blocks * block_size, part)
            for node, part in zip(cascade.nodes, cascade.node_part)
            for s in range(0, len(node.members), MAX_UNIT_ROWS)
        ]
        rest_part = cascade.num_parts - 1
        rest = [
            ([i], row[: -(-n // block_size)], n, rest_part)
            for i, row, n in zip(cascade.rest_seqs.tolist(), cascade.rest_tables.tolist(), cascade.rest_lens)
        ]
        batches = [UnitBatch.build(units, nd, block_tables.device) for units in (shared, rest) if units]
        return TritonCascadePlan(nd, block_size, cascade.num_parts, batches, cascade)

    def forward(
        self,
        query: torch.Tensor,  # [nd, H, D]
        k_cache: torch.Tensor,  # [NB, BS, KVH, D]
        v_cache: torch.Tensor,  # [NB, BS, KVH, D]
        plan: TritonCascadePlan,
        scale: float,
    ) -> torch.Tensor:  # [nd, H, D]
        if query.device.type == "cpu" and not INTERPRETED:
            raise RuntimeError("the triton decode attention runs on CPU only under TRITON_INTERPRET=1, set before triton is imported")
        nd, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        out = torch.empty((nd, num_heads, head_dim), dtype=query.dtype, device=query.device)
        if plan.num_parts == 1:  # every sequence one unit: kernel 1 writes the output itself
            o_grid, lse_grid = out, torch.empty((nd, num_heads), dtype=torch.float32, device=query.device)
        else:  # slot part * nd + i; a part a sequence has no unit in keeps lse = -inf and weighs 0
            o_grid = torch.empty((plan.num_parts * nd, num_heads, head_dim), dtype=torch.float32, device=query.device)
            lse_grid = torch.full((plan.num_parts * nd, num_heads), float("-inf"), dtype=torch.float32, device=query.device)
        for batch in plan.batches:
            width = batch.rows.shape[1]
            _partial_attention_kernel[(batch.rows.shape[0], num_kv_heads)](
                query, k_cache, v_cache, o_grid, lse_grid,
                batch.rows, batch.slots, batch.blocks, batch.lens,
                *query.stride(), *k_cache.stride(), *v_cache.stride(),
                o_grid.stride(0), o_grid.stride(1), lse_grid.stride(0),
                width, batch.blocks.shape[1], scale,
                G=group, D=head_dim, BS=block_size,
                MP=triton.next_power_of_2(max(width, -(-MIN_DOT_DIM // triton.next_power_of_2(group)))),
                GP=triton.next_power_of_2(group), DP=_pow2(head_dim), BSP=_pow2(block_size),
            )
        if plan.num_parts > 1:
            _merge_into(
                o_grid.view(plan.num_parts, nd * num_heads, head_dim), lse_grid.view(plan.num_parts, nd * num_heads),
                out.view(nd * num_heads, head_dim), torch.empty(nd * num_heads, dtype=torch.float32, device=query.device),
            )
        return out
