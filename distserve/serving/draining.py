"""Graceful shutdown of plain `distserve serve`: on SIGINT/SIGTERM, stop admitting and drain.

The first signal does not stop uvicorn at once (which would close the listening socket and reset the
connections still in its backlog, requests the client cannot know the fate of): ``DrainGate`` answers
every new request 503 with ``Retry-After`` while the requests in flight get the grace period to finish;
those still running then are failed clearly (the engine's shutdown ends their streams with an error
event), and only then does uvicorn stop. A second signal stops it at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

from distserve.serving.http_errors import error_response, unavailable

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class DrainGate:
    """An ASGI wrapper that counts the HTTP requests in flight and, once ``draining``, answers new ones 503."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.num_active = 0
        self.draining = False

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await error_response(unavailable("the server is shutting down"))(scope, receive, send)  # type: ignore[arg-type]
            return
        self.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_active -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGINT/SIGTERM starts draining ``gate`` instead of exiting."""

    def __init__(self, config: uvicorn.Config, gate: DrainGate) -> None:
        super().__init__(config)
        self.gate = gate
        self.signalled_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
            self.gate.draining = True
            return
        super().handle_exit(sig, frame)  # a second signal: stop now

    async def drain(self, grace_s: float, fail_in_flight: Callable[[], Awaitable[None]]) -> bool:
        """Wait up to ``grace_s`` for the requests in flight, fail those left (``fail_in_flight``), then
        let uvicorn stop; True if requests had to be failed."""
        deadline = time.monotonic() + grace_s
        while self.gate.num_active and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        failed = bool(self.gate.num_active)
        if failed:
            await fail_in_flight()
            while self.gate.num_active and time.monotonic() < deadline + grace_s:
                await asyncio.sleep(0.05)  # their error events go out
        self.should_exit = True
        return failed
