"""The ``StepPlan`` contract between a scheduler and whoever executes its plans (the model runner,
the simulator's latency model): what one step computes (``ScheduledChunk``), the block copies to
do first, who was preempted or finished, and what comes back (``SampledToken``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from distserve.config import SamplingParams
from distserve.engine.logprobs import PromptLogprobs, TopLogprobs
from distserve.errors import StepFailedError


@dataclass(slots=True)  # slots: one per scheduled sequence per step
class ScheduledChunk:
    """``token_ids`` are computed at positions ``start_pos ..``; if ``sample`` a token is sampled after."""

    seq_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling: SamplingParams
    num_output_tokens: int
    # The request's tokens so far (prompt + outputs), only for requests whose sampling reads them
    # (penalties; prompt logprobs while the prompt is computed: ``chunk_history``); else None.
    history: list[int] | None = None
    # Constrained decoding: int32[ceil(V / 32)], the tokens the sequence's grammar allows next
    # (``engine.structured_output``); set by the instance core for sampling chunks, else None.
    token_bitmask: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One query token: batched with the decodes (a chunked prefill's 1-token tail included)."""
        return len(self.token_ids) == 1


@dataclass(slots=True)
class StepPlan:
    """One engine step: decodes first, then prefill chunks (the attention kernel relies on the order)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before running
    preempted_seq_ids: list[str] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)  # freed since the last plan
    # Leader seq id -> (seq id, sampling) of each completion sampled from the leader's last prompt
    # row too (``n`` > 1: one prefill, n first tokens). Empty for almost every plan.
    forks: dict[str, list[tuple[str, SamplingParams]]] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def fork_rows(chunks: list[ScheduledChunk], forks: dict[str, list[tuple[str, SamplingParams]]]) -> tuple[list[int], list[ScheduledChunk]]:
    """The sampling chunks with each leader's completions added (a chunk per completion, same logits
    row): the row of each and the chunks, in the order to sample them."""
    rows: list[int] = []
    out: list[ScheduledChunk] = []
    for i, c in enumerate(chunks):
        rows.append(i)
        out.append(c)
        for seq_id, sampling in forks.get(c.seq_id, ()):
            rows.append(i)
            out.append(dataclasses.replace(c, seq_id=seq_id, sampling=sampling))
    return rows, out


@contextmanager
def attributed_to(plan: StepPlan) -> Iterator[None]:
    """Re-raise a failure inside as a ``StepFailedError`` naming the requests ``plan`` computes."""
    try:
        yield
    except StepFailedError:
        raise
    except Exception as exc:
        raise StepFailedError(f"{type(exc).__name__}: {exc}", [c.seq_id for c in plan.chunks]) from exc


def chunk_history(token_ids: list[int], sampling: SamplingParams, num_output_tokens: int) -> list[int] | None:
    """``ScheduledChunk.history`` for a request with these tokens: a copy when its sampling reads it."""
    if sampling.has_penalties or (sampling.prompt_logprobs is not None and not num_output_tokens):
        return token_ids[:]
    return None


@dataclass(slots=True)
class SampledToken:
    seq_id: str
    token_id: int
    logprob: float | None = None
    error: str | None = None  # sampling this request failed: it fails alone, with this message
    top_logprobs: TopLogprobs | None = None  # with ``logprob``, if the request asked for alternatives
    prompt_logprobs: PromptLogprobs | None = None  # with a request's first token, if it asked for them


__all__ = ["SampledToken", "ScheduledChunk", "StepPlan", "attributed_to", "chunk_history", "fork_rows"]
