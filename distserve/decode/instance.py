"""DecodeInstance: admits migrated KV only when it has room for it, then decodes by continuous batching."""

from __future__ import annotations

from distserve.decode.scheduler import DecodeScheduler, Reservation
from distserve.engine.instance import Instance
from distserve.engine.sequence import Sequence


class DecodeInstance(Instance):
    scheduler_class = DecodeScheduler
    scheduler: DecodeScheduler

    def reserve(self, seq: Sequence) -> Reservation | None:
        """Room for ``seq``'s KV (prompt + first token), or None: it keeps waiting on the prefill side."""
        reservation = self.scheduler.reserve(seq)
        if reservation is not None:
            self.seqs[seq.seq_id] = seq
        return reservation

    def complete(self, seq_id: str) -> None:
        self.scheduler.complete(seq_id)

    def cancel(self, seq_id: str) -> None:
        self.scheduler.cancel(seq_id)
        self.seqs.pop(seq_id, None)

    def free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "num_requests_migrating": len(self.scheduler.migrating)}
