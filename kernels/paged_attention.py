"""Attention over a paged KV cache: the torch implementation used on CPU (and as the reference).

KV cache layout, one pair per layer:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A sequence's token at position ``p`` lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat *slot* is ``block * block_size + offset``.

A batch is packed: the new tokens of every sequence are concatenated into ``T`` rows. Each
sequence contributes a *chunk* of ``query_len`` new tokens starting at position
``context_len - query_len``; it attends causally to all ``context_len`` tokens of its context.
Chunks with ``query_len == 1`` (decodes) come first so they can be batched in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, L] bool, True = attend
    decode_num_blocks: int = 0  # blocks gathered per decode sequence (L = this * block_size)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
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
        table = torch.zeros((len(block_tables), max_blocks), dtype=torch.int64)
        for i, blocks in enumerate(block_tables):
            if blocks:
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        decode_mask = None
        decode_num_blocks = 0
        if num_decodes:
            max_ctx = max(context_lens[:num_decodes])
            decode_num_blocks = -(-max_ctx // block_size)
            length = decode_num_blocks * block_size
            ctx = torch.tensor(context_lens[:num_decodes], dtype=torch.int64)
            decode_mask = (torch.arange(length)[None, :] < ctx[:, None]).view(num_decodes, 1, 1, length)
            decode_mask = decode_mask.to(device)
        return cls(
            num_decodes=num_decodes,
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            query_start_loc=starts,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_tables=table.to(device),
            block_size=block_size,
            decode_mask=decode_mask,
            decode_num_blocks=decode_num_blocks,
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


def _gather_context(
    cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [..., nb]
) -> torch.Tensor:  # [..., KVH, nb * BS, D]
    # index_select on the flat block index is several times faster than advanced indexing on CPU.
    _, bs, kvh, d = cache.shape
    lead = block_table.shape[:-1]
    nb = block_table.shape[-1]
    blocks = cache.index_select(0, block_table.reshape(-1))  # [prod(lead) * nb, BS, KVH, D]
    return blocks.view(*lead, nb * bs, kvh, d).transpose(-3, -2)


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
    if nd:
        nb = meta.decode_num_blocks
        tables = meta.block_tables[:nd, :nb]  # [nd, nb]
        k = _gather_context(k_cache, tables)  # [nd, KVH, L, D]
        v = _gather_context(v_cache, tables)
        q = query[:nd].unsqueeze(2)  # [nd, H, 1, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )  # [nd, H, 1, D]
        out[:nd] = o.squeeze(2)
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
            nb = -(-ctx_len // meta.block_size)
            table = meta.block_tables[i, :nb]
            k = _gather_context(k_cache, table)[:, :ctx_len].unsqueeze(0)  # [1, KVH, ctx, D]
            v = _gather_context(v_cache, table)[:, :ctx_len].unsqueeze(0)
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
