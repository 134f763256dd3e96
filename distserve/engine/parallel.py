"""How one worker talks to its peers inside its instance.

``ShardSpec`` (``distserve.engine.shard``) is where it sits: pure data. ``ParallelState``
adds the torch.distributed handles: the TP group for all-reduces and the neighbouring pipeline
stages for activations. With ``tp == pp == 1`` nothing is communicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distserve.engine.shard import ShardSpec


@dataclass
class ParallelState:
    """A ``ShardSpec`` plus the process-group handles a worker uses during a step."""

    shard: ShardSpec
    tp_group: Any = None  # torch.distributed group of this stage's TP ranks (None when tp == 1)
    prev_stage_rank: int | None = None  # global rank of the same TP rank in the previous stage
    next_stage_rank: int | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def send_to_next_stage(self, x: torch.Tensor) -> None:
        assert self.next_stage_rank is not None
        dist.send(x.contiguous(), self.next_stage_rank)

    def recv_from_prev_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self.prev_stage_rank is not None
        buf = torch.empty(shape, dtype=dtype)
        dist.recv(buf, self.prev_stage_rank)
        return buf


def build_parallel_state(shard: ShardSpec, instance_ranks: list[int]) -> ParallelState:
    """Create this worker's TP group and find its pipeline neighbours.

    ``instance_ranks[r]`` is the global torch.distributed rank of instance-local rank ``r``. Only
    the members of a group take part in creating it, so instances can be set up independently.
    """
    if len(instance_ranks) != shard.tp * shard.pp:
        raise ValueError(f"expected {shard.tp * shard.pp} ranks for tp={shard.tp} pp={shard.pp}, got {len(instance_ranks)}")
    group = None
    if shard.tp > 1:
        stage = [instance_ranks[shard.pp_rank * shard.tp + t] for t in range(shard.tp)]
        group = dist.new_group(stage, use_local_synchronization=True)

    def peer(pp_rank: int) -> int | None:
        if not 0 <= pp_rank < shard.pp:
            return None
        return instance_ranks[pp_rank * shard.tp + shard.tp_rank]

    return ParallelState(shard, group, peer(shard.pp_rank - 1), peer(shard.pp_rank + 1))
