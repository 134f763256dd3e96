"""Paged attention (torch implementation) against plain causal attention on contiguous K/V."""

import pytest
import torch

from kernels.backends import available_decode_attentions
from kernels.paged_attention import AttentionMetadata, paged_attention, reference_attention, write_kv


@pytest.mark.parametrize("decode_attention", available_decode_attentions("cpu"))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3)])
def test_mixed_batch_matches_reference(num_heads: int, num_kv_heads: int, decode_attention: str) -> None:
    torch.manual_seed(0)
    d, bs, nb = 16, 4, 64
    k_cache = torch.zeros(nb, bs, num_kv_heads, d)
    v_cache = torch.zeros(nb, bs, num_kv_heads, d)
    perm = torch.randperm(nb).tolist()  # scattered, non-contiguous blocks
    # (context_len, query_len): two decodes, a fresh prompt, a prefix-cached/chunked continuation
    shapes = [(9, 1), (17, 1), (7, 7), (13, 5)]
    full_k, full_v, tables = [], [], []
    for ctx, _ in shapes:
        need = -(-ctx // bs)
        tables.append([perm.pop() for _ in range(need)])
        full_k.append(torch.randn(ctx, num_kv_heads, d))
        full_v.append(torch.randn(ctx, num_kv_heads, d))
    # Pre-fill the cache with each sequence's earlier tokens (as earlier steps would have).
    for (ctx, q), table, k, v in zip(shapes, tables, full_k, full_v):
        start = ctx - q
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start)], dtype=torch.int64)
        if start:
            write_kv(k[:start], v[:start], k_cache, v_cache, slots)
    query = [torch.randn(q, num_heads, d) for _, q in shapes]
    slots = [table[p // bs] * bs + p % bs for (ctx, q), table in zip(shapes, tables) for p in range(ctx - q, ctx)]
    meta = AttentionMetadata.build([q for _, q in shapes], [c for c, _ in shapes], slots, tables, bs, decode_attention=decode_attention)
    new_k = torch.cat([k[c - q :] for (c, q), k in zip(shapes, full_k)])
    new_v = torch.cat([v[c - q :] for (c, q), v in zip(shapes, full_v)])
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(torch.cat(query), new_k, new_v, k_cache, v_cache, meta, scale=d**-0.5)
    expected = torch.cat([reference_attention(qq, k, v, d**-0.5) for qq, k, v in zip(query, full_k, full_v)])
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decodes_must_come_first() -> None:
    with pytest.raises(ValueError):
        AttentionMetadata.build([3, 1], [3, 5], [0, 1, 2, 3], [[0], [1, 2]], 4)
