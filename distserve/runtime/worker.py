"""One rank of an instance: its model shard, its KV-cache shard, and its side of KV transfers.

Ray-free; the runtime hosts rank 0 inside the instance actor and the other ranks as worker
actors. The model is loaded and every step runs on one compute thread (whichever thread of a
threaded actor a call arrives on; see ``engine.compute_thread``). Transfers run on a background
thread so a step and a migration overlap; the step loop
collects finished transfers with ``poll``. A transfer gives up after ``kv_transfer_timeout_s``
(or when ``cancel_transfer`` is called), so the thread is never stuck on a lost peer.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch.distributed as dist

from distserve.engine.compute_thread import compute_executor
from distserve.engine.model_runner import LayerPass, ModelRunner
from distserve.engine.parallel import build_parallel_state
from distserve.engine.shard import ShardSpec
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.weights import load_weights
from distserve.kvtransfer.layout import KVLayout
from distserve.kvtransfer.migration import MigrationStats, StagingBuffers, recv_kv, send_kv
from distserve.kvtransfer.transport import (
    TorchDistTransport, TransferTimeout, init_process_group, join_rendezvous, new_kv_group, open_rendezvous,
)

# Test hooks (``Worker.inject_transfer_fault``): the next send is silently dropped (its receiver
# times out), or the next receive raises before posting anything (its sender is left waiting).
TRANSFER_FAULTS = ("drop_send", "fail_recv")
# Chaos testing of a whole server (``experiments/chaos.py``): ``DISTSERVE_TRANSFER_FAULTS=drop_send:5`` makes
# every 5th send of each worker a dropped one (``kind:period``, comma-separated), from its start. Unset: none.
TRANSFER_FAULTS_ENV = "DISTSERVE_TRANSFER_FAULTS"


def periodic_transfer_faults(value: str | None) -> dict[str, int]:
    """``TRANSFER_FAULTS_ENV``'s value as {fault kind: every how many transfers of that kind}."""
    out: dict[str, int] = {}
    for part in (value or "").split(","):
        if not part.strip():
            continue
        kind, _, period = part.strip().partition(":")
        if kind not in TRANSFER_FAULTS or not period.isdigit() or int(period) < 1:
            raise ValueError(f"{TRANSFER_FAULTS_ENV}: expected kind:period with kind one of {TRANSFER_FAULTS} and period >= 1, got {part!r}")
        out[kind] = int(period)
    return out


@dataclass
class WorkerSpec:
    """Everything a rank needs to build itself; plain data so it crosses process boundaries."""

    model: str
    dtype: str
    num_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    shard: ShardSpec
    instance_ranks: list[int]  # global rank of each instance-local rank
    num_threads: int = 1
    kv_transfer_timeout_s: float = 30.0  # one side of one transfer, from when this worker starts it
    decode_attention: str | None = None  # a kernels.backends name; None: the device's default
    instance_id: str = ""  # of the instance this rank belongs to (names the actor in logs)


@dataclass
class TransferResult:
    key: str
    ok: bool
    error: str = ""
    stats: MigrationStats | None = None
    timed_out: bool = False


