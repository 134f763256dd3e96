"""What a simulation records of each request, and when a run may stop (a mixin of ``Simulation``).

A request's record gets its first token's time as it comes (for a request that goes on decoding:
``stop_when.first_token`` may decide the run's verdict then) and the rest as it finishes (its
output, its preemptions; ``stop_when`` sees every finish, in time order). A fast-forward jump that
finishes requests queues their records for the instant they finish, and never runs past the finish
that could end the run (``finishes_left``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from mypy_extensions import mypyc_attr

from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import SampledToken
from simulator.sim_events import STEP_DONE

if TYPE_CHECKING:
    from simulator.metrics import RequestRecord
    from simulator.sim_instance import SimInstance


@mypyc_attr(allow_interpreted_subclasses=True)
class SimRecords:
    """``Simulation``'s records and early stop: the attributes below are ``Simulation``'s."""

    records: dict[str, RequestRecord]
    _sampled: dict[str, SampledToken]
    _events: list[tuple[float, int, int, object]]
    _seq_no: itertools.count[int]
    _stop: bool
    _stop_when: Callable[[RequestRecord], bool] | None
    _finishes_to_decide: Callable[[], int] | None
    _finishes_ahead: int

    def _record_first_token(self, seq: Sequence, now: float, first_token: Callable[[RequestRecord], bool]) -> None:
        """A request got its first token at ``now`` (and goes on): its record's TTFT, and
        ``stop_when.first_token`` (a TTFT missed already decides part of the verdict)."""
        rec = self.records[seq.seq_id]
        if rec.first_token_s is None:  # (once: a step of the same instant may list it again)
            rec.first_token_s = now
            if not self._stop and first_token(rec):
                self._stop = True

    def _record_finish(self, inst: SimInstance, seq: Sequence, now: float) -> None:
        """A request finished on ``inst`` at ``now``: its record, its routing state, ``stop_when``."""
        rec = self.records[seq.seq_id]
        rec.first_token_s = seq.first_token_time
        rec.finish_s = now
        rec.num_output_tokens = seq.num_output_tokens
        rec.num_preemptions += seq.num_preemptions
        inst.route.release(seq.seq_id)
        self._sampled.pop(seq.seq_id, None)
        if self._stop_when is not None and not self._stop and self._stop_when(rec):
            self._stop = True

    def _finished_in_jump(self, inst: SimInstance, end_s: float, seqs: list[Sequence]) -> None:
        """A fast-forward finished ``seqs`` in its step ending at ``end_s``: record them then, in
        the event order of the step-by-step run (``stop_when`` sees them in time order)."""
        heapq.heappush(self._events, (end_s, STEP_DONE, next(self._seq_no), (inst, seqs, inst.step_version)))
        self._finishes_ahead += len(seqs)

    def finishes_left(self) -> float:
        """How many more requests a jump may finish before ``stop_when`` could end the run (inf: any)."""
        if self._finishes_to_decide is None:
            return float("inf")
        return self._finishes_to_decide() - self._finishes_ahead
