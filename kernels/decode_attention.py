"""Decode attention (one new token per sequence) over a paged KV cache: the backends, chosen by name.

A backend has two halves: ``plan`` turns a step's context lengths and block tables into index
tensors once per step (in ``AttentionMetadata.build``), and ``forward`` runs one layer's attention
from that plan; every layer of the step shares the plan.

* ``padded`` gathers every sequence's KV up to the batch's *longest* context and runs masked SDPA:
  bytes and work scale with ``batch × max ctx``. The reference the tests compare against.
* ``exact`` (split-K, flash-decoding style) cuts each context into chunks of ``C`` tokens (whole
  blocks; ``choose_chunk_len`` picks ``C`` per step, the longest whose padding stays small),
  gathers exactly those chunks' blocks, attends every chunk in one batched flash-attention call
  that also returns each chunk's log-sum-exp, and merges a sequence's chunks by their log-sum-exp
  (in fp32). Bytes and work scale with Σctx. When every sequence fits in one chunk (similar
  contexts) there is nothing to merge. With bf16 caches a merged output is rounded twice (the
  chunks' outputs come back in bf16): relative RMS error vs fp32 attention 2.5e-3, padded 2.2e-3.

``exact`` runs grouped-query heads as *rows*: the ``G = H / KVH`` query heads sharing a KV head
form a ``[KVH, G, D]`` query, so the CPU flash kernel sees ``q_len = G`` instead of ``q_len = 1``
with broadcast KV heads (bf16, SmolLM2 shapes: ~6x faster at equal bytes on our 2-core EPYC).
Its gather is an ``index_select`` of whole blocks: no torch attention op takes a block table on
CPU. FlexAttention with a paged block mask does compile for CPU (torch 2.13), but ran ~3x slower
than this kernel here, after ~24 s of compilation; the sparse CSR ops have no bf16 kernels.
``experiments/bench_attention.py`` measures both backends.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.merge_attention import merge_attention_states

# The CPU flash kernel behind SDPA; returns (out, logsumexp), which the public SDPA does not.
_flash_attention_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# How ``exact`` chooses its chunk length (``choose_chunk_len``; measured on our 2-core EPYC, SmolLM2
# shapes). Masked (padding) tokens may be Σctx / 16, or FREE_PADDING_TOKENS per sequence when that
# is more: merging split chunks costs ~0.1 ms a layer, more than reading that padding does. Chunks
# hold at most MAX_CHUNK_TOKENS: one 4096-token sequence ran 3x faster as 4 chunks than as 1 (the
# flash kernel parallelises over chunks x heads). At most MAX_SPLITS lengths are tried.
MAX_PADDING_FRACTION = 1 / 16
FREE_PADDING_TOKENS = 64
MAX_CHUNK_TOKENS = 1024
MAX_SPLITS = 64


def gather_blocks(
    cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_ids: torch.Tensor,  # [..., nb] int64
    workspace: str | None = None,
) -> torch.Tensor:  # [..., KVH, nb * BS, D], a head-major view of one contiguous copy
    """The listed blocks' tokens, in order; copied into this thread's scratch buffer ``workspace``
    (valid until the next gather into it) when named, else into a new tensor."""
    # index_select on the flat block index is several times faster than advanced indexing on CPU.
    _, bs, kvh, d = cache.shape
    lead = block_ids.shape[:-1]
    nb = block_ids.shape[-1]
    flat = block_ids.reshape(-1)
    if workspace is None:
        blocks = cache.index_select(0, flat)  # [prod(lead) * nb, BS, KVH, D]
    else:
        out = _SCRATCH.buffer(workspace, (flat.numel(), bs, kvh, d), cache.dtype, cache.device)
        blocks = torch.index_select(cache, 0, flat, out=out)
    return blocks.view(*lead, nb * bs, kvh, d).transpose(-3, -2)


class _Scratch(threading.local):
    """Per-thread gather buffers, reused across layers and steps: a fresh allocation over glibc's
    32 MB mmap threshold page-faults on every call (a 50 MB fp32 gather took 30 ms fresh, 3 ms
    into a reused buffer). A buffer keeps the size of the largest gather made into it."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        # Inference tensors cannot be written outside inference mode: one set of buffers per mode.
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel].view(shape)


_SCRATCH = _Scratch()