class Worker:
    def __repr__(self) -> str:
        """Ray names the actor's process by it in its logs (``:actor_name:``): which instance and rank it is."""
        shard = self.spec.shard
        return f"Worker({self.spec.instance_id} rank {shard.pp_rank * shard.tp + shard.tp_rank})"

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.runner: ModelRunner | None = None
        self.transport: TorchDistTransport | None = None
        self.layout: KVLayout | None = None
        self._compute = compute_executor(spec.num_threads, "compute")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-transfer")
        self._transfers: dict[str, Future[MigrationStats]] = {}
        self._cancels: dict[str, threading.Event] = {}
        self._staging = StagingBuffers()  # cleared by a failed transfer: its buffers may still be in use
        self._fault: str | None = None
        self._periodic_faults = periodic_transfer_faults(os.environ.get(TRANSFER_FAULTS_ENV))
        self._transfers_seen = dict.fromkeys(TRANSFER_FAULTS, 0)  # by kind: transfers started (periodic faults count them)
        self._old_transports: list[TorchDistTransport] = []  # of earlier worlds (``reinit``)
        self._rendezvous: dist.TCPStore | None = None  # global rank 0: the store of the world being formed
        self._store: dist.TCPStore | None = None  # the store of the world joined (global rank 0's serves it)
        # Plans carry a per-instance sequence number; ``execute`` runs them in that order.
        self._next_plan_seq = 0
        self._plan_turn = threading.Condition()

    @property
    def global_rank(self) -> int:
        return self.spec.instance_ranks[self.spec.shard.rank]

    def open_rendezvous(self, world_size: int, loopback: bool) -> str:
        """Global rank 0, before a world forms (``init`` or ``reinit``): bind its store, return its address
        (``transport.open_rendezvous``; on 127.0.0.1 when every rank runs on this node)."""
        assert self.global_rank == 0, "global rank 0 hosts the rendezvous"
        import ray

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        address, self._rendezvous = open_rendezvous(world_size, host)
        return address

    def _join(self, address: str, world_size: int) -> str:
        """Join the world whose rendezvous is at ``address``: the default process group; returns the backend."""
        if self.global_rank == 0:
            assert self._rendezvous is not None, "open_rendezvous first"
            store, self._rendezvous = self._rendezvous, None
        else:
            store = join_rendezvous(address, world_size)
        self._store = store
        return init_process_group(self.global_rank, world_size, None, store=store)

    def init(self, init_method: str, world_size: int) -> str:
        """Join the runtime's torch.distributed world (its rendezvous at ``init_method``: global rank 0's
        ``open_rendezvous``), build the TP group, load the model shard."""
        spec = self.spec
        os.environ.setdefault("OMP_NUM_THREADS", str(spec.num_threads))
        backend = self._join(init_method, world_size)
        kv_group = new_kv_group()  # first: a collective of every rank, before the TP groups
        parallel = build_parallel_state(spec.shard, spec.instance_ranks)

        def build() -> ModelRunner:
            config, state_dict = load_weights(spec.model, spec.dtype)  # (a rank needs no tokenizer)
            return ModelRunner(
                config, state_dict, spec.num_blocks, spec.block_size, spec.eos_token_ids, parallel=parallel,
                decode_attention=spec.decode_attention,
            )

        self.runner = self._compute.submit(build).result()
        cfg = self.runner.config
        self.layout = KVLayout(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, spec.block_size, spec.shard.tp, spec.shard.pp, cfg.dtype
        )
        self.transport = TorchDistTransport(kv_group)
        return backend

    def reinit(self, init_method: str, world_size: int) -> str:
        """Join a new torch.distributed world (after an instance of the old one was restarted).

        The caller guarantees that no step executes and that every transfer of this worker has
        finished (``transfers_done``). The model shard and its KV cache stay: only the process
        groups are rebuilt, in place, so requests running here carry on. Transports of the old
        world are kept alive, with the ops they abandoned (see ``KVTransport.abandon``).
        """
        assert self.runner is not None and self.transport is not None, "init() first"
        spec = self.spec
        if dist.is_initialized():
            dist.destroy_process_group()
        backend = self._join(init_method, world_size)  # (the old world's store let go)
        kv_group = new_kv_group()
        fresh = build_parallel_state(spec.shard, spec.instance_ranks)
        parallel = self.runner.parallel  # the model holds its bound ``all_reduce``: update in place
        parallel.tp_group, parallel.prev_stage_rank, parallel.next_stage_rank = (
            fresh.tp_group, fresh.prev_stage_rank, fresh.next_stage_rank
        )
        self._old_transports.append(self.transport)
        self.transport = TorchDistTransport(kv_group)
        self._staging = StagingBuffers()  # the old buffers may be held by abandoned ops
        return backend

    def transfers_done(self) -> bool:
        """Every transfer started here has finished (its result may still wait for ``poll``)."""
        return all(fut.done() for fut in self._transfers.values())

    def cancel_all_transfers(self) -> None:
        for cancel in self._cancels.values():
            cancel.set()

    def execute(self, plan: StepPlan, plan_seq: int | None = None) -> list[SampledToken]:
        """Run this rank's part of ``plan``; the sampled tokens if this rank samples, else [].

        With ``plan_seq`` (0, 1, 2, ... per instance) plans run strictly in that order, one at a
        time, even when their calls arrive concurrently or out of order (a threaded actor): every
        stage, and every TP rank of a stage, must take the micro-batches in the same order or the
        activations and all-reduces of different plans would pair up.
        """
        assert self.runner is not None, "init() first"
        if plan_seq is None:
            return self._compute.submit(self.runner.execute, plan).result()
        with self._plan_turn:
            self._plan_turn.wait_for(lambda: self._next_plan_seq == plan_seq)
        try:
            return self._compute.submit(self.runner.execute, plan).result()
        finally:
            with self._plan_turn:
                self._next_plan_seq += 1  # also after a failure, so later plans are not stuck behind it
                self._plan_turn.notify_all()

    def begin(self, plan: StepPlan) -> LayerPass:
        """Start ``plan`` to run a layer at a time (``run_layers``): one worker only (tp = pp = 1)."""
        assert self.runner is not None, "init() first"
        return self._compute.submit(self.runner.begin, plan).result()

    def run_layers(self, p: LayerPass, should_yield: Callable[[], bool] | None) -> list[SampledToken] | None:
        """``ModelRunner.run`` on the compute thread: the rest of ``p``'s layers, or None if it yielded."""
        assert self.runner is not None, "init() first"
        return self._compute.submit(self.runner.run, p, should_yield).result()

    # ---- KV transfers ------------------------------------------------------------------------
    def start_send(
        self, key: str, block_ids: list[int], dst_layout: KVLayout, dst_ranks: list[int], tag_base: int, skipped: int
    ) -> None:
        assert self.runner is not None and self.transport is not None and self.layout is not None
        cancel = self._cancels[key] = threading.Event()
        if self._take_fault("drop_send"):
            self._transfers[key] = self._pool.submit(MigrationStats)  # "sent", but nothing was posted
            return
        self._transfers[key] = self._pool.submit(self._send, block_ids, dst_layout, dst_ranks, tag_base, skipped, cancel)

    def start_recv(
        self, key: str, block_ids: list[int], src_layout: KVLayout, src_ranks: list[int], tag_base: int, skipped: int
    ) -> None:
        assert self.runner is not None and self.transport is not None and self.layout is not None
        cancel = self._cancels[key] = threading.Event()
        if self._take_fault("fail_recv"):
            self._transfers[key] = self._pool.submit(_raise, RuntimeError("injected fault: fail_recv"))
            return
        self._transfers[key] = self._pool.submit(self._recv, block_ids, src_layout, src_ranks, tag_base, skipped, cancel)

    def _send(
        self, block_ids: list[int], dst_layout: KVLayout, dst_ranks: list[int], tag_base: int, skipped: int,
        cancel: threading.Event,
    ) -> MigrationStats:
        assert self.runner is not None and self.transport is not None and self.layout is not None
        return send_kv(
            self.transport, self.runner.kv_cache, self.layout, dst_layout, self.spec.shard.rank, block_ids, dst_ranks,
            tag_base, staging=self._staging, num_blocks_skipped=skipped, timeout_s=self.spec.kv_transfer_timeout_s,
            cancel=cancel,
        )

    def _recv(
        self, block_ids: list[int], src_layout: KVLayout, src_ranks: list[int], tag_base: int, skipped: int,
        cancel: threading.Event,
    ) -> MigrationStats:
        assert self.runner is not None and self.transport is not None and self.layout is not None
        return recv_kv(
            self.transport, self.runner.kv_cache, src_layout, self.layout, self.spec.shard.rank, block_ids, src_ranks,
            tag_base, staging=self._staging, num_blocks_skipped=skipped, timeout_s=self.spec.kv_transfer_timeout_s,
            cancel=cancel,
        )

    def cancel_transfer(self, key: str) -> None:
        """Give up on a transfer that is queued or waiting for its peer (it then fails)."""
        cancel = self._cancels.get(key)
        if cancel is not None:
            cancel.set()

    def inject_transfer_fault(self, kind: str) -> None:
        """Test hook: make this worker's next transfer of the kind fail (one-shot; off by default).

        ``drop_send``: the next ``start_send`` posts nothing yet reports success, as if its messages
        were lost, so the receiver times out. ``fail_recv``: the next ``start_recv`` raises before
        posting anything, so the sender is left waiting.
        """
        if kind not in TRANSFER_FAULTS:
            raise ValueError(f"unknown transfer fault {kind!r}; choose one of {TRANSFER_FAULTS}")
        self._fault = kind

    def _take_fault(self, kind: str) -> bool:
        """Whether this transfer of ``kind`` fails: the injected one-shot fault, or every n-th (``TRANSFER_FAULTS_ENV``)."""
        self._transfers_seen[kind] += 1
        period = self._periodic_faults.get(kind)
        if period is not None and self._transfers_seen[kind] % period == 0:
            return True
        if self._fault != kind:
            return False
        self._fault = None
        return True

    def poll(self) -> list[TransferResult]:
        """Transfers that finished since the last poll."""
        done: list[TransferResult] = []
        for key, fut in list(self._transfers.items()):
            if not fut.done():
                continue
            del self._transfers[key]
            self._cancels.pop(key, None)
            exc = fut.exception()
            if exc is None:
                done.append(TransferResult(key, True, stats=fut.result()))
            else:
                done.append(TransferResult(key, False, repr(exc), timed_out=isinstance(exc, TransferTimeout)))
        return done

    def num_pending_transfers(self) -> int:
        return len(self._transfers)

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        for cancel in self._cancels.values():
            cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._compute.shutdown(wait=False, cancel_futures=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def _raise(exc: BaseException) -> MigrationStats:
    raise exc
