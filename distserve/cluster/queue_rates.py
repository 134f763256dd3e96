"""How fast the admission queue drains and how fast a tenant may send: the measurements behind
``AdmissionQueue``'s refusals (``distserve.cluster.admission``) and their ``Retry-After``.

* ``DrainRate``: dispatches per second (EWMA of the gaps), for a bound's ``Retry-After``;
* ``BacklogRate``: seconds per dispatched request while the queue is backlogged, for the wait a new
  request would have (``max_queue_delay_s``);
* ``TokenBucket``: a tenant's tokens per minute.
"""

from __future__ import annotations

import math
from collections import deque

DEFAULT_RETRY_AFTER_S = 1.0  # before any dispatch rate is measured
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 0.05, 60.0
# A refusal for the predicted wait says come back after at least this share of the bound (max_queue_delay_s):
# a queue at its bound admits about one request per drain interval, and the predicted excess alone
# (often under 0.1 s) reopened the HTTP process's door (``serving/overload_gate.py``) so often that
# under a 10x burst ~20 requests a second went the whole way to the controller only to be refused.
QUEUE_BOUND_RETRY_SHARE = 0.05
RATE_SMOOTHING = 0.2  # EWMA weight of the newest gap between dispatches
BACKLOG_WINDOW_S = 30.0  # seconds of backlogged dispatch gaps that measure the drain rate
BACKLOG_MIN_S = 2.0  # ... and how many it takes before the rate is trusted


class DrainRate:
    """Dispatches per second, an EWMA of the gaps between them; a gap still open counts once it
    is longer than the average (a stalled queue drains slowly)."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.mean_gap_s: float | None = None

    def record(self, now: float) -> None:
        if self.last is not None:
            gap = max(0.0, now - self.last)
            self.mean_gap_s = gap if self.mean_gap_s is None else RATE_SMOOTHING * gap + (1 - RATE_SMOOTHING) * self.mean_gap_s
        self.last = now

    def per_s(self, now: float) -> float | None:
        """The rate at ``now`` (None: fewer than two dispatches seen)."""
        if self.mean_gap_s is None or self.last is None:
            return None
        gap = max(self.mean_gap_s, now - self.last)
        return 1.0 / gap if gap > 0 else math.inf

    def retry_after_s(self, now: float, num_ahead: int = 1) -> float:
        """Seconds until ``num_ahead`` more dispatches at the measured rate (a default before any)."""
        rate = self.per_s(now)
        seconds = DEFAULT_RETRY_AFTER_S if rate is None else num_ahead / rate
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, seconds))


class BacklogRate:
    """The time between dispatches while the queue is backlogged: over the last ``BACKLOG_WINDOW_S``
    seconds of gaps during which some request waited throughout (a request that found the queue
    empty ends no gap, so idle periods do not read as a slow drain), their total time over the
    requests dispatched at their ends. A dispatch of many at once (an entry instance freeing room
    for a batch) counts as one gap and many requests, so the rate is right however lumpy the
    dispatches are; with less than ``BACKLOG_MIN_S`` measured (a burst hitting a cold server, whose
    instances first take a batch at once) there is no estimate yet."""

    def __init__(self) -> None:
        self._gaps: deque[list[float]] = deque()  # [gap seconds, requests dispatched at its end]
        self._time = 0.0
        self._count = 0
        self._last: float | None = None

    def record(self, now: float, queued_since: float) -> None:
        """A request was dispatched at ``now``; the longest-waiting request queued then (it, or one the
        policy put after it: a latency-class call overtakes a chat backlog) had waited since ``queued_since``."""
        if self._last is not None and queued_since <= self._last:  # the queue was backlogged through the whole gap
            gap = max(0.0, now - self._last)
            if gap == 0.0:  # dispatched with the one before it: at the end of the same gap, if there was one
                if self._gaps:
                    self._gaps[-1][1] += 1
                    self._count += 1
            else:
                self._gaps.append([gap, 1])
                self._time += gap
                while len(self._gaps) > 1 and self._time - self._gaps[0][0] >= BACKLOG_WINDOW_S:
                    old_gap, old_count = self._gaps.popleft()
                    self._time -= old_gap
                    self._count -= int(old_count)
                self._count += 1
        self._last = now

    def wait_s(self, num_ahead: int) -> float | None:
        """The predicted wait behind ``num_ahead`` requests (None: too little measured yet)."""
        if self._time < BACKLOG_MIN_S or not self._count:
            return None
        return num_ahead * self._time / self._count


class TokenBucket:
    """``tokens_per_minute`` admitted per minute, bursts up to a minute's worth. A request larger
    than the bucket is admitted when the bucket is full and leaves it in debt."""

    def __init__(self, tokens_per_minute: int, now: float) -> None:
        self.capacity = float(tokens_per_minute)
        self.per_s = tokens_per_minute / 60.0
        self.level, self.at = self.capacity, now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.at) * self.per_s)
        self.at = max(self.at, now)

    def wait_s(self, cost: int, now: float) -> float:
        """Seconds until ``cost`` tokens may be taken (0: now)."""
        self._refill(now)
        need = min(float(cost), self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.per_s

    def take(self, cost: int) -> None:
        self.level -= cost


__all__ = ["BACKLOG_MIN_S", "BACKLOG_WINDOW_S", "BacklogRate", "DEFAULT_RETRY_AFTER_S", "DrainRate", "MAX_RETRY_AFTER_S", "MIN_RETRY_AFTER_S",
           "QUEUE_BOUND_RETRY_SHARE", "RATE_SMOOTHING", "TokenBucket"]
