"""Request ids: a client's ``X-Request-Id`` (or vLLM's body field ``request_id``) as the engine's request id,
sanitised and unique among the requests in flight, and echoed in the ``X-Request-Id`` response header.

The id of a completion is ``cmpl-<client id>`` (chat: ``chatcmpl-<client id>``), as in vLLM; without a
client id it is ``cmpl-<random hex>``. It names the request to the engine, the request log and the
response body's ``id``. Only ``[A-Za-z0-9._:-]`` are kept (others become ``_``; ``#`` is how the engine
names a request's ``n`` > 1 completions) and at most ``MAX_REQUEST_ID_CHARS``. Two requests in flight
with the same id would share one engine request (an abort of one would end the other), so the later
one gets a suffix (``-1``, ``-2``, ...): its response's ``id`` says which.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import AsyncIterator
from typing import TypeVar

from fastapi import Request
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
SCOPE_KEY = "distserve.request_id"  # the id the route gave the request (the response header when the client sent none)
_UNSAFE = re.compile(r"[^A-Za-z0-9._:\-]")

T = TypeVar("T")


def sanitize(raw: str | None) -> str | None:
    """``raw`` with unsafe characters replaced and cut to ``MAX_REQUEST_ID_CHARS``; None if nothing is left."""
    if raw is None:
        return None
    cleaned = _UNSAFE.sub("_", raw.strip()[:MAX_REQUEST_ID_CHARS])
    return cleaned or None


def client_request_id(request: Request, body_request_id: str | None = None) -> str | None:
    """The client's id for this request: the ``X-Request-Id`` header, else the body's ``request_id``."""
    return sanitize(request.headers.get(HEADER)) or sanitize(body_request_id)


class InFlightIds:
    """The engine request ids in flight, so a repeated client id gets a suffix instead of colliding."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, base: str) -> str:
        """``base``, or ``base-1``, ``base-2``, ... if it is in flight; held until ``release``."""
        with self._lock:
            candidate, k = base, 0
            while candidate in self._ids:
                k += 1
                candidate = f"{base}-{k}"
            self._ids.add(candidate)
            return candidate

    def release(self, request_id: str) -> None:
        with self._lock:
            self._ids.discard(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def request_id(self, request: Request, prefix: str, body_request_id: str | None = None) -> str:
        """Claim the id of a new request (``prefix-<client id>`` or ``prefix-<random>``) and note it on the
        request for the response header."""
        client = client_request_id(request, body_request_id)
        request_id = self.claim(f"{prefix}-{client}" if client is not None else f"{prefix}-{uuid.uuid4().hex}")
        request.scope[SCOPE_KEY] = request_id
        return request_id

    async def held_by(self, stream: AsyncIterator[T], request_id: str) -> AsyncIterator[T]:
        """``stream``, with ``request_id`` released once it ends or is closed."""
        try:
            async for item in stream:
                yield item
        finally:
            aclose = getattr(stream, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                self.release(request_id)


class RequestIdHeader:
    """ASGI middleware: every response carries ``X-Request-Id``: the request's (sanitised) header, else the
    id a route gave the request (``SCOPE_KEY``), else none."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        echoed = sanitize(raw)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                request_id = echoed or scope.get(SCOPE_KEY)
                if request_id:
                    MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
