"""Crash attribution: which requests a failed step is blamed on, when a request is poison, and
what an instance's restart budget is charged.

A failed step (an exception, or its instance's process dying) is blamed on the requests it was
computing: exactly its plan's requests when the step raised (``StepFailedError.seq_ids``). When
the process died outright nothing says what it computed; if it held suspects waiting for their
step alone, the oldest of them was computing (schedulers run them first, oldest first; the Ray
runtime steps an instance only once the suspects it sent have arrived), else
every request it held is blamed. Each suspect's crash count goes up and its next step runs alone
(``Sequence.isolate``), so that a second failure is its own rather than its batch mates'. A request blamed for
``MAX_CRASHES_PER_REQUEST`` failures is poison: it fails with a clear error instead of being
re-run on the next replacement, and the restarts its failures caused are not charged to the
instance's restart budget (a poison request must not use up the restarts that real faults need).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from distserve.engine.sequence import Sequence
from distserve.errors import StepFailedError

MAX_CRASHES_PER_REQUEST = 2


def suspects_of(
    failure: BaseException | None, held: Iterable[str], isolated: Mapping[str, float] | None = None
) -> list[str]:
    """The requests among ``held`` (an instance's) that ``failure`` is blamed on.

    ``isolated`` maps the instance's suspects that have not had their step alone yet to their
    arrival times (``solo_order``).
    """
    held_ids = list(held)
    if isinstance(failure, StepFailedError):
        named = set(failure.seq_ids)
        return [s for s in held_ids if s in named]
    if isolated:
        waiting_alone = [s for s in held_ids if s in isolated]
        if waiting_alone:
            return [min(waiting_alone, key=lambda s: (isolated[s], s))]  # as solo_order
    return held_ids


def solo_order(seq: Sequence) -> tuple[float, str]:
    """The order in which schedulers give suspects their steps alone: oldest arrival first."""
    return (seq.arrival_time, seq.seq_id)


def blame(suspects: Iterable[Sequence]) -> list[Sequence]:
    """Count one failed step against each suspect; return the ones now poison (the rest are isolated)."""
    convicted: list[Sequence] = []
    for seq in suspects:
        seq.num_crashes += 1
        if seq.num_crashes >= MAX_CRASHES_PER_REQUEST:
            convicted.append(seq)
        else:
            seq.isolate = True
    return convicted


def poison_message(seq: Sequence) -> str:
    return f"the request failed: the engine failed {seq.num_crashes} times while computing it; it is not retried"


@dataclass
class Crash:
    """One instance death; ``charged`` while it counts against that instance's restart budget."""

    instance_id: str
    charged: bool


@dataclass
class CrashLedger:
    """The deaths each suspect request was blamed for, so that a poison request's are refunded."""

    by_request: dict[str, list[Crash]] = field(default_factory=dict)

    def record(self, instance_id: str, suspects: Iterable[Sequence], convicted: list[Sequence], live: set[str]) -> list[str]:
        """Book a death of ``instance_id`` blamed on ``suspects``; returns the instance ids whose
        earlier restarts are refunded (one entry per refund). The death itself is charged unless it
        convicted someone; ``live`` (requests still in flight) bounds what the ledger remembers."""
        crash = Crash(instance_id, charged=not convicted)
        for seq in suspects:
            self.by_request.setdefault(seq.seq_id, []).append(crash)
        refunds: list[str] = []
        for seq in convicted:
            for earlier in self.by_request.pop(seq.seq_id, []):
                if earlier.charged:
                    earlier.charged = False
                    refunds.append(earlier.instance_id)
        for seq_id in [s for s in self.by_request if s not in live]:
            del self.by_request[seq_id]
        return refunds
