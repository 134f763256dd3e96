"""How failures become OpenAI-style HTTP errors: engine exceptions and failed outputs as 4xx/5xx
``APIError``s, validation errors naming the field, and a client that left as 499.

Every 429 and 503 carries ``Retry-After`` (whole seconds, at least 1): the engine's estimate when a
``QueueFullError`` has one (``retry_after_s``, from the measured drain rate), else 1 s.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from distserve.engine.outputs import RequestOutput
from distserve.cluster.admission import DEFAULT_RETRY_AFTER_S, SHED, TIMED_OUT
from distserve.errors import DistServeError, PromptTooLongError, QueueFullError, RequestTimeoutError, ServiceUnavailableError
from distserve.serving.protocol import APIError

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
RETRY_AFTER_S = "1"


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was complete."""


def error_response(exc: APIError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if exc.status_code in (429, 503) else {}
    headers.update(exc.headers or {})
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers or None)


def retry_after(seconds: float | None) -> str:
    """A ``Retry-After`` value: whole seconds, rounded up, at least 1 (unknown: 1)."""
    if seconds is None or not math.isfinite(seconds):
        return RETRY_AFTER_S
    return str(max(1, math.ceil(seconds)))


def queue_full(exc: QueueFullError) -> APIError:
    """429 in OpenAI's shape, with ``Retry-After`` from the engine's estimate."""
    return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": retry_after(exc.retry_after_s)})


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code="service_unavailable")


def engine_error(exc: BaseException, prompt_param: str, param_names: dict[str, str] | None = None) -> APIError:
    """The HTTP error for an exception raised by ``EngineClient.generate``.

    Bad input is a 4xx naming the field (``param_names`` maps the engine's name of a field to the
    one this request used, e.g. ``max_tokens`` -> ``max_completion_tokens``); an outage is a 503;
    anything else is the server's fault (500), never blamed on the request.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return queue_full(exc)
    if isinstance(exc, RequestTimeoutError):
        return APIError(408, f"the request timed out before it was served: {exc}", param=exc.param or "timeout",
                        type="timeout_error", code="request_timeout")
    if isinstance(exc, DistServeError):
        param = exc.param or prompt_param
        param = (param_names or {}).get(param, param)
        code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else None
        return APIError(400, str(exc), param=param, code=code)
    if isinstance(exc, ServiceUnavailableError):
        return unavailable(str(exc))
    logger.error("request failed: %s: %s", type(exc).__name__, exc)
    return request_failed(f"{type(exc).__name__}: {exc}")


def request_failed(message: str) -> APIError:
    return APIError(500, message, type="internal_server_error", code="request_failed")


def check_output(out: RequestOutput) -> RequestOutput:
    """``out``, unless it reports that its request failed (``finish_reason`` "error"): then a 408
    if it waited past its ``timeout`` in the admission queue, a 429 if it waited the queue's
    ``max_queue_delay`` there, else a 500."""
    if out.error is not None:
        if out.error_kind == TIMED_OUT:
            raise engine_error(RequestTimeoutError(out.error, "timeout"), "timeout")
        if out.error_kind == SHED:
            raise engine_error(QueueFullError(out.error, None, DEFAULT_RETRY_AFTER_S), "prompt")
        raise request_failed(out.error)
    return out


def validation_param(loc: tuple[Any, ...]) -> str | None:
    """``messages[0].content`` from a pydantic error location (union member tags dropped)."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            if not param:
                break
            param += f"[{part}]"
        elif part in ("str", "int", "float", "bool") or "[" in part or "-" in part:
            break
        else:
            param += f".{part}" if param else part
    return param or None


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the OpenAI error format (a client that left gets a bare 499)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(APIError(400, f"invalid JSON body: {first.get('ctx', {}).get('error', '')}".strip()))
        param = validation_param(tuple(first.get("loc", ())))
        lines = (f"{validation_param(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg', 'invalid')}" for e in errors)
        message = "; ".join(dict.fromkeys(lines))
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