@dataclass
class DecodePlan:
    """What one step's decodes read, as *units* (a padded sequence, or a chunk of one): built once
    per step, shared by every layer."""

    num_decodes: int
    block_size: int
    block_ids: torch.Tensor  # [R, nb] int64 cache blocks of each unit (padding rows point anywhere)
    valid: torch.Tensor | None  # [R, 1, 1, nb * BS] bool, True = attend; None when nothing is masked
    # Set when units are chunks (R > num_decodes); unit r belongs to sequence unit_seq[r] and is
    # chunk merge_slot[r] % max_chunks of it.
    unit_seq: torch.Tensor | None = None  # [R] int64
    merge_slot: torch.Tensor | None = None  # [R] int64 index into a [num_decodes * max_chunks] grid
    max_chunks: int = 1
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_units(self) -> int:
        return self.block_ids.shape[0]

    @property
    def unit_len(self) -> int:
        """Tokens gathered per unit."""
        return self.block_ids.shape[1] * self.block_size

    def kv_tokens_read(self) -> int:
        """Token slots each layer reads from the K cache (and as many from the V cache), padding included."""
        return self.block_ids.numel() * self.block_size

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:  # [R, 1, 1, L] 0 or -inf
        """The mask as the additive bias the flash kernel takes (the query's dtype), made once per step."""
        if self.valid is None:
            return None
        if dtype not in self._bias:
            bias = torch.zeros(self.valid.shape, dtype=dtype, device=self.valid.device)
            self._bias[dtype] = bias.masked_fill_(~self.valid, float("-inf"))
        return self._bias[dtype]


class DecodeAttention(ABC):
    """A decode-attention backend. ``kv_read`` says what a step's attention reads, as the simulator
    charges it: ``"sum"`` (Σctx) or ``"padded"`` (batch × max ctx)."""

    kv_read: str

    @abstractmethod
    def plan(
        self,
        context_lens: list[int],  # [nd]
        block_tables: torch.Tensor,  # [>= nd, max_blocks] int64, padded with 0
        block_size: int,
    ) -> DecodePlan:
        """Index tensors for a step's decodes (the first ``len(context_lens)`` rows of the table)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [nd, H, D]
        k_cache: torch.Tensor,  # [NB, BS, KVH, D]
        v_cache: torch.Tensor,  # [NB, BS, KVH, D]
        plan: DecodePlan,
        scale: float,
    ) -> torch.Tensor:  # [nd, H, D]
        """Attention of each decode's one query over its whole context."""


class PaddedDecodeAttention(DecodeAttention):
    """Every decode gathers as many blocks as the longest one; masked SDPA over the padded batch."""

    kv_read = "padded"

    def plan(self, context_lens: list[int], block_tables: torch.Tensor, block_size: int) -> DecodePlan:
        nd = len(context_lens)
        num_blocks = -(-max(context_lens) // block_size)
        length = num_blocks * block_size
        ctx = torch.tensor(context_lens, dtype=torch.int64, device=block_tables.device)
        valid = torch.arange(length, device=block_tables.device)[None, :] < ctx[:, None]  # [nd, L]
        return DecodePlan(nd, block_size, block_tables[:nd, :num_blocks], valid.view(nd, 1, 1, length))

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
    ) -> torch.Tensor:
        k = gather_blocks(k_cache, plan.block_ids)  # [nd, KVH, L, D]
        v = gather_blocks(v_cache, plan.block_ids)
        q = query.unsqueeze(2)  # [nd, H, 1, D]
        gqa = query.shape[1] != k_cache.shape[2]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.valid, scale=scale, enable_gqa=gqa)
        return o.squeeze(2)  # [nd, H, D]


