"""PrefillInstance: fills KV, samples the first token, and holds the KV until a decode instance pulls it."""

from __future__ import annotations

from distserve.engine.instance import Instance
from distserve.engine.sequence import Sequence
from distserve.prefill.scheduler import PrefillScheduler


class PrefillInstance(Instance):
    """``step`` returns every sequence that got its first token: finished ones (EOS, ``max_tokens=1``)
    are done; the others wait in ``scheduler.awaiting_migration`` until a decode instance pulls
    their KV (``kv_source``) and ``release`` frees it.
    """

    scheduler_class = PrefillScheduler
    scheduler: PrefillScheduler

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)

    def kv_source(self, seq_id: str) -> list[int]:
        """Block table holding the prompt KV of a sequence awaiting migration."""
        return list(self.scheduler.awaiting_migration[seq_id].block_table)

    def release(self, seq_id: str) -> None:
        self.scheduler.release(seq_id)
        self.seqs.pop(seq_id, None)

    def requeue(self, seq_id: str) -> None:
        self.scheduler.requeue(seq_id)

    def load(self) -> int:
        """Routing signal: prompt tokens queued or running here."""
        return sum(s.num_uncomputed_tokens for s in self.scheduler.waiting + self.scheduler.running)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "num_requests_awaiting_migration": self.scheduler.num_awaiting_migration}
