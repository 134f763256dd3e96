"""One rank of an instance: its model shard, its KV-cache shard, and its side of KV transfers.

Ray-free; the runtime hosts rank 0 inside the instance actor and the other ranks as worker
actors. Transfers run on a background thread so a step and a migration overlap; the step loop
collects finished transfers with ``poll``.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distserve.engine.model_runner import ModelRunner
from distserve.engine.parallel import ShardSpec, build_parallel_state
from distserve.engine.scheduler import SampledToken, StepPlan
from distserve.engine.weights import load_model
from distserve.kvtransfer.layout import KVLayout
from distserve.kvtransfer.migration import MigrationStats, StagingBuffers, recv_kv, send_kv
from distserve.kvtransfer.transport import TorchDistTransport, init_process_group


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


@dataclass
class TransferResult:
    key: str
    ok: bool
    error: str = ""
    stats: MigrationStats | None = None


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.runner: ModelRunner | None = None
        self.transport: TorchDistTransport | None = None
        self.layout: KVLayout | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-transfer")
        self._transfers: dict[str, Future[MigrationStats]] = {}
        self._staging = StagingBuffers()

    @property
    def global_rank(self) -> int:
        return self.spec.instance_ranks[self.spec.shard.rank]

    def init(self, init_method: str, world_size: int) -> str:
        """Join the runtime's torch.distributed world, build the TP group, load the model shard."""
        spec = self.spec
        torch.set_num_threads(spec.num_threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(spec.num_threads))
        backend = init_process_group(self.global_rank, world_size, init_method)
        parallel = build_parallel_state(spec.shard, spec.instance_ranks)
        loaded = load_model(spec.model, spec.dtype)
        self.runner = ModelRunner(
            loaded.config, loaded.state_dict, spec.num_blocks, spec.block_size, spec.eos_token_ids, parallel=parallel
        )
        cfg = loaded.config
        self.layout = KVLayout(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, spec.block_size, spec.shard.tp, spec.shard.pp, cfg.dtype
        )
        self.transport = TorchDistTransport()
        return backend

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        assert self.runner is not None, "init() first"
        return self.runner.execute(plan)

    # ---- KV transfers ------------------------------------------------------------------------
    def start_send(
        self, key: str, block_ids: list[int], dst_layout: KVLayout, dst_ranks: list[int], tag_base: int, skipped: int
    ) -> None:
        assert self.runner is not None and self.transport is not None and self.layout is not None
        self._transfers[key] = self._pool.submit(
            send_kv, self.transport, self.runner.kv_cache, self.layout, dst_layout, self.spec.shard.rank,
            block_ids, dst_ranks, tag_base, staging=self._staging, num_blocks_skipped=skipped,
        )

    def start_recv(
        self, key: str, block_ids: list[int], src_layout: KVLayout, src_ranks: list[int], tag_base: int, skipped: int
    ) -> None:
        assert self.runner is not None and self.transport is not None and self.layout is not None
        self._transfers[key] = self._pool.submit(
            recv_kv, self.transport, self.runner.kv_cache, src_layout, self.layout, self.spec.shard.rank,
            block_ids, src_ranks, tag_base, staging=self._staging, num_blocks_skipped=skipped,
        )

    def poll(self) -> list[TransferResult]:
        """Transfers that finished since the last poll."""
        done: list[TransferResult] = []
        for key, fut in list(self._transfers.items()):
            if not fut.done():
                continue
            del self._transfers[key]
            exc = fut.exception()
            done.append(TransferResult(key, exc is None, repr(exc) if exc else "", None if exc else fut.result()))
        return done

    def num_pending_transfers(self) -> int:
        return len(self._transfers)

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if dist.is_initialized():
            dist.destroy_process_group()
