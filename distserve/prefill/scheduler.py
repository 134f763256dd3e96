"""PrefillScheduler: batches prompts under a token budget; finished prompts wait, KV held, for migration."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from distserve.config import SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.scheduler import Scheduler
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence, SequenceStatus


class PrefillScheduler(Scheduler):
    """The colocated scheduler minus decoding.

    After its first token a sequence leaves the running set and waits in ``awaiting_migration``
    holding its blocks: the prefill pool is the queue buffer between the phases. Its blocks are
    freed only by ``release`` (the decode side acknowledged the transfer) or ``finish``. When the
    pool is full, new prompts wait — backpressure instead of preemption of finished work — and a
    prompt of a backlogged admission rank waits while taking its blocks would leave less than its
    rank's reserve (``AdmissionRankOrder._leaves_room``).
    """

    clears_isolation = False  # a suspect's prefill proves nothing about its decoding
    forks_run_here = False  # ``n`` completions wait for migration, not in the batch: a prompt is one prefill
    phase = "prefill"

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), pipeline_depth: int = 1) -> None:
        super().__init__(config, block_manager, max_model_len, eos_token_ids, pipeline_depth)  # (mypyc: no *args to a native super)
        self.awaiting_migration: dict[str, Sequence] = {}

    def update_from_output(
        self, plan: StepPlan, sampled: Seq[SampledToken], seqs: dict[str, Sequence], now: float
    ) -> list[Sequence]:
        updated = super().update_from_output(plan, sampled, seqs, now)
        for seq in updated:
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
                self.awaiting_migration[seq.seq_id] = seq
        return updated

    def release(self, seq_id: str) -> Sequence | None:
        """The decode side holds the KV now: free the blocks (hashed ones stay as prefix cache)."""
        seq = self.awaiting_migration.pop(seq_id, None)
        if seq is not None:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "migrated"
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        self.awaiting_migration.pop(seq.seq_id, None)
        super().finish(seq, reason)

    def requeue(self, seq_id: str) -> Sequence | None:
        """Migration failed: drop the KV and prefill the request again (it keeps its first token)."""
        seq = self.awaiting_migration.pop(seq_id, None)
        if seq is not None:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            self._enqueue(seq)
        return seq

    def _fits(self, seq: Sequence) -> bool:
        """Blocks free for it, and a backlogged rank's reserve left for lower ranks (``_leaves_room``)."""
        return self.block_manager.can_allocate(seq) and self._leaves_room(seq)

    @property
    def num_awaiting_migration(self) -> int:
        return len(self.awaiting_migration)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.awaiting_migration)
