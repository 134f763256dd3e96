"""A request's timestamps as its driver saw them (``RequestMetrics``) and what is derived from them:
TTFT, TPOT and the latency breakdown of DistServe's Figure 10 (``LatencyBreakdown``).

Every runtime stamps the same points on the ``Sequence`` (on its driver's ``time.monotonic`` clock),
and leaves None what it cannot know: arrival; dispatch from the admission queue; the start of the
first plan that computed part of its prompt; its first token; the start and end of its KV migration
(disaggregated runtimes only); its finish. The breakdown splits [arrival, finish] at those points,
so its parts always add up to the end-to-end latency; a missing point contributes nothing (e.g. a
driver that does not know when the prompt started computing counts the wait in the instance as
prefill).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from distserve import slo
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import StepPlan


@dataclass(frozen=True)
class LatencyBreakdown:
    """Where a finished request's end-to-end latency went, in seconds.

    ``queue_s``: arrival → the start of its prefill (the admission queue, then the instance's
    waiting queue). ``prefill_s``: prefill start → first token. ``migration_queue_s``: first token →
    the start of its KV migration (waiting for a decode instance with room; DistServe's "decoding
    queueing"). ``migration_s``: the KV transfer. ``decode_s``: the end of the migration (colocated:
    the first token) → finish. The migration parts are None where nothing migrates.
    """

    queue_s: float
    prefill_s: float
    migration_queue_s: float | None
    migration_s: float | None
    decode_s: float

    @property
    def total_s(self) -> float:
        """The sum of the parts: the end-to-end latency."""
        return self.queue_s + self.inference_s

    @property
    def inference_s(self) -> float:
        """Prefill start → finish (vLLM's ``request_inference_time``): everything but the queueing."""
        return self.prefill_s + (self.migration_queue_s or 0.0) + (self.migration_s or 0.0) + self.decode_s

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)


@dataclass
class RequestMetrics:
    """One request's timestamps (its driver's ``time.monotonic``; None: not happened, or not known
    to this runtime) and token counts."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    dispatch_time: float | None = None  # left the admission queue (None: no queue in front)
    prefill_start_time: float | None = None  # the first plan computing part of its prompt was launched
    migration_start_time: float | None = None  # its KV started moving to a decode instance (the last attempt's)
    migration_end_time: float | None = None  # ... and arrived there

    @classmethod
    def of(cls, seq: Sequence, finish_time: float | None = None) -> RequestMetrics:
        """``seq``'s metrics now (``finish_time``: the finish to report when ``seq`` has none yet)."""
        return cls(
            seq.arrival_time, seq.first_token_time, seq.finish_time if seq.finish_time is not None else finish_time,
            seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_output_tokens,
            dispatch_time=seq.dispatch_time, prefill_start_time=seq.prefill_start_time,
            migration_start_time=seq.migration_start_time, migration_end_time=seq.migration_end_time,
        )

    @property
    def ttft_s(self) -> float | None:
        return slo.ttft(self.arrival_time, self.first_token_time)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, once finished (``distserve.slo.tpot``: None for one token)."""
        return slo.tpot(self.first_token_time, self.finish_time, self.num_output_tokens)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def breakdown(self) -> LatencyBreakdown | None:
        """The latency breakdown once finished with a first token (None before, or without one)."""
        return latency_breakdown(self)

    def as_dict(self) -> dict[str, Any]:
        """Every timestamp and count, TTFT/TPOT/E2E and the breakdown: one request-log record."""
        bd = self.breakdown
        return {**asdict(self), "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s,
                "breakdown": bd.as_dict() if bd is not None else None}


def latency_breakdown(m: RequestMetrics) -> LatencyBreakdown | None:
    """Split [arrival, finish] at the request's known timestamps (see ``LatencyBreakdown``).

    A timestamp earlier than the one before it (clocks read in different places of a driver, e.g.
    the Ray controller's step start vs. its dispatch) is taken as that one, so no part is negative.
    """
    if m.finish_time is None or m.first_token_time is None:
        return None

    def after(t: float | None, prev: float) -> float:
        return prev if t is None else max(t, prev)

    dispatch = after(m.dispatch_time, m.arrival_time)
    prefill_start = after(m.prefill_start_time, dispatch)
    first = after(m.first_token_time, prefill_start)
    migrated = m.migration_start_time is not None and m.migration_end_time is not None
    mig_start = after(m.migration_start_time, first) if migrated else first
    mig_end = after(m.migration_end_time, mig_start) if migrated else first
    return LatencyBreakdown(
        queue_s=prefill_start - m.arrival_time,
        prefill_s=first - prefill_start,
        migration_queue_s=mig_start - first if migrated else None,
        migration_s=mig_end - mig_start if migrated else None,
        decode_s=m.finish_time - mig_end,
    )


def stamp_prefill_starts(plan: StepPlan, seqs: Mapping[str, Sequence], now: float) -> None:
    """As ``plan`` is launched at ``now``: the prefill start of each request it computes a first
    part of the prompt for (a request with a first token, or already stamped, keeps its stamp)."""
    for chunk in plan.chunks:
        seq = seqs.get(chunk.seq_id)
        if seq is not None and seq.prefill_start_time is None and seq.first_token_time is None:
            seq.prefill_start_time = now


__all__ = ["LatencyBreakdown", "RequestMetrics", "latency_breakdown", "stamp_prefill_starts"]
