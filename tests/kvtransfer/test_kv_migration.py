"""Pack/unpack, transports, and whole migrations between every TP × PP pair, in one process with threads."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
import torch

from distserve.kvtransfer import (
    KV_TRANSPORTS,
    InProcessTransport,
    KVLayout,
    StagingBuffers,
    blocks_to_send,
    get_transport,
    pack_blocks,
    recv_kv,
    send_kv,
    trim_block_lists,
    unpack_blocks,
)
from distserve.kvtransfer.migration import messages
from distserve.kvtransfer.plan import num_tags, reshard_plan
from distserve.kvtransfer.transport import InProcessHub, TransferCancelled, TransferTimeout

SENTINEL = -7.0  # decode cache content that must survive outside the request's blocks


def make_layout(tp: int, pp: int, num_kv_heads: int = 4) -> KVLayout:
    return KVLayout(num_layers=5, num_kv_heads=num_kv_heads, head_dim=4, block_size=2, tp=tp, pp=pp)


def shard(full: torch.Tensor, lay: KVLayout, rank: int) -> torch.Tensor:
    """The part of a global [L, 2, n, BS, H, D] tensor that ``rank`` of ``lay`` owns."""
    tp_rank, pp_rank = lay.coords(rank)
    (l0, l1), (h0, h1) = lay.local_layers(pp_rank), lay.local_heads(tp_rank)
    return full[l0:l1, :, :, :, h0:h1]


def run_ranks(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        futures = [pool.submit(f) for f in fns]
        return [f.result(timeout=60) for f in futures]


def migrate_request(
    src: KVLayout, dst: KVLayout, num_blocks: int, num_skipped: int = 0, chunk_bytes: int | None = None, seed: int = 0
) -> None:
    """Migrate one request with scattered block ids and check every decode worker's cache."""
    gen = torch.Generator().manual_seed(seed)
    nb_src, nb_dst = num_blocks + 7, num_blocks + 11
    full = torch.randn((src.num_layers, 2, num_blocks, src.block_size, src.num_kv_heads, src.head_dim), generator=gen)
    src_ids = torch.randperm(nb_src, generator=gen)[:num_blocks].tolist()
    dst_ids = torch.randperm(nb_dst, generator=gen)[:num_blocks].tolist()
    src_caches = []
    for r in range(src.world_size):
        cache = torch.randn(src.local_shape(nb_src, *reversed(src.coords(r))), generator=gen)
        cache[:, :, src_ids] = shard(full, src, r)
        src_caches.append(cache)
    dst_caches = []
    for r in range(dst.world_size):
        cache = torch.full(dst.local_shape(nb_dst, *reversed(dst.coords(r))), SENTINEL)
        cache[:, :, dst_ids[:num_skipped]] = shard(full, dst, r)[:, :, :num_skipped]  # prefix already held
        dst_caches.append(cache)
    send_ids, recv_ids = trim_block_lists(src_ids, dst_ids, num_skipped)

    world = InProcessTransport.create_world(src.world_size + dst.world_size, timeout_s=30)
    src_to_global = list(range(src.world_size))
    dst_to_global = {r: src.world_size + r for r in range(dst.world_size)}
    tag_base = 1000
    senders = [
        partial(send_kv, world[r], src_caches[r], src, dst, r, send_ids, dst_to_global, tag_base,
                chunk_bytes=chunk_bytes, staging=StagingBuffers(), num_blocks_skipped=num_skipped)
        for r in range(src.world_size)
    ]
    receivers = [
        partial(recv_kv, world[dst_to_global[r]], dst_caches[r], src, dst, r, recv_ids, src_to_global, tag_base,
                chunk_bytes=chunk_bytes, num_blocks_skipped=num_skipped)
        for r in range(dst.world_size)
    ]
    stats = run_ranks([*senders, *receivers])

    # Assemble the global KV back from the decode workers and compare with the original.
    assembled = torch.full_like(full, float("nan"))
    for r, cache in enumerate(dst_caches):
        tp_rank, pp_rank = dst.coords(r)
        (l0, l1), (h0, h1) = dst.local_layers(pp_rank), dst.local_heads(tp_rank)
        assembled[l0:l1, :, :, :, h0:h1] = cache[:, :, dst_ids]
        untouched = [b for b in range(nb_dst) if b not in dst_ids]
        assert bool((cache[:, :, untouched] == SENTINEL).all()), f"dst rank {r} wrote outside its blocks"
    torch.testing.assert_close(assembled, full, rtol=0, atol=0)

    sent = sum(s.num_bytes for s in stats[: src.world_size])
    received = sum(s.num_bytes for s in stats[src.world_size :])
    expected = sum(s.nbytes(num_blocks - num_skipped, src) for s in reshard_plan(src, dst))
    assert sent == received == expected  # replicated decode heads are received once per replica
    if dst.num_kv_heads >= dst.tp:
        assert expected == (num_blocks - num_skipped) * src.block_nbytes()
    assert all(s.num_blocks_skipped == num_skipped for s in stats)


