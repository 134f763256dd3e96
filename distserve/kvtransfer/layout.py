"""How a KV cache is split over an instance's ``tp × pp`` workers: layer stages and KV-head shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distserve.dtypes import DTYPE_BYTES, torch_dtype

if TYPE_CHECKING:
    import torch


def layer_range(num_layers: int, pp: int, pp_rank: int) -> tuple[int, int]:
    """Half-open global layer range of pipeline stage ``pp_rank``.

    Contiguous split; when uneven the earlier stages get one extra layer (30 layers, pp=4 →
    8, 8, 7, 7). This is the single definition of the pipeline split: the model imports it too.
    """
    if pp < 1 or not 0 <= pp_rank < pp:
        raise ValueError(f"need pp >= 1 and 0 <= pp_rank < pp, got pp={pp} pp_rank={pp_rank}")
    if num_layers < pp:
        raise ValueError(f"cannot split {num_layers} layers over pp={pp} stages (every stage needs a layer)")
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def kv_head_range(num_kv_heads: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """Half-open global KV-head range held by tensor-parallel rank ``tp_rank``.

    ``num_kv_heads >= tp``: an even split (must divide). ``num_kv_heads < tp``: heads are
    replicated (``tp`` must be a multiple of ``num_kv_heads``) and rank r holds the single head
    ``r * num_kv_heads // tp``, as in vLLM.
    """
    if tp < 1 or not 0 <= tp_rank < tp:
        raise ValueError(f"need tp >= 1 and 0 <= tp_rank < tp, got tp={tp} tp_rank={tp_rank}")
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"num_kv_heads={num_kv_heads} is not divisible by tp={tp}")
        per_rank = num_kv_heads // tp
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp % num_kv_heads:
        raise ValueError(f"tp={tp} is not a multiple of num_kv_heads={num_kv_heads} (needed to replicate KV heads)")
    head = tp_rank * num_kv_heads // tp
    return head, head + 1


@dataclass(frozen=True)
class KVLayout:
    """The KV cache of one instance: model shape, block size and its ``tp × pp`` split.

    Worker ``rank = pp_rank * tp + tp_rank`` holds
    ``[local_layers, 2, num_blocks, block_size, local_kv_heads, head_dim]``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp: int = 1
    pp: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.tp, self.pp) < 1:
            raise ValueError(f"every KVLayout size must be >= 1: {self}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}: one of {', '.join(DTYPE_BYTES)}")
        layer_range(self.num_layers, self.pp, 0)  # validates the splits
        kv_head_range(self.num_kv_heads, self.tp, 0)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def same_model(self, other: "KVLayout") -> bool:
        """True when both layouts describe the same KV (only the parallel split may differ)."""
        keys = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
        return all(getattr(self, k) == getattr(other, k) for k in keys)

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(tp_rank, pp_rank) of an instance-local rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for tp={self.tp} pp={self.pp}")
        return rank % self.tp, rank // self.tp

    def ranks(self) -> list[tuple[int, int]]:
        """(tp_rank, pp_rank) of every worker, in rank order."""
        return [self.coords(r) for r in range(self.world_size)]

    def local_layers(self, pp_rank: int) -> tuple[int, int]:
        return layer_range(self.num_layers, self.pp, pp_rank)

    def local_heads(self, tp_rank: int) -> tuple[int, int]:
        return kv_head_range(self.num_kv_heads, self.tp, tp_rank)

    def local_shape(self, num_blocks: int, pp_rank: int, tp_rank: int) -> tuple[int, int, int, int, int, int]:
        """Shape of worker (tp_rank, pp_rank)'s cache: [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        l0, l1 = self.local_layers(pp_rank)
        h0, h1 = self.local_heads(tp_rank)
        return (l1 - l0, 2, num_blocks, self.block_size, h1 - h0, self.head_dim)

    def block_nbytes(self) -> int:
        """Bytes of one block over all layers and KV heads (K and V), unsharded."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize
