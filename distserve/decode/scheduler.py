"""DecodeScheduler: admits migrating requests only when it has blocks for them, then decodes them.

Pull-based: the decode instance asks ``reserve`` for room before any byte moves. Blocks whose
content hash it already holds are shared, not transferred (prefix-aware migration).
"""

from __future__ import annotations

from dataclasses import dataclass

from distserve.config import SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.scheduler import Scheduler
from distserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class Reservation:
    """Where a migrating request's KV goes: ``block_table[num_reused_blocks:num_blocks_to_fill]``.

    The sender's blocks with the same indices are the ones to transfer.
    """

    seq_id: str
    block_table: list[int]
    num_reused_blocks: int  # leading blocks already held here (shared by content hash)
    num_blocks_to_fill: int  # blocks covering the prompt's KV

    @property
    def num_blocks_to_transfer(self) -> int:
        return self.num_blocks_to_fill - self.num_reused_blocks


class DecodeScheduler(Scheduler):
    """The colocated scheduler whose sequences arrive with their prompt KV already computed.

    A preempted sequence is recomputed here (a local prefill of prompt + generated tokens), so a
    decode instance never has to send work back.
    """

    phase = "decode"

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), pipeline_depth: int = 1) -> None:
        super().__init__(config, block_manager, max_model_len, eos_token_ids, pipeline_depth)  # (mypyc: no *args to a native super)
        self.migrating: dict[str, Sequence] = {}
        self.num_held_reservations = 0  # reserve calls answered "wait for the shared prefix in flight"

    def can_reserve(self, seq: Sequence) -> bool:
        return len(self.running) + len(self.migrating) < self.max_running and self.block_manager.can_allocate(seq)

    def reserve(self, seq: Sequence) -> Reservation | None:
        """Allocate blocks for a sequence whose ``token_ids`` are prompt + first token; None if no room,
        or while most of its prompt is arriving here for another request right now (``_held``, as
        prefill admission does): it reserves once that KV is committed, takes the shared blocks from
        the prefix cache and receives only the rest — the shared prompt lands once, where cascade
        attention reads it once for all."""
        if not self.can_reserve(seq):
            return None
        if self.config.enable_inflight_prefix_sharing and self._held(seq):
            self.num_held_reservations += 1
            return None
        self._stamp(seq)
        self.block_manager.allocate(seq)
        seq.status = SequenceStatus.WAITING
        self.migrating[seq.seq_id] = seq
        bm = self.block_manager
        return Reservation(
            seq.seq_id, list(seq.block_table), seq.num_cached_tokens // bm.block_size, bm.num_blocks_for(seq.num_tokens - 1)
        )

    def complete(self, seq_id: str) -> Sequence | None:
        """The KV arrived: the sequence decodes from the next step on."""
        seq = self.migrating.pop(seq_id, None)
        if seq is None:
            return None
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.commit(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.isolate:
            self.isolated.append(seq)  # a crash suspect: its first decode step runs alone
        else:
            self._append_running(seq)
        return seq

    def cancel(self, seq_id: str) -> Sequence | None:
        """The transfer failed or was aborted: give the blocks back."""
        seq = self.migrating.pop(seq_id, None)
        if seq is not None:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        if self.migrating.pop(seq.seq_id, None) is not None:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            self._finished_since_plan.append(seq.seq_id)
            return
        super().finish(seq, reason)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.migrating)
