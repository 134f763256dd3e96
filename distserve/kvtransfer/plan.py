"""The resharding plan: which layers × KV heads go from which prefill worker to which decode worker."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from distserve.kvtransfer.layout import KVLayout

MAX_TAG = 2**31 - 1  # gloo wants a non-negative 32-bit tag: every message of every migration has one in [0, MAX_TAG]


@dataclass(frozen=True)
class TransferSlice:
    """One message of a migration: global half-open ``layers`` × ``kv_heads`` of every block of a request."""

    src_rank: int  # instance-local rank on the sending (prefill) side
    dst_rank: int  # instance-local rank on the receiving (decode) side
    layers: tuple[int, int]
    kv_heads: tuple[int, int]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def shape(self, num_blocks: int, layout: KVLayout) -> tuple[int, int, int, int, int, int]:
        """Shape of the packed message: [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, num_blocks, layout.block_size, self.num_kv_heads, layout.head_dim)

    def nbytes(self, num_blocks: int, layout: KVLayout) -> int:
        n = self.num_layers * 2 * num_blocks * layout.block_size * self.num_kv_heads * layout.head_dim
        return n * layout.itemsize


def reshard_plan(src: KVLayout, dst: KVLayout) -> list[TransferSlice]:
    """Slices that give every decode worker exactly the (layer, KV head) pairs it owns, once each.

    Ordered by destination rank, then layer, then head; both sides execute slices in this order,
    which keeps per-pair message order identical on sender and receiver (what NCCL needs). When
    several source ranks hold a head (replicated heads), the least-loaded one so far is chosen
    (ties to the lowest rank), so the choice is deterministic and spreads the sending work.
    """
    return list(_cached_plan(src, dst))


@functools.lru_cache(maxsize=256)
def _cached_plan(src: KVLayout, dst: KVLayout) -> tuple[TransferSlice, ...]:
    if not src.same_model(dst):
        raise ValueError(f"source and destination layouts describe different KV caches: {src} vs {dst}")
    load = [0] * src.world_size  # (layer, head) pairs assigned to each source rank so far
    plan: list[TransferSlice] = []
    for dst_rank in range(dst.world_size):
        dst_tp, dst_pp = dst.coords(dst_rank)
        dl0, dl1 = dst.local_layers(dst_pp)
        dh0, dh1 = dst.local_heads(dst_tp)
        for src_pp in range(src.pp):
            sl0, sl1 = src.local_layers(src_pp)
            l0, l1 = max(dl0, sl0), min(dl1, sl1)
            if l0 >= l1:
                continue
            holders: dict[tuple[int, int], list[int]] = {}  # head range -> source ranks holding it, by head
            for src_tp in range(src.tp):
                holders.setdefault(src.local_heads(src_tp), []).append(src.rank(src_tp, src_pp))
            for (sh0, sh1), ranks in holders.items():
                h0, h1 = max(dh0, sh0), min(dh1, sh1)
                if h0 >= h1:
                    continue
                src_rank = min(ranks, key=lambda r: (load[r], r))
                load[src_rank] += (l1 - l0) * (h1 - h0)
                plan.append(TransferSlice(src_rank, dst_rank, (l0, l1), (h0, h1)))
    return tuple(plan)


reshard_plan.cache_info = _cached_plan.cache_info  # type: ignore[attr-defined]


def num_tags(layout_src: KVLayout, layout_dst: KVLayout) -> int:
    """Tags one request may use (``tag_base`` .. ``tag_base + num_tags - 1``); space concurrent requests by this."""
    return len(reshard_plan(layout_src, layout_dst)) * layout_src.num_layers + 1  # + 1: the header
