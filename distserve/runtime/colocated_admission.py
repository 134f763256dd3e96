"""The admission queue the in-process client keeps in front of colocated engines (``LLMEngine`` slots).

A ``LocalDisaggEngine`` queues its own requests (``distserve.cluster.admission``, driven by its
``_submit``/``_admit``); an ``LLMEngine`` schedules whatever it is given at once. So that
``serve --colocated N`` queues alike, ``ThreadedEngineClient`` holds one ``ColocatedAdmission``
for its colocated slots and drives it on its engine thread, as ``LocalDisaggEngine`` drives its own:

* ``push`` on arrival: the prompt is tokenized and checked against the engines' limits here (bad
  input and ``QueueFullError`` are that request's alone), then queued by tenant;
* ``expire`` before each step: a request past its ``timeout`` ends with an output whose
  ``error_kind`` is ``TIMED_OUT`` (HTTP 408), built as an engine builds a failed request's output;
* ``dispatch`` before each step: released in the policy's order while a slot accepts one under
  backpressure (its scheduler's waiting count and, with a TPOT SLO, its last step time), to the
  slot the client's entry rule picks among the accepting ones; the engine then orders it by its
  dispatch time, so the fair order holds in its scheduler too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from distserve.cluster.admission import (
    AdmissionConfig, AdmissionItem, AdmissionQueue, EntryLoad, check_timeout, entry_load, expired_error, measured_tpot_s,
)
from distserve.cluster.classes import RequestClass, check_request_class
from distserve.config import SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.frontend import EngineBase
from distserve.engine.outputs import RequestMetrics, RequestOutput

S = TypeVar("S")  # the client's slot type
IDLE_POLL_S = 0.05  # longest idle wait while requests are queued and no engine has work


@dataclass(eq=False)
class QueuedRequest:
    """A request as the client received it; once queued, ``prompt`` is its token ids, the other
    fields checked, and ``arrival_time`` when it arrived."""

    stream: Any  # the client's stream of this request's outputs (it knows the request id)
    prompt: str | Seq[int]
    sampling: SamplingParams
    priority: int = 0
    request_class: RequestClass | None = None
    timeout_s: float | None = None
    arrival_time: float | None = None  # None: when an engine takes it


def colocated_load(engine: EngineBase, with_tpot: bool) -> EntryLoad:
    """What backpressure reads of a colocated engine: its scheduler's pending prompts and step size
    (``entry_load``) and, when a TPOT SLO is set, the time between its last steps while it decodes (an engine it
    cannot read takes every request)."""
    if not isinstance(engine, LLMEngine):
        return EntryLoad(0)
    scheduler = engine.scheduler
    tpot = measured_tpot_s([(scheduler.num_running, engine.core.token_interval_s)]) if with_tpot else None
    return entry_load(scheduler, tpot)


class ColocatedAdmission(Generic[S]):
    """Requests between arrival and dispatch to one of the client's colocated slots."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.queue: AdmissionQueue[Any] = config.queue()  # items' payload: their QueuedRequest

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.queue

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, engine: EngineBase, request_id: str, request: QueuedRequest, now: float) -> None:
        """Validate against ``engine``'s limits (all slots serve one model) and queue; raises a
        ``DistServeError`` for bad input and ``QueueFullError`` when a bound or token rate refuses it."""
        ids = engine.encode_prompt(request.prompt)
        engine.check_request(ids, request.sampling, request.priority)
        request_class = check_request_class(request.request_class)
        request = replace(request, prompt=ids, request_class=request_class, timeout_s=check_timeout(request.timeout_s), arrival_time=now)
        item = AdmissionItem(request_id, request_class, len(ids) + request.sampling.max_tokens * request.sampling.n, now, request.priority, request.timeout_s, request,
                             num_prompt_tokens=len(ids))
        self.queue.push(item, now)

    def remove(self, request_id: str) -> QueuedRequest | None:
        """Take a queued request out (aborted); None if it is not queued here."""
        item = self.queue.remove(request_id)
        return item.payload if item is not None else None

    def remove_all(self) -> list[QueuedRequest]:
        return [r for r in (self.remove(rid) for rid in self.queue.request_ids()) if r is not None]

    def expire(self, now: float) -> list[tuple[QueuedRequest, RequestOutput]]:
        """The requests past their deadline or shed, each with its last output (``error_kind`` TIMED_OUT or SHED)."""
        return [(item.payload, timed_out_output(item, item.payload, now)) for item in self.queue.expire(now)]

    def dispatch(
        self, now: float, slots: Seq[S], engine_of: Callable[[S], EngineBase], place: Callable[[AdmissionItem, list[S]], S],
    ) -> list[tuple[str, QueuedRequest, S, int]]:
        """Release what the slots accept under backpressure: (request id, request, slot, admission
        rank) in policy order."""
        if not self.queue:
            return []
        with_tpot = self.queue.backpressure.tpot_slo_s is not None
        released = self.queue.dispatch(now, slots, lambda slot: colocated_load(engine_of(slot), with_tpot), place)
        return [(item.request_id, item.payload, slot, item.rank) for item, slot in released]

    def wait_s(self, now: float) -> float | None:
        """How long the idle engine thread may block on its commands: until the next deadline, at
        most ``IDLE_POLL_S`` while anything is queued (None: nothing is queued)."""
        if not self.queue:
            return None
        return max(0.0, min(IDLE_POLL_S, self.queue.next_deadline() - now))


def timed_out_output(item: AdmissionItem, request: QueuedRequest, now: float) -> RequestOutput:
    """The one output of a request that waited past its timeout or was shed: nothing generated, ``error_kind``
    TIMED_OUT or SHED."""
    return RequestOutput(
        request_id=item.request_id,
        prompt_token_ids=list(request.prompt),  # type: ignore[arg-type]  # token ids once queued
        token_ids=[],
        text="",
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        metrics=RequestMetrics(item.arrival, None, now, len(request.prompt), 0, 0),
        error=str(expired_error(item, now)),
        error_kind=item.expired_kind,
    )


__all__ = ["ColocatedAdmission", "IDLE_POLL_S", "QueuedRequest", "colocated_load", "timed_out_output"]
