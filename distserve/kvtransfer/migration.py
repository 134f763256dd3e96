"""Moving one request's KV blocks from prefill workers to decode workers along the resharding plan.

Each worker runs ``send_kv`` (prefill side) or ``recv_kv`` (decode side) for the request; both
walk ``reshard_plan`` in order and act on the slices that involve them. A slice carries all of the
request's blocks for its layers × KV heads, never one message per block: it is one message, or,
when large (``chunk_bytes``), a few layer pieces pipelined so gather, transfer and scatter overlap.

Prefix dedup: the caller trims both block lists before calling (``blocks_to_send`` tells how many
leading blocks the receiver already holds, ``trim_block_lists`` applies it).

Faults: with ``timeout_s`` a side gives up (``TransferTimeout``) when its share has not completed
in time, and with ``cancel`` as soon as the event is set. Ops already posted cannot be withdrawn,
so a failed side hands them to ``KVTransport.abandon`` and drops its staging buffers: nothing a
late peer may still write or read is ever reused.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from distserve.kvtransfer.layout import KVLayout, layer_range
from distserve.kvtransfer.plan import MAX_TAG, TransferSlice, num_tags, reshard_plan
from distserve.kvtransfer.transport import Handle, KVTransport, TransferCancelled

RankMap = Sequence[int] | Mapping[int, int]  # instance-local rank -> global transport rank
BlockIds = Sequence[int] | torch.Tensor


@dataclass
class MigrationStats:
    """What one worker moved for one request."""

    num_blocks_sent: int = 0  # blocks of the request carried (sent or received)
    num_blocks_skipped: int = 0  # leading blocks the receiver already held
    num_bytes: int = 0  # payload bytes this worker sent or received
    seconds: float = 0.0

    @property
    def gbytes_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class StagingBuffers:
    """Reusable buffers for packed and received slices, one per slice position.

    Fresh multi-hundred-MB allocations page-fault on first touch (on CPU that halves the copy
    speed); a worker that keeps one ``StagingBuffers`` across requests avoids it. A buffer is
    reused by the next call, so one instance per worker, not shared between threads.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor] = []  # flat uint8

    def get(self, position: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        while len(self._buffers) <= position:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[position].numel() < nbytes:
            self._buffers[position] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[position][:nbytes].view(dtype).view(tuple(shape))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    def clear(self) -> None:
        """Drop every buffer; the next ``get`` allocates afresh (ops still posted keep theirs alive)."""
        self._buffers = []


# ---- packing ---------------------------------------------------------------------------------
def _block_index(block_ids: BlockIds, num_blocks: int, device: torch.device) -> torch.Tensor:
    """Validated int64 index tensor [n] of block ids."""
    idx = torch.as_tensor(block_ids, dtype=torch.int64, device=device).reshape(-1)
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"block ids must be in [0, {num_blocks}), got range [{lo}, {hi}]")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError("block ids contain duplicates")
    return idx


