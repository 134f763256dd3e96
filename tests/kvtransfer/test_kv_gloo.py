"""Real migrations over torch.distributed (gloo) between processes: prefill tp1·pp2 → decode tp2·pp1, and timeouts."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distserve.kvtransfer import KVLayout, TorchDistTransport, init_process_group, recv_kv, send_kv, trim_block_lists
from distserve.kvtransfer.plan import num_tags
from distserve.kvtransfer.transport import TransferCancelled, TransferTimeout, join_rendezvous, new_kv_group, open_rendezvous
from distserve.ports import free_port

pytestmark = pytest.mark.integration  # spawns processes

SRC = KVLayout(num_layers=5, num_kv_heads=4, head_dim=8, block_size=4, tp=1, pp=2)
DST = KVLayout(num_layers=5, num_kv_heads=4, head_dim=8, block_size=4, tp=2, pp=1)
NUM_BLOCKS, NUM_SKIPPED, NB_SRC, NB_DST = 12, 3, 20, 16


def request(seed: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Global KV [L, 2, n, BS, H, D] and scattered block ids on both sides; identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn((SRC.num_layers, 2, NUM_BLOCKS, SRC.block_size, SRC.num_kv_heads, SRC.head_dim), generator=gen)
    src_ids = torch.randperm(NB_SRC, generator=gen)[:NUM_BLOCKS].tolist()
    dst_ids = torch.randperm(NB_DST, generator=gen)[:NUM_BLOCKS].tolist()
    return full, src_ids, dst_ids


def shard(full: torch.Tensor, lay: KVLayout, rank: int) -> torch.Tensor:
    tp_rank, pp_rank = lay.coords(rank)
    (l0, l1), (h0, h1) = lay.local_layers(pp_rank), lay.local_heads(tp_rank)
    return full[l0:l1, :, :, :, h0:h1]


def worker(rank: int, world_size: int, address: str) -> None:
    torch.set_num_threads(1)
    assert init_process_group(rank, world_size, None, backend="gloo", store=join_rendezvous(address, world_size)) == "gloo"
    transport = TorchDistTransport()
    src_to_global = list(range(SRC.world_size))
    dst_to_global = [SRC.world_size + r for r in range(DST.world_size)]
    for seed, skipped, chunk_bytes in [(0, 0, None), (1, NUM_SKIPPED, 512)]:  # second request: prefix held
        full, src_ids, dst_ids = request(seed)
        send_ids, recv_ids = trim_block_lists(src_ids, dst_ids, skipped)
        tag_base = 100 * seed
        if rank < SRC.world_size:
            cache = torch.zeros(SRC.local_shape(NB_SRC, *reversed(SRC.coords(rank))))
            cache[:, :, src_ids] = shard(full, SRC, rank)
            stats = send_kv(transport, cache, SRC, DST, rank, send_ids, dst_to_global, tag_base, chunk_bytes=chunk_bytes)
            assert stats.num_blocks_sent == NUM_BLOCKS - skipped
        else:
            local = rank - SRC.world_size
            cache = torch.full(DST.local_shape(NB_DST, *reversed(DST.coords(local))), -1.0)
            cache[:, :, dst_ids[:skipped]] = shard(full, DST, local)[:, :, :skipped]
            recv_kv(transport, cache, SRC, DST, local, recv_ids, src_to_global, tag_base, chunk_bytes=chunk_bytes)
            torch.testing.assert_close(cache[:, :, dst_ids], shard(full, DST, local), rtol=0, atol=0)
            others = [b for b in range(NB_DST) if b not in dst_ids]
            assert bool((cache[:, :, others] == -1.0).all())
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_gloo_migration_prefill_pp2_to_decode_tp2() -> None:
    world_size = SRC.world_size + DST.world_size
    address, _store = open_rendezvous(world_size, "127.0.0.1")  # (served from here, every rank a client)
    # Raises ProcessRaisedException if any worker fails an assertion.
    mp.start_processes(worker, args=(world_size, address), nprocs=world_size, join=True, start_method="spawn")


def timeout_worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, 2, f"tcp://127.0.0.1:{port}", backend="gloo")
    transport = TorchDistTransport(new_kv_group())
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=2, tp=1, pp=1)
    cache, ids, peer = torch.zeros(lay.local_shape(8, 0, 0)), [1, 2, 5], [1 - rank]
    # Each side waits for a peer that never comes (the tags differ): both give up in time.
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        if rank == 0:
            send_kv(transport, cache, lay, lay, 0, ids, peer, 0, timeout_s=1.0)
        else:
            recv_kv(transport, cache, lay, lay, 0, ids, peer, 1000, timeout_s=1.0)
    assert 1.0 <= time.monotonic() - start < 10 and transport.abandoned
    if rank == 0:  # cancelled while waiting
        cancel = threading.Event()
        threading.Timer(0.2, cancel.set).start()
        start = time.monotonic()
        with pytest.raises(TransferCancelled):
            send_kv(transport, cache, lay, lay, 0, ids, peer, 2000, timeout_s=60, cancel=cancel)
        assert time.monotonic() - start < 10
    dist.barrier()  # gloo's own timeout would have closed the group's connections; ours leaves them up
    full = torch.randn((lay.num_layers, 2, len(ids), lay.block_size, lay.num_kv_heads, lay.head_dim), generator=torch.Generator().manual_seed(0))
    if rank == 0:
        cache[:, :, ids] = full
        send_kv(transport, cache, lay, lay, 0, ids, peer, 3000, timeout_s=30)
    else:
        recv_kv(transport, cache, lay, lay, 0, ids, peer, 3000, timeout_s=30)
        torch.testing.assert_close(cache[:, :, ids], full, rtol=0, atol=0)
    # The given-up ops are still posted: late peers complete them into their kept buffers (and, in
    # this test, must — a waiter thread woken while the interpreter exits aborts the process).
    if rank == 0:
        transport.send(torch.zeros(2, dtype=torch.int64), 1, 1000 + num_tags(lay, lay) - 1)  # the stale header receive
    else:
        for tag_base in (0, 2000):
            recv_kv(transport, torch.zeros_like(cache), lay, lay, 0, ids, peer, tag_base, timeout_s=30)
    for handle in transport.abandoned:
        handle.wait(timeout_s=30)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_gloo_transfer_timeout_and_cancel_leave_the_pair_usable() -> None:
    mp.start_processes(timeout_worker, args=(free_port(),), nprocs=2, join=True, start_method="spawn")


def test_a_free_port_is_free_and_below_the_ephemeral_range() -> None:
    """``ports.free_port`` (rendezvous stores, servers started later): bindable, and outside the range the kernel draws outgoing connections'
    local ports from (where a port checked free is most likely taken before the store binds it)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
        low = int(f.read().split()[0])
    for _ in range(20):
        port = free_port()
        assert 10_000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def rank_of_a_world(rank: int, address: str, round_: int) -> None:
    """Rank 1 of a 2-rank world whose rank 0 is the test process (which holds the rendezvous)."""
    init_process_group(rank + 1, 2, None, backend="gloo", store=join_rendezvous(address, 2, timeout_s=60))
    t = torch.tensor([float(round_)])
    dist.all_reduce(t)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_rendezvous_binds_its_port_as_it_is_made_and_worlds_form_again_on_fresh_ones() -> None:
    """``open_rendezvous`` (the runtime's global rank 0, before each world forms): its port is bound by
    the time its address exists (no other listener can take it in between: a port found free and bound
    later could be), and a world forms on it with every rank passing its store; a second world (an
    instance restarted) forms on a fresh one."""
    for round_ in (1, 2):
        address, store = open_rendezvous(2, "127.0.0.1", timeout_s=60)
        port = int(address.rsplit(":", 1)[1])
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", port))
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=rank_of_a_world, args=(0, address, round_), daemon=True)
        proc.start()
        init_process_group(0, 2, None, backend="gloo", store=store, timeout_s=60)
        t = torch.tensor([float(round_)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        proc.join(timeout=60)
        assert proc.exitcode == 0 and t.item() == 2 * round_
    with pytest.raises(ValueError, match="tcp://host:port"):
        join_rendezvous("127.0.0.1:1234", 2)
