"""Attention over a paged KV cache: the torch implementation used on CPU (and as the reference).

KV cache layout, one pair per layer:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A sequence's token at position ``p`` lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat *slot* is ``block * block_size + offset``.

A batch is packed: the new tokens of every sequence are concatenated into ``T`` rows. Each
sequence contributes a *chunk* of ``query_len`` new tokens starting at position
``context_len - query_len``; it attends causally to all ``context_len`` tokens of its context.
Chunks with ``query_len == 1`` (decodes) come first so they can be batched in one call, by the
decode-attention backend the metadata names (``kernels.decode_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backends import default_decode_attention, get_decode_attention
from kernels.cascade_attention import CascadePlan
from kernels.decode_attention import DecodeAttention, DecodePlan, gather_blocks


@dataclass
class AttentionMetadata:
    """Per-step description of the packed batch, built once and shared by every layer."""

    num_decodes: int  # the first num_decodes chunks have query_len == 1
    query_lens: list[int]  # [N]
    context_lens: list[int]  # [N] KV length after this step's tokens are written
    query_start_loc: list[int]  # [N + 1] row offsets of each chunk in the packed batch
    slot_mapping: torch.Tensor  # [T] int64 flat cache slot of each new token
    block_tables: torch.Tensor  # [N, max_blocks] int64, padded with 0
    block_size: int
    decode_attention: DecodeAttention  # the backend that runs the decodes
    decode_plan: DecodePlan | CascadePlan | None = None  # its index tensors for this step; None without decodes

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        decode_attention: str | None = None,
    ) -> "AttentionMetadata":
        """``decode_attention`` names a backend of ``kernels.backends`` (default: the
        device's, ``default_decode_attention``)."""
        backend = get_decode_attention(decode_attention or default_decode_attention(device))
        num_decodes = 0
        for q in query_lens:
            if q != 1:
                break
            num_decodes += 1
        if any(q == 1 for q in query_lens[num_decodes:]):
            raise ValueError("decode chunks (query_len == 1) must come first in the batch")
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        max_blocks = max((len(b) for b in block_tables), default=1) or 1
        # One tensor from padded lists: a per-row copy costs ~5 µs a sequence.
        padded = [b + [0] * (max_blocks - len(b)) for b in block_tables] or [[0]]
        table = torch.tensor(padded, dtype=torch.int64)[: len(block_tables)].to(device)
        plan = backend.plan(context_lens[:num_decodes], table, block_size) if num_decodes else None
        return cls(
            num_decodes=num_decodes,
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            query_start_loc=starts,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_tables=table,
            block_size=block_size,
            decode_attention=backend,
            decode_plan=plan,
        )


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Store the new tokens' K and V at their slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D] this step's keys (already written to the cache)
    value: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each chunk's new tokens over its whole (paged) context."""
    out = torch.empty_like(query)
    num_heads = query.shape[1]
    gqa = num_heads != key.shape[1]
    nd = meta.num_decodes
    if meta.decode_plan is not None:
        out[:nd] = meta.decode_attention.forward(query[:nd], k_cache, v_cache, meta.decode_plan, scale)
    for i in range(nd, len(meta.query_lens)):
        s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        q_len, ctx_len = meta.query_lens[i], meta.context_lens[i]
        q = query[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if ctx_len == q_len:
            # Whole prompt in this chunk: attend to the fresh K/V, no cache read needed.
            k = key[s:e].transpose(0, 1).unsqueeze(0)  # [1, KVH, q_len, D]
            v = value[s:e].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # A chunk over a cached prefix reads its own context exactly (no padding). Its time is
            # attention compute: gathering into reused buffers, a per-step mask or grouped heads as
            # rows (as the exact decode does) gained 0-10% here (SmolLM2 shapes, 16-512 queries over
            # 1-2k tokens), within this machine's noise, so it stays plain SDPA.
            nb = -(-ctx_len // meta.block_size)
            table = meta.block_tables[i, :nb]
            k = gather_blocks(k_cache, table)[:, :ctx_len].unsqueeze(0)  # [1, KVH, ctx, D]
            v = gather_blocks(v_cache, table)[:, :ctx_len].unsqueeze(0)
            start = ctx_len - q_len
            q_pos = torch.arange(start, ctx_len, device=query.device)[:, None]
            mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos  # [q_len, ctx]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out


def reference_attention(
    query: torch.Tensor,  # [q_len, H, D]
    keys: torch.Tensor,  # [ctx, KVH, D]
    values: torch.Tensor,  # [ctx, KVH, D]
    scale: float,
) -> torch.Tensor:  # [q_len, H, D]
    """Plain causal attention of the last q_len positions over a contiguous context (for tests)."""
    q_len, num_heads, _ = query.shape
    ctx = keys.shape[0]
    group = num_heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, q_len, ctx]
    pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)
