"""The time a decoding request waits between its tokens, from when an instance's steps end: what TPOT
backpressure reads (``cluster.backpressure``). ``InstanceCore.step_ended`` feeds it on every driver."""

from __future__ import annotations

from collections import deque


class StepIntervals:
    """The ends of an instance's latest steps, and what they say about its running requests' time per token.

    After each step (``ended``): the *step interval* — the time since the previous step ended when requests
    were running then, i.e. the step plus whatever its driver did between steps (the other instances' steps
    of an in-process round, the controller's round trip and its work on the Ray runtime), else the step's
    own time — and the *token interval*: with ``pipeline_depth`` (pp) micro-batches in flight a request
    advances once per pp steps, so the time since the step pp steps ago ended, when requests ran throughout
    (else pp step intervals). Read from one step, micro-batches of unequal size made the reading alternate
    short and long, and the TPOT rule flicker open.
    """

    def __init__(self, pipeline_depth: int = 1) -> None:
        self.pipeline_depth = pipeline_depth
        self._last_end: float | None = None
        self._running_at_last_end = False
        self._busy_ends: deque[float] = deque(maxlen=pipeline_depth)  # ends of the latest steps, while requests ran

    def ended(self, seconds: float, now: float, running: bool) -> tuple[float, float]:
        """A step that computed for ``seconds`` ended at ``now`` with requests ``running`` after it: its
        (step interval, token interval)."""
        prev, self._last_end = self._last_end, now
        busy, self._running_at_last_end = self._running_at_last_end, running
        step = max(seconds, now - prev) if busy and prev is not None else seconds
        ends, pp = self._busy_ends, self.pipeline_depth
        if not busy:
            ends.clear()
        token = max(now - ends[0], step) if len(ends) == pp and pp > 1 else step * pp
        ends.append(now)
        return step, token
