"""``OverloadGate``: refuse generation requests at the HTTP process's door while the server's admission
last said it refuses every request.

Under a burst of many times the server's capacity most requests are refused, and a refusal that goes
the whole way — chat template, tokenization, a call to the controller (on Ray: serialization, an actor
hop and back) — costs the CPU that the admitted requests' steps need (on a small machine, as much as
the steps themselves). A refusal whose bound is the whole server's (``QueueFullError.shared``: requests
in flight, the admission queue's length or its predicted wait) holds for every request arriving within
its ``retry_after_s``, so the gate answers those at once with the same 429 (``Retry-After`` the time
left), for at most ``MAX_HOLD_S``: then one request goes through again and finds the queue's state.
Bounds of one tenant, its token rate or a grammar compile are left to the admission queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from distserve.errors import QueueFullError

# Longest the gate stays shut on one refusal: short next to the queue's own bound on waiting
# (max_queue_delay, seconds of work), so the queue never runs dry while the gate is shut.
MAX_HOLD_S = 1.0
UNKNOWN_HOLD_S = 0.1  # a shared refusal that gave no retry time (a bound on requests in flight)


class OverloadGate:
    """Remembers the last shared refusal (``observe``) and refuses what arrives while it holds (``check``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_hold_s: float | None = None) -> None:
        self.clock = clock
        self.max_hold_s = MAX_HOLD_S if max_hold_s is None else max_hold_s
        self._until = 0.0
        self._reason = ""
        self.num_refused = 0  # requests the gate refused (the server's metrics count them as queue_full too)

    def observe(self, exc: BaseException) -> None:
        """A request was refused with ``exc``: a shared ``QueueFullError`` shuts the gate for its retry time."""
        if not (isinstance(exc, QueueFullError) and exc.shared):
            return
        hold = exc.retry_after_s if exc.retry_after_s is not None else UNKNOWN_HOLD_S
        until = self.clock() + min(max(hold, 0.0), self.max_hold_s)
        if until > self._until:
            self._until, self._reason = until, str(exc)

    @property
    def shut_for_s(self) -> float:
        """Seconds the gate stays shut (0 when open)."""
        return max(0.0, self._until - self.clock())

    def check(self) -> None:
        """Raise the gate's ``QueueFullError`` (shared, ``retry_after_s`` the time left) while it is shut."""
        left = self.shut_for_s
        if left > 0:
            self.num_refused += 1
            raise QueueFullError(f"the server is refusing requests for {left:.2f} s more: {self._reason}", None, left, shared=True)
