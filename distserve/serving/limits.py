"""What one HTTP request may cost the server before any route runs: body size, header count and size, and how
long a client may take to send its request (``HttpLimits``, the serve flags ``--max-request-body-bytes``,
``--h11-max-incomplete-event-size``, ``--h11-max-header-count``, ``--timeout-keep-alive`` and
``--request-read-timeout``).

Two layers enforce them, because a hostile client attacks both:

* ``RequestLimits`` (ASGI middleware, every route): a ``Content-Length`` over the limit is a 413 before a
  byte of the body is read; a body without one (chunked) is read up to the limit; the whole body must
  arrive within the read timeout (408); more headers than the limit is a 431; a body that is not UTF-8, or
  holds a JSON escape of half a surrogate pair (``"\\ud800"``: text nothing downstream can encode), a 400. Each answer is OpenAI's
  error body naming the ``param`` and closes the connection (the rest of the body is never read). The
  body is read here, whole, before the route (every route reads its body whole anyway), so no route can
  be held by a slow body.
* ``protocol_class`` (the uvicorn connection, plain ``distserve serve``): h11 with its incomplete-event
  bound (headers over ``max_header_bytes``: a 431), and a deadline for the request line and headers,
  armed when a connection opens and whenever it waits for a new request's first bytes — a slowloris
  client that sends a header byte a second is cut off after ``request_read_timeout_s``, and a connection
  that never sends anything after ``timeout_keep_alive_s``. uvicorn's own parser has no such deadline, and
  its httptools parser no header bound, so the server always runs h11.

Starlette's and FastAPI's own body limits answer in plain text, not OpenAI's error shape, which is why
the middleware is ours. A Ray Serve app (``--ray-serve``) gets the middleware; its proxy's connections
are Ray's.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from distserve.errors import InvalidConfigError
from distserve.serving.http_errors import error_response
from distserve.serving.protocol import APIError

MIB = 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on one HTTP request (see the module docstring)."""

    # 8 MiB: a 128k-token prompt is ~0.5 MB of text or ~1 MB of token ids; a semantic variable's value
    # (at most --max-value-chars, 1M characters) stays under it even as JSON \\u escapes.
    max_request_body_bytes: int = 8 * MIB
    max_header_bytes: int = 64 * 1024  # request line and headers (h11's incomplete-event bound; uvicorn's default is 16 KiB)
    max_header_count: int = 256  # vLLM's --h11-max-header-count default
    timeout_keep_alive_s: float = 5.0  # uvicorn's: an idle keep-alive connection (or one that never sends) is closed
    request_read_timeout_s: float = 30.0  # headers, and then the body, must each arrive within it

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_header_bytes", "max_header_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfigError(f"{name} must be an integer >= 1, got {value!r}", name)
        for name in ("timeout_keep_alive_s", "request_read_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InvalidConfigError(f"{name} must be a positive number of seconds, got {value!r}", name)


DEFAULT_HTTP_LIMITS = HttpLimits()


def _closing(exc: APIError) -> APIError:
    exc.headers = {**(exc.headers or {}), "Connection": "close"}  # the unread rest of the request is dropped with the connection
    return exc


def body_too_large(limits: HttpLimits, size: int | None = None) -> APIError:
    got = f", got {size}" if size is not None else ""
    return _closing(APIError(413, f"the request body may be at most {limits.max_request_body_bytes} bytes{got} "
                                  "(--max-request-body-bytes)", param="body", code="request_too_large"))


class RequestLimits:
    """ASGI middleware: the request's headers counted, its body read whole within the limits, then the app."""

    def __init__(self, app: ASGIApp, limits: HttpLimits = DEFAULT_HTTP_LIMITS) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        headers = scope.get("headers", ())
        # h11 bounds only a head that arrives in pieces (its incomplete-event size); one that arrives whole is measured here.
        head_bytes = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + sum(len(k) + len(v) + 4 for k, v in headers)
        if len(headers) > limits.max_header_count or head_bytes > limits.max_header_bytes:
            what = (f"at most {limits.max_header_count} headers, got {len(headers)}" if len(headers) > limits.max_header_count
                    else f"a request line and headers of at most {limits.max_header_bytes} bytes, got {head_bytes}")
            error = APIError(431, f"a request may carry {what}", param="headers", code="request_header_fields_too_large")
            await error_response(_closing(error))(scope, receive, send)
            return
        lengths = [v for k, v in headers if k == b"content-length"]
        if lengths:
            try:
                length = int(lengths[0])
            except ValueError:
                length = -1
            if length < 0:
                await error_response(_closing(APIError(400, "Content-Length must be a non-negative integer",
                                                       param="content-length")))(scope, receive, send)
                return
            if length > limits.max_request_body_bytes:
                await error_response(body_too_large(limits, length))(scope, receive, send)
                return
        try:
            async with asyncio.timeout(limits.request_read_timeout_s):
                body, disconnected = await _read_body(receive, limits)
        except TimeoutError:
            error = APIError(408, f"the request body did not arrive within {limits.request_read_timeout_s:g} s "
                                  "(--request-read-timeout)", param="body", type="timeout_error", code="request_timeout")
            await error_response(_closing(error))(scope, receive, send)
            return
        except _TooLarge:
            await error_response(body_too_large(limits))(scope, receive, send)
            return
        if disconnected:
            return  # the client left: nobody to answer
        unreadable = _unreadable(body)
        if unreadable is not None:
            await error_response(APIError(400, unreadable, param="body"))(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)


class _TooLarge(Exception):
    pass


async def _read_body(receive: Receive, limits: HttpLimits) -> tuple[bytes, bool]:
    """The whole body (over the limit: ``_TooLarge``), and whether the client disconnected instead."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limits.max_request_body_bytes:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


_JSON_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)
_LOW_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _unreadable(body: bytes) -> str | None:
    """Why ``body`` is no text at all (None: it is): not UTF-8, or a JSON ``\\u`` escape of half a surrogate
    pair. Python's JSON parser accepts both, as strings no encoder, tokenizer or JSON response can take."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the body is not UTF-8 text (byte {exc.start})"
    low_at = -1  # where the low half of the last pair starts (it is not lone)
    for m in _JSON_ESCAPE.finditer(body):
        code = int(m.group(1), 16) if m.group(1) is not None else -1
        if 0xD800 <= code <= 0xDBFF and _LOW_SURROGATE_ESCAPE.match(body, m.end()):
            low_at = m.end()
        elif 0xD800 <= code <= 0xDFFF and m.start() != low_at:
            return f"the body has a JSON escape of half a surrogate pair at byte {m.start()}"
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body, already read, given first (later calls wait for the disconnect as before)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def add_request_limits(app: Any, limits: HttpLimits) -> None:
    app.add_middleware(RequestLimits, limits=limits)


# ---- the connection ---------------------------------------------------------------------------------
def _raw_error(status: int, reason: str, exc: APIError) -> bytes:
    body = json.dumps(exc.body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("latin-1") + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 connection with a deadline on the request line and headers (see the module docstring)."""

    limits: HttpLimits = DEFAULT_HTTP_LIMITS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer(self.limits.timeout_keep_alive_s)  # a connection that never sends is closed like an idle one

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._cancel_head_timer()
        elif self.conn.their_state is h11.IDLE:
            # Waiting for (the rest of) a request's head: the deadline runs from its first byte.
            if self._head_timer is None or self._head_timer_for_idle:
                self._arm_head_timer(self.limits.request_read_timeout_s, idle=False)
        else:
            self._cancel_head_timer()  # the head is complete; the body's deadline is the middleware's

    def _arm_head_timer(self, delay_s: float, idle: bool = True) -> None:
        self._cancel_head_timer()
        self._head_timer_for_idle = idle
        self._head_timer = self.loop.call_later(delay_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a request arrived: say why it is dropped
            error = APIError(408, f"the request line and headers did not arrive within {self.limits.request_read_timeout_s:g} s "
                                  "(--request-read-timeout)", param="headers", type="timeout_error", code="request_timeout")
            self.transport.write(_raw_error(408, "Request Timeout", error))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """An unparseable request: 431 in OpenAI's shape if its head outgrew the bound, else 400."""
        if len(self.conn.trailing_data[0]) > self.limits.max_header_bytes:
            error = APIError(431, f"the request line and headers may be at most {self.limits.max_header_bytes} bytes "
                                  "(--h11-max-incomplete-event-size)", param="headers", code="request_header_fields_too_large")
            self.transport.write(_raw_error(431, "Request Header Fields Too Large", error))
        else:
            self.transport.write(_raw_error(400, "Bad Request", APIError(400, f"invalid HTTP request: {msg}")))
        self._cancel_head_timer()
        self.transport.close()


def protocol_class(limits: HttpLimits) -> type[LimitedH11Protocol]:
    """The uvicorn ``http`` protocol class enforcing ``limits``."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


def uvicorn_config(app: Any, limits: HttpLimits, **kwargs: Any) -> Any:
    """A ``uvicorn.Config`` for ``app`` with the connection side of ``limits`` (``kwargs``: its other settings)."""
    import uvicorn

    return uvicorn.Config(app, http=protocol_class(limits), h11_max_incomplete_event_size=limits.max_header_bytes,
                          timeout_keep_alive=limits.timeout_keep_alive_s, **kwargs)  # type: ignore[arg-type]


__all__ = ["DEFAULT_HTTP_LIMITS", "HttpLimits", "LimitedH11Protocol", "RequestLimits", "add_request_limits", "protocol_class",
           "uvicorn_config"]