def _check_slices(kv_cache: torch.Tensor, layer_slice: tuple[int, int], head_slice: tuple[int, int]) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [layers, 2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    (l0, l1), (h0, h1) = layer_slice, head_slice
    if not (0 <= l0 < l1 <= kv_cache.shape[0] and 0 <= h0 < h1 <= kv_cache.shape[4]):
        raise ValueError(
            f"local layer slice {layer_slice} / head slice {head_slice} outside a cache of "
            f"{kv_cache.shape[0]} layers × {kv_cache.shape[4]} KV heads"
        )


def pack_blocks(
    kv_cache: torch.Tensor,  # [L, 2, NB, BS, H, D]
    block_ids: BlockIds,
    layer_slice: tuple[int, int],
    head_slice: tuple[int, int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [l1 - l0, 2, n, BS, h1 - h0, D] contiguous
    """Gather the given blocks' K and V for local layers × local KV heads into one contiguous tensor."""
    _check_slices(kv_cache, layer_slice, head_slice)
    (l0, l1), (h0, h1) = layer_slice, head_slice
    _, _, num_blocks, bs, num_heads, d = kv_cache.shape
    idx = _block_index(block_ids, num_blocks, kv_cache.device)
    n = idx.numel()
    shape = (l1 - l0, 2, n, bs, h1 - h0, d)
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    elif tuple(out.shape) != shape or out.dtype != kv_cache.dtype or not out.is_contiguous():
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, expected contiguous {shape} {kv_cache.dtype}")
    rows = (l1 - l0) * 2
    src = kv_cache[l0:l1]  # [l, 2, NB, BS, H, D]
    if h1 - h0 == num_heads and src.is_contiguous():
        # All heads: each (layer, K/V) row of a block is one contiguous run, the fastest gather.
        torch.index_select(src.view(rows, num_blocks, bs * num_heads * d), 1, idx, out=out.view(rows, n, -1))
    else:
        torch.index_select(src[..., h0:h1, :].reshape(rows, num_blocks, bs, h1 - h0, d), 1, idx,
                           out=out.view(rows, n, bs, h1 - h0, d))
    return out


def unpack_blocks(
    kv_cache: torch.Tensor,  # [L, 2, NB, BS, H, D]
    block_ids: BlockIds,
    layer_slice: tuple[int, int],
    head_slice: tuple[int, int],
    data: torch.Tensor,  # [l1 - l0, 2, n, BS, h1 - h0, D]
) -> None:
    """Scatter a packed tensor (``pack_blocks``'s output) into the given blocks of the cache."""
    _check_slices(kv_cache, layer_slice, head_slice)
    (l0, l1), (h0, h1) = layer_slice, head_slice
    _, _, num_blocks, bs, num_heads, d = kv_cache.shape
    idx = _block_index(block_ids, num_blocks, kv_cache.device)
    n = idx.numel()
    shape = (l1 - l0, 2, n, bs, h1 - h0, d)
    if tuple(data.shape) != shape:
        raise ValueError(f"data is {tuple(data.shape)} but {n} blocks of this slice are {shape}")
    data = data.to(device=kv_cache.device, dtype=kv_cache.dtype).contiguous()
    rows = (l1 - l0) * 2
    dst = kv_cache[l0:l1]
    if h1 - h0 == num_heads and dst.is_contiguous():
        dst.view(rows, num_blocks, -1).index_copy_(1, idx, data.view(rows, n, -1))
    else:
        dst[..., h0:h1, :].index_copy_(2, idx, data)


# ---- one request, one worker ---------------------------------------------------------------
def _to_global(rank_map: RankMap, rank: int) -> int:
    try:
        return int(rank_map[rank])
    except (KeyError, IndexError):
        raise ValueError(f"no global transport rank for instance rank {rank}") from None


def _check_worker(kv_cache: torch.Tensor, layout: KVLayout, rank: int, side: str) -> tuple[int, int]:
    """Validate a worker's cache against its layout; return its (first layer, first KV head)."""
    tp_rank, pp_rank = layout.coords(rank)
    expected = layout.local_shape(kv_cache.shape[2] if kv_cache.dim() == 6 else 0, pp_rank, tp_rank)
    if tuple(kv_cache.shape) != expected or kv_cache.dtype != layout.torch_dtype:
        raise ValueError(
            f"{side} rank {rank}: kv_cache is {tuple(kv_cache.shape)} {kv_cache.dtype}, "
            f"its layout expects {expected} {layout.torch_dtype}"
        )
    return layout.local_layers(pp_rank)[0], layout.local_heads(tp_rank)[0]


def _local(s: TransferSlice, first_layer: int, first_head: int) -> tuple[tuple[int, int], tuple[int, int]]:
    return (
        (s.layers[0] - first_layer, s.layers[1] - first_layer),
        (s.kv_heads[0] - first_head, s.kv_heads[1] - first_head),
    )


# Slices of at least twice this size travel as layer chunks (see ``messages``). On a 2-core CPU box
# over gloo, 16 MiB pieces let packing and unpacking overlap the transfer without paying much
# per-message wake-up cost; see experiments/bench_kv_migration.py.
DEFAULT_CHUNK_BYTES = 16 << 20


def messages(
    plan: Sequence[TransferSlice], num_blocks: int, layout: KVLayout, chunk_bytes: int | None = DEFAULT_CHUNK_BYTES
) -> list[tuple[int, TransferSlice]]:
    """The messages of one request, in send order: (tag offset, slice narrowed to a layer chunk).

    With ``chunk_bytes=None`` every slice is exactly one message. Otherwise a slice of ``nbytes``
    is cut along layers into ``min(num_layers, nbytes // chunk_bytes)`` near-equal pieces (one
    piece below ``2 * chunk_bytes``); every piece still holds all of the request's blocks (never
    one message per block). Pipelining the pieces lets packing, transfer and unpacking overlap. Sender and
    receiver must use the same ``chunk_bytes`` (the header check catches a mismatch). Tag offsets
    lie in ``[0, num_tags(...) - 1)``.
    """
    if chunk_bytes is not None and chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1 or None, got {chunk_bytes}")
    out: list[tuple[int, TransferSlice]] = []
    for i, s in enumerate(plan):
        nbytes = s.nbytes(num_blocks, layout)
        num_chunks = 1 if chunk_bytes is None else max(1, min(s.num_layers, nbytes // chunk_bytes))
        for c in range(num_chunks):
            c0, c1 = layer_range(s.num_layers, num_chunks, c)
            piece = TransferSlice(s.src_rank, s.dst_rank, (s.layers[0] + c0, s.layers[0] + c1), s.kv_heads)
            out.append((i * layout.num_layers + c0, piece))
    return out


def _check_tags(tag_base: int, layout_src: KVLayout, layout_dst: KVLayout) -> int:
    """Validate the request's tag range; return the header's tag."""
    span = num_tags(layout_src, layout_dst)
    if tag_base < 0 or tag_base + span - 1 > MAX_TAG:
        raise ValueError(f"tags [{tag_base}, {tag_base + span}) must lie in [0, {MAX_TAG}]")
    return tag_base + span - 1


class _Waits:
    """The posted ops of one side of a transfer, waited on against one deadline."""

    def __init__(self, transport: KVTransport, timeout_s: float | None, cancel: threading.Event | None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        if cancel is not None and cancel.is_set():
            raise TransferCancelled("transfer cancelled before it started")
        self.transport = transport
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.cancel = cancel
        self.unfinished: list[Handle] = []

    def post(self, handle: Handle) -> Handle:
        self.unfinished.append(handle)
        return handle

    def wait(self, handle: Handle) -> None:
        remaining = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        handle.wait(remaining, self.cancel)
        self.unfinished.remove(handle)

    def abandon(self, staging: StagingBuffers | None) -> None:
        """The transfer failed: keep what is still posted alive, never reuse the staging buffers."""
        self.transport.abandon(self.unfinished)
        self.unfinished = []
        if staging is not None:
            staging.clear()


def _fingerprint(layout_src: KVLayout, layout_dst: KVLayout, chunk_bytes: int | None) -> int:
    """Stable id of everything both sides must agree on besides the block count."""
    digest = hashlib.blake2b(repr((layout_src, layout_dst, chunk_bytes)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def send_kv(
    transport: KVTransport,
    kv_cache: torch.Tensor,  # [local layers, 2, NB, BS, local kv heads, D]
    layout_src: KVLayout,
    layout_dst: KVLayout,
    my_src_rank: int,
    block_ids: BlockIds,
    dst_rank_to_global: RankMap,
    tag_base: int,
    *,
    staging: StagingBuffers | None = None,
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
    num_blocks_skipped: int = 0,
    timeout_s: float | None = None,
    cancel: threading.Event | None = None,
) -> MigrationStats:
    """Send this prefill worker's share of a request's KV; returns once every send has completed.

    ``block_ids`` are this worker's block ids of the request, already trimmed of any prefix the
    receiver holds. Each destination first gets a 2-int header (block count, fingerprint of the
    layouts and chunking) so a disagreement is a ValueError on the receiver rather than a size
    mismatch inside the backend (gloo aborts the process). Messages (see ``messages``) are then
    packed and posted in plan order. Raises ``TransferTimeout`` if the sends have not completed
    within ``timeout_s`` seconds, ``TransferCancelled`` once ``cancel`` is set.
    """
    start = time.perf_counter()
    first_layer, first_head = _check_worker(kv_cache, layout_src, my_src_rank, "source")
    header_tag = _check_tags(tag_base, layout_src, layout_dst)
    idx = _block_index(block_ids, kv_cache.shape[2], kv_cache.device)
    n = idx.numel()
    stats = MigrationStats(num_blocks_sent=n, num_blocks_skipped=num_blocks_skipped)
    plan = reshard_plan(layout_src, layout_dst)
    mine = [(tag, s) for tag, s in messages(plan, n, layout_src, chunk_bytes) if s.src_rank == my_src_rank]
    header = torch.tensor([n, _fingerprint(layout_src, layout_dst, chunk_bytes)], dtype=torch.int64, device=transport.device)
    peers = dict.fromkeys(_to_global(dst_rank_to_global, s.dst_rank) for _, s in mine)
    waits = _Waits(transport, timeout_s, cancel)
    try:
        handles: list[Handle] = [waits.post(transport.isend(header, peer, header_tag)) for peer in peers]
        for position, (tag, s) in enumerate(mine if n else []):
            layers, heads = _local(s, first_layer, first_head)
            out = staging.get(position, s.shape(n, layout_src), kv_cache.dtype) if staging else None
            data = pack_blocks(kv_cache, idx, layers, heads, out)
            handles.append(waits.post(transport.isend(data, _to_global(dst_rank_to_global, s.dst_rank), tag_base + tag)))
            stats.num_bytes += data.nbytes
        for h in handles:
            waits.wait(h)
    except BaseException:
        waits.abandon(staging)
        raise
    stats.seconds = time.perf_counter() - start
    return stats


def recv_kv(
    transport: KVTransport,
    kv_cache: torch.Tensor,  # [local layers, 2, NB, BS, local kv heads, D]
    layout_src: KVLayout,
    layout_dst: KVLayout,
    my_dst_rank: int,
    block_ids: BlockIds,
    src_rank_to_global: RankMap,
    tag_base: int,
    *,
    staging: StagingBuffers | None = None,
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
    num_blocks_skipped: int = 0,
    timeout_s: float | None = None,
    cancel: threading.Event | None = None,
) -> MigrationStats:
    """Receive this decode worker's share of a request's KV into ``block_ids`` of its cache.

    Checks every source's header (ValueError if block counts, layouts or chunking disagree), then
    posts all receives and completes and scatters them in plan order, so unpacking one message
    overlaps the arrival of the next. Raises ``TransferTimeout`` if the KV has not all arrived
    within ``timeout_s`` seconds, ``TransferCancelled`` once ``cancel`` is set; then some blocks
    may hold partial data, so the caller must not use them as this request's KV.
    """
    start = time.perf_counter()
    first_layer, first_head = _check_worker(kv_cache, layout_dst, my_dst_rank, "destination")
    header_tag = _check_tags(tag_base, layout_src, layout_dst)
    idx = _block_index(block_ids, kv_cache.shape[2], kv_cache.device)
    n = idx.numel()
    stats = MigrationStats(num_blocks_sent=n, num_blocks_skipped=num_blocks_skipped)
    plan = reshard_plan(layout_src, layout_dst)
    mine = [(tag, s) for tag, s in messages(plan, n, layout_dst, chunk_bytes) if s.dst_rank == my_dst_rank]
    peers = list(dict.fromkeys(_to_global(src_rank_to_global, s.src_rank) for _, s in mine))
    waits = _Waits(transport, timeout_s, cancel)
    try:
        headers = [transport.irecv((2,), torch.int64, peer, header_tag) for peer in peers]
        for handle, _ in headers:
            waits.post(handle)
        fingerprint = _fingerprint(layout_src, layout_dst, chunk_bytes)
        for peer, (handle, header) in zip(peers, headers):
            waits.wait(handle)
            their_n, their_fingerprint = (int(x) for x in header.tolist())
            if their_fingerprint != fingerprint:
                raise ValueError(f"rank {peer} sends with different layouts or chunk_bytes than this receiver expects")
            if their_n != n:
                raise ValueError(f"block list length mismatch: rank {peer} sends {their_n} blocks, this receiver expects {n}")
        posted: list[tuple[TransferSlice, Handle, torch.Tensor]] = []
        for tag, s in mine if n else []:
            shape = s.shape(n, layout_dst)
            out = staging.get(len(posted), shape, kv_cache.dtype) if staging else None
            src = _to_global(src_rank_to_global, s.src_rank)
            handle, buf = transport.irecv(shape, kv_cache.dtype, src, tag_base + tag, out)
            posted.append((s, waits.post(handle), buf))
        for s, handle, buf in posted:
            waits.wait(handle)
            layers, heads = _local(s, first_layer, first_head)
            unpack_blocks(kv_cache, idx, layers, heads, buf)
            stats.num_bytes += buf.nbytes
    except BaseException:
        waits.abandon(staging)
        raise
    stats.seconds = time.perf_counter() - start
    return stats


# ---- prefix dedup ----------------------------------------------------------------------------
def blocks_to_send(src_block_hashes: Sequence[int], dst_has_hash: Callable[[int], bool]) -> int:
    """How many leading blocks of the request the receiver already holds (skip these).

    ``src_block_hashes`` are the chained content hashes of the request's *full* blocks (a partly
    filled last block has no hash, so it is always sent). Only a contiguous prefix counts: a held
    block after a missing one is sent anyway, since its hash chains through the missing block.
    """
    num_held = 0
    for h in src_block_hashes:
        if not dst_has_hash(h):
            break
        num_held += 1
    return num_held


def trim_block_lists(
    src_block_ids: Sequence[int], dst_block_ids: Sequence[int], num_skipped: int
) -> tuple[list[int], list[int]]:
    """Drop the ``num_skipped`` leading blocks the receiver holds from both sides' lists.

    ``dst_block_ids`` may cover the whole request (same length as ``src_block_ids``) or only the
    blocks to receive (``len(src_block_ids) - num_skipped``); anything else is a ValueError.
    """
    if not 0 <= num_skipped <= len(src_block_ids):
        raise ValueError(f"num_skipped={num_skipped} outside [0, {len(src_block_ids)}]")
    if len(dst_block_ids) == len(src_block_ids):
        return list(src_block_ids[num_skipped:]), list(dst_block_ids[num_skipped:])
    if len(dst_block_ids) == len(src_block_ids) - num_skipped:
        return list(src_block_ids[num_skipped:]), list(dst_block_ids)
    raise ValueError(
        f"block list length mismatch: {len(src_block_ids)} source blocks, {len(dst_block_ids)} destination "
        f"blocks, {num_skipped} skipped (destination must hold {len(src_block_ids)} or "
        f"{len(src_block_ids) - num_skipped})"
    )
