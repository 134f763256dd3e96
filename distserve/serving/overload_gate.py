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

``OverloadDoor`` (ASGI middleware, inside the key check) asks the gate before FastAPI routes the request:
while it is shut, a generation request (``GATED_PATHS``: completions, chat completions and Parrot's semantic
calls) is answered there, before its body is parsed and validated — under a 10x burst of small requests the
refusals' parsing and validation took about as much of the HTTP process's CPU as everything else it did. A
request with a malformed body gets its 400 once the gate is open again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from distserve.errors import QueueFullError
from distserve.serving.http_errors import error_response, queue_full

# Longest the gate stays shut on one refusal: short next to the queue's own bound on waiting
# (max_queue_delay, seconds of work), so the queue never runs dry while the gate is shut.
MAX_HOLD_S = 1.0
UNKNOWN_HOLD_S = 0.1  # a shared refusal that gave no retry time (a bound on requests in flight)
GATED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/semantic_call"})  # POSTs that start generation


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


class OverloadDoor:
    """ASGI middleware: a POST to one of ``GATED_PATHS`` while ``gate`` is shut gets the gate's 429 (``Retry-After``
    the time left) before any route runs; ``on_refuse(scope)`` counts it (per tenant: the key check runs outside)."""

    def __init__(self, app: ASGIApp, gate: OverloadGate, on_refuse: Callable[[Scope], None]) -> None:
        self.app, self.gate, self.on_refuse = app, gate, on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GATED_PATHS and self.gate.shut_for_s > 0:
            try:
                self.gate.check()
            except QueueFullError as exc:
                self.on_refuse(scope)
                await error_response(queue_full(exc))(scope, receive, send)
                return
        await self.app(scope, receive, send)