def choose_chunk_len(context_lens: list[int], block_size: int) -> int:
    """The longest chunk ``ceil(longest context / k)``, rounded up to whole blocks and at most
    ``MAX_CHUNK_TOKENS``, whose padding stays within ``max(MAX_PADDING_FRACTION · Σctx,
    FREE_PADDING_TOKENS · nd)``; one block if none does."""
    total = sum(context_lens)
    allowed = max(MAX_PADDING_FRACTION * total, FREE_PADDING_TOKENS * len(context_lens))
    longest_blocks = -(-max(context_lens) // block_size)
    first = -(-longest_blocks // max(1, MAX_CHUNK_TOKENS // block_size))
    tried = 0
    for k in range(first, min(longest_blocks, first + MAX_SPLITS - 1) + 1):
        chunk = -(-longest_blocks // k) * block_size
        if chunk == tried:
            continue
        tried = chunk
        if sum(-(-c // chunk) for c in context_lens) * chunk - total <= allowed:
            return chunk
    return block_size


class ExactDecodeAttention(DecodeAttention):
    """Split-K over chunks of each context, merged by log-sum-exp; reads Σctx (see the module docstring)."""

    kv_read = "sum"

    def __init__(self, chunk_len: int | None = None) -> None:
        """``chunk_len``: a fixed chunk length (a multiple of the block size); None chooses one per step."""
        self.chunk_len = chunk_len

    def plan(self, context_lens: list[int], block_tables: torch.Tensor, block_size: int) -> DecodePlan:
        nd = len(context_lens)
        device = block_tables.device
        chunk = self.chunk_len or choose_chunk_len(context_lens, block_size)
        if chunk % block_size:
            raise ValueError(f"chunk length {chunk} is not a multiple of the block size {block_size}")
        max_chunks = -(-max(context_lens) // chunk)
        width = max_chunks * (chunk // block_size)
        table = block_tables[:nd, :width]
        if table.shape[1] < width:
            table = F.pad(table, (0, width - table.shape[1]))
        grid = table.reshape(nd * max_chunks, chunk // block_size)  # row i * max_chunks + j: chunk j of sequence i
        slots: list[int] = []  # the grid rows that exist
        lens: list[int] = []  # their tokens
        for i, ctx in enumerate(context_lens):
            for j in range(-(-ctx // chunk)):
                slots.append(i * max_chunks + j)
                lens.append(min(chunk, ctx - j * chunk))
        valid = None
        if sum(lens) < len(lens) * chunk:
            valid = torch.arange(chunk)[None, :] < torch.tensor(lens)[:, None]  # [R, C]
            valid = valid.view(-1, 1, 1, chunk).to(device)
        if max_chunks == 1:
            return DecodePlan(nd, block_size, grid, valid)
        merge_slot = torch.tensor(slots, dtype=torch.int64, device=device)  # [R]
        return DecodePlan(
            nd, block_size, grid.index_select(0, merge_slot), valid,
            unit_seq=merge_slot // max_chunks, merge_slot=merge_slot, max_chunks=max_chunks,
        )

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
    ) -> torch.Tensor:
        return self.forward_with_lse(query, k_cache, v_cache, plan, scale)[0]

    def forward_with_lse(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([nd, H, D], [nd, H] fp32 natural-log LSE)
        """``forward`` and each decode's log-sum-exp, to merge with attention over other keys (cascade)."""
        nd, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        k = gather_blocks(k_cache, plan.block_ids, workspace="k")  # [R, KVH, C, D]
        v = gather_blocks(v_cache, plan.block_ids, workspace="v")
        q = query.view(nd, num_kv_heads, group, head_dim)  # [nd, KVH, G, D]: a group's heads as rows
        if plan.unit_seq is not None:
            q = q.index_select(0, plan.unit_seq)  # [R, KVH, G, D]
        o, lse = _flash_attention_with_lse(q, k, v, attn_mask=plan.bias(query.dtype), scale=scale)
        if plan.merge_slot is None:
            return o.reshape(nd, num_heads, head_dim), lse.reshape(nd, num_heads)
        # o: [R, KVH, G, D], lse: [R, KVH, G] fp32. Lay the chunks out on a [max_chunks, nd] grid
        # (absent chunks have lse = -inf and weigh 0) and merge them by log-sum-exp.
        cells = nd * plan.max_chunks
        lse_grid = torch.full((cells, num_kv_heads, group), float("-inf"), dtype=torch.float32, device=query.device)
        lse_grid.index_copy_(0, plan.merge_slot, lse)
        o_grid = torch.zeros((cells, num_kv_heads, group, head_dim), dtype=o.dtype, device=query.device)
        o_grid.index_copy_(0, plan.merge_slot, o)
        out, lse = merge_attention_states(
            o_grid.view(nd, plan.max_chunks, num_kv_heads, group, head_dim).transpose(0, 1),
            lse_grid.view(nd, plan.max_chunks, num_kv_heads, group).transpose(0, 1),
        )
        return out.view(nd, num_heads, head_dim), lse.view(nd, num_heads)