SPLITS = list(itertools.product([1, 2], [1, 2]))  # (tp, pp)


@pytest.mark.parametrize("chunk_bytes", [None, 64], ids=["one_msg_per_slice", "layer_chunks"])
@pytest.mark.parametrize("src_split", SPLITS, ids=lambda s: f"src_tp{s[0]}pp{s[1]}")
@pytest.mark.parametrize("dst_split", SPLITS, ids=lambda s: f"dst_tp{s[0]}pp{s[1]}")
def test_migration_every_tp_pp_pair(
    src_split: tuple[int, int], dst_split: tuple[int, int], chunk_bytes: int | None
) -> None:
    migrate_request(make_layout(*src_split), make_layout(*dst_split), num_blocks=9, chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("src_split,dst_split", [((1, 1), (2, 2)), ((2, 2), (1, 2)), ((2, 1), (1, 1))])
def test_migration_skips_prefix_the_receiver_holds(src_split: tuple[int, int], dst_split: tuple[int, int]) -> None:
    migrate_request(make_layout(*src_split), make_layout(*dst_split), num_blocks=9, num_skipped=4, seed=1)


def test_migration_everything_already_held_sends_nothing() -> None:
    migrate_request(make_layout(2, 1), make_layout(1, 2), num_blocks=5, num_skipped=5)


@pytest.mark.parametrize("src_split,dst_split", [((4, 1), (1, 2)), ((1, 1), (4, 2)), ((4, 2), (4, 1))])
def test_migration_with_replicated_heads(src_split: tuple[int, int], dst_split: tuple[int, int]) -> None:
    migrate_request(make_layout(*src_split, num_kv_heads=2), make_layout(*dst_split, num_kv_heads=2), num_blocks=6)


# ---- pack / unpack ---------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [(0, 4), (1, 3)])
def test_pack_unpack_roundtrip(heads: tuple[int, int]) -> None:
    cache = torch.randn(3, 2, 10, 2, 4, 5)  # [L, 2, NB, BS, H, D]
    ids = [7, 2, 9]
    packed = pack_blocks(cache, ids, (1, 3), heads)
    assert packed.is_contiguous() and packed.shape == (2, 2, 3, 2, heads[1] - heads[0], 5)
    torch.testing.assert_close(packed, cache[1:3, :, ids][..., heads[0] : heads[1], :])
    other = torch.zeros_like(cache)
    unpack_blocks(other, [0, 4, 5], (1, 3), heads, packed)
    torch.testing.assert_close(other[1:3, :, [0, 4, 5]][..., heads[0] : heads[1], :], packed)
    mask = torch.ones_like(other, dtype=torch.bool)
    mask[1:3, :, [0, 4, 5], :, heads[0] : heads[1]] = False
    assert bool((other[mask] == 0).all())


def test_pack_into_out_buffer_and_bad_input() -> None:
    cache = torch.randn(2, 2, 6, 2, 2, 3)
    out = torch.empty(2, 2, 2, 2, 2, 3)
    assert pack_blocks(cache, [1, 4], (0, 2), (0, 2), out=out) is out
    with pytest.raises(ValueError, match="block ids"):
        pack_blocks(cache, [1, 6], (0, 2), (0, 2))
    with pytest.raises(ValueError, match="duplicates"):
        pack_blocks(cache, [1, 1], (0, 2), (0, 2))
    with pytest.raises(ValueError, match="outside"):
        pack_blocks(cache, [1], (0, 3), (0, 2))
    with pytest.raises(ValueError, match="data is"):
        unpack_blocks(cache, [1, 2, 3], (0, 2), (0, 2), out)


# ---- validation ------------------------------------------------------------------------------
def test_send_kv_rejects_a_cache_that_does_not_match_its_layout() -> None:
    src, dst = make_layout(1, 1), make_layout(1, 1)
    [t0, _] = InProcessTransport.create_world(2)
    with pytest.raises(ValueError, match="layout expects"):
        send_kv(t0, torch.zeros(4, 2, 3, 2, 4, 4), src, dst, 0, [0], [1], 0)
    with pytest.raises(ValueError, match="different KV caches"):
        send_kv(t0, torch.zeros(src.local_shape(3, 0, 0)), src, make_layout(1, 1, num_kv_heads=2), 0, [0], [1], 0)
    with pytest.raises(ValueError, match="tags"):
        send_kv(t0, torch.zeros(src.local_shape(3, 0, 0)), src, dst, 0, [0], [1], -1)
    with pytest.raises(ValueError, match="global transport rank"):
        send_kv(t0, torch.zeros(src.local_shape(3, 0, 0)), src, dst, 0, [0], [], 0)


@pytest.mark.parametrize("num_recv_blocks", [2, 0])
def test_block_count_mismatch_between_sides_is_a_value_error(num_recv_blocks: int) -> None:
    lay = make_layout(1, 1)
    t0, t1 = InProcessTransport.create_world(2, timeout_s=10)
    send_kv(t0, torch.zeros(lay.local_shape(4, 0, 0)), lay, lay, 0, [0, 1, 2], [1], 0)
    with pytest.raises(ValueError, match="length mismatch: rank 0 sends 3 blocks"):
        recv_kv(t1, torch.zeros(lay.local_shape(4, 0, 0)), lay, lay, 0, list(range(num_recv_blocks)), [0], 0)


def test_chunking_mismatch_between_sides_is_a_value_error() -> None:
    lay = make_layout(1, 1)
    t0, t1 = InProcessTransport.create_world(2, timeout_s=10)
    send_kv(t0, torch.zeros(lay.local_shape(4, 0, 0)), lay, lay, 0, [0, 1], [1], 0, chunk_bytes=64)
    with pytest.raises(ValueError, match="chunk_bytes"):
        recv_kv(t1, torch.zeros(lay.local_shape(4, 0, 0)), lay, lay, 0, [2, 3], [0], 0, chunk_bytes=None)


@pytest.mark.timeout(30)
def test_a_side_whose_peer_never_comes_times_out_or_is_cancelled() -> None:
    lay = make_layout(1, 1)
    t0, t1 = InProcessTransport.create_world(2, timeout_s=60)
    staging = StagingBuffers()
    staging.get(0, (4,), torch.float32)
    start = time.monotonic()
    with pytest.raises(TransferTimeout):  # nobody sends
        recv_kv(t1, torch.zeros(lay.local_shape(4, 0, 0)), lay, lay, 0, [0, 1], [0], 0, staging=staging, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 5
    assert len(t1.abandoned) == 1 and staging.nbytes == 0  # the posted header receive is kept, staging dropped
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    with pytest.raises(TransferCancelled):
        recv_kv(t1, torch.zeros(lay.local_shape(4, 0, 0)), lay, lay, 0, [0, 1], [0], 100, timeout_s=30, cancel=cancel)
    with pytest.raises(TransferCancelled):  # already cancelled: nothing is posted
        send_kv(t0, torch.zeros(lay.local_shape(4, 0, 0)), lay, lay, 0, [0, 1], [1], 200, cancel=cancel)
    with pytest.raises(ValueError, match="timeout_s"):
        send_kv(t0, torch.zeros(lay.local_shape(4, 0, 0)), lay, lay, 0, [0, 1], [1], 200, timeout_s=0)


def test_trim_block_lists() -> None:
    assert trim_block_lists([1, 2, 3], [4, 5, 6], 1) == ([2, 3], [5, 6])
    assert trim_block_lists([1, 2, 3], [5, 6], 1) == ([2, 3], [5, 6])
    assert trim_block_lists([1, 2, 3], [4, 5, 6], 0) == ([1, 2, 3], [4, 5, 6])
    with pytest.raises(ValueError, match="length mismatch"):
        trim_block_lists([1, 2, 3], [4, 5], 0)
    with pytest.raises(ValueError):
        trim_block_lists([1, 2, 3], [4, 5, 6], 4)


def test_blocks_to_send_counts_only_a_contiguous_held_prefix() -> None:
    held = {10, 11, 13}
    assert blocks_to_send([10, 11, 12, 13], held.__contains__) == 2
    assert blocks_to_send([12, 10], held.__contains__) == 0
    assert blocks_to_send([10, 11], held.__contains__) == 2
    assert blocks_to_send([], held.__contains__) == 0


def test_messages_chunk_big_slices_along_layers_with_unique_tags() -> None:
    src, dst = make_layout(1, 1), make_layout(2, 2)
    plan = reshard_plan(src, dst)
    assert [s for _, s in messages(plan, 9, src, None)] == plan
    chunked = messages(plan, 9, src, 64)
    tags = [t for t, _ in chunked]
    assert len(chunked) > len(plan) and len(set(tags)) == len(tags) and max(tags) < num_tags(src, dst)
    for s in plan:  # the pieces of a slice tile its layers
        pieces = [p for _, p in chunked if (p.src_rank, p.dst_rank, p.kv_heads) == (s.src_rank, s.dst_rank, s.kv_heads)]
        assert pieces[0].layers[0] == s.layers[0] and pieces[-1].layers[1] == s.layers[1]
        assert all(a.layers[1] == b.layers[0] for a, b in zip(pieces, pieces[1:]))


# ---- transports ------------------------------------------------------------------------------
def test_inprocess_transport_copies_and_matches_tags() -> None:
    a, b = InProcessTransport.create_world(2, timeout_s=5)
    x = torch.arange(6.0)
    a.send(x, dst=1, tag=2)
    a.send(x * 10, dst=1, tag=1)
    x.zero_()  # the receiver must not see the sender's later writes
    assert b.recv((6,), torch.float32, src=0, tag=1).tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    handle, y = b.irecv((6,), torch.float32, src=0, tag=2)
    handle.wait()
    assert y.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError):
        a.send(x, dst=2, tag=0)
    with pytest.raises(TimeoutError):
        InProcessTransport.create_world(2, timeout_s=0.05)[1].recv((1,), torch.float32, src=0, tag=0)


def test_inprocess_transport_across_threads() -> None:
    world = InProcessTransport.create_world(3, timeout_s=10)

    def ring(rank: int) -> float:
        world[rank].isend(torch.full((4,), float(rank)), dst=(rank + 1) % 3, tag=5).wait()
        return float(world[rank].recv((4,), torch.float32, src=(rank - 1) % 3, tag=5).sum())

    assert run_ranks([partial(ring, r) for r in range(3)]) == [8.0, 0.0, 4.0]


def test_transport_registry() -> None:
    assert set(KV_TRANSPORTS) == {"inprocess", "torch"}
    t = get_transport("inprocess", hub=InProcessHub(2), rank=1)
    assert isinstance(t, InProcessTransport) and t.rank == 1
    with pytest.raises(ValueError, match="unknown KV transport"):
        get_transport("carrier-pigeon")
