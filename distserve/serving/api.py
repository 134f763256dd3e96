"""The OpenAI-compatible HTTP API (FastAPI) over any ``EngineClient``, and a plain-uvicorn runner."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from distserve.config import SamplingParams
from distserve.engine.outputs import RequestOutput
from distserve.errors import (
    DistServeError,
    InvalidConfigError,
    PromptTooLongError,
    QueueFullError,
    ServiceUnavailableError,
)
from distserve.runtime.client import EngineClient
from distserve.serving.metrics import CONTENT_TYPE, RequestTimer, ServingMetrics
from distserve.serving.protocol import (
    SSE_DONE,
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    finish_reason,
    sse,
)
from distserve.slo import SLO

logger = logging.getLogger(__name__)

T = TypeVar("T")

MODEL_ALIASES: dict[str, tuple[str, ...]] = {"smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct",)}
STATS_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 5.0
CLIENT_CLOSED_REQUEST = 499
RETRY_AFTER_S = "1"
ENGINE_WATCH_INTERVAL_S = 0.5


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was complete."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, cancelling it (which closes the streams it iterates) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(Exception, asyncio.CancelledError):
        await task
    raise ClientDisconnected()


class _SSEResponse(StreamingResponse):
    """Streams server-sent events and always closes the event generator at the end.

    Closing it on disconnect is what aborts the request in the engine; Starlette alone only
    cancels the task that iterates it, leaving the generator for the garbage collector.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def _error_response(exc: APIError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if exc.status_code in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


def _unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code="service_unavailable")


def _engine_error(exc: BaseException, prompt_param: str, param_names: dict[str, str] | None = None) -> APIError:
    """The HTTP error for an exception raised by ``EngineClient.generate``.

    Bad input is a 4xx naming the field (``param_names`` maps the engine's name of a field to the
    one this request used, e.g. ``max_tokens`` -> ``max_completion_tokens``); an outage is a 503;
    anything else is the server's fault (500), never blamed on the request.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full")
    if isinstance(exc, DistServeError):
        param = exc.param or prompt_param
        param = (param_names or {}).get(param, param)
        code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else None
        return APIError(400, str(exc), param=param, code=code)
    if isinstance(exc, ServiceUnavailableError):
        return _unavailable(str(exc))
    logger.error("request failed: %s: %s", type(exc).__name__, exc)
    return _request_failed(f"{type(exc).__name__}: {exc}")


def _request_failed(message: str) -> APIError:
    return APIError(500, message, type="internal_server_error", code="request_failed")


def _check_output(out: RequestOutput) -> RequestOutput:
    """``out``, unless it reports that its request failed (``finish_reason`` "error"): then a 500."""
    if out.error is not None:
        raise _request_failed(out.error)
    return out


def _validation_param(loc: tuple[Any, ...]) -> str | None:
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


class _Server:
    """Per-app state shared by the route handlers."""

    def __init__(self, client: EngineClient, served_model_name: str, metrics: ServingMetrics) -> None:
        self.client = client
        self.served_model_name = served_model_name
        self.metrics = metrics
        names = {served_model_name, *MODEL_ALIASES.get(served_model_name, ())}
        names.update(MODEL_ALIASES.get(getattr(client, "model_name", ""), ()))
        self.accepted_models = names

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_models:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def start(
        self,
        request: Request,
        prompt: str | list[int],
        sampling: SamplingParams,
        request_id: str,
        priority: int,
        prompt_param: str,
        param_names: dict[str, str] | None = None,
    ) -> tuple[AsyncIterator[RequestOutput], RequestOutput, RequestTimer]:
        """Submit and wait for the first output, so bad input and a full queue become HTTP errors."""
        timer = self.metrics.request_timer()
        stream = self.client.generate(prompt, sampling, request_id, priority)
        try:
            first = _check_output(await _unless_disconnected(request, anext(stream)))
        except ClientDisconnected:
            timer.finish("abort")
            raise
        except Exception as exc:
            await _aclose(stream)
            raise _engine_error(exc, prompt_param, param_names) from exc
        timer.observe(first)
        return stream, first, timer

    async def collect(
        self, request: Request, stream: AsyncIterator[RequestOutput], first: RequestOutput, timer: RequestTimer
    ) -> RequestOutput:
        async def run() -> RequestOutput:
            last = first
            try:
                while not last.finished:
                    last = _check_output(await anext(stream))
                    timer.observe(last)
            finally:
                await _aclose(stream)
            return last

        try:
            return await _unless_disconnected(request, run())
        except ClientDisconnected:
            timer.finish("abort")
            raise
        except Exception as exc:
            raise _engine_error(exc, "prompt") from exc

    def token_text(self, token_id: int) -> str:
        return self.client.tokenizer.decode([token_id], skip_special_tokens=False)

    def new_logprobs(self, out: RequestOutput) -> list[tuple[str, float]]:
        if out.logprobs is None or not out.new_token_ids:
            return []
        lps = out.logprobs[len(out.logprobs) - len(out.new_token_ids) :]
        return [(self.token_text(t), lp) for t, lp in zip(out.new_token_ids, lps)]

    def all_logprobs(self, out: RequestOutput) -> list[tuple[str, float]]:
        if out.logprobs is None:
            return []
        return [(self.token_text(t), lp) for t, lp in zip(out.token_ids, out.logprobs)]


def _prompt_ids(client: EngineClient, prompt: str | list[int]) -> list[int]:
    return client.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _completion_logprobs(pairs: list[tuple[str, float]], offset: int, top: bool) -> CompletionLogprobs:
    offsets: list[int] = []
    for tok, _ in pairs:
        offsets.append(offset)
        offset += len(tok)
    return CompletionLogprobs(
        tokens=[t for t, _ in pairs],
        token_logprobs=[lp for _, lp in pairs],
        top_logprobs=[{t: lp} for t, lp in pairs] if top else None,
        text_offset=offsets,
    )


def _chat_logprobs(pairs: list[tuple[str, float]]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[ChatTokenLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in pairs]
    )


def _usage(out: RequestOutput) -> UsageInfo:
    return UsageInfo.of(len(out.prompt_token_ids), len(out.token_ids))


async def _events(
    stream: AsyncIterator[RequestOutput],
    first: RequestOutput,
    timer: RequestTimer,
    render: Callable[[RequestOutput], list[str]],
    include_usage: bool,
    usage_chunk: Callable[[UsageInfo], str],
) -> AsyncIterator[str]:
    """SSE events for one request; closing this generator early aborts the request."""
    out = first
    failed = False
    try:
        while True:
            for event in render(out):
                yield event
            if out.finished:
                break
            out = _check_output(await anext(stream))
            timer.observe(out)
        if include_usage:
            yield usage_chunk(_usage(out))
        yield SSE_DONE
    except Exception as exc:  # noqa: BLE001 - the status line is sent: the error becomes the last event
        failed = True  # not counted as a finished request
        yield sse(_engine_error(exc, "prompt").body())
        yield SSE_DONE
    finally:
        if not out.finished and not failed:
            timer.finish("abort")
        await _aclose(stream)


def build_fastapi_app(
    client: EngineClient, served_model_name: str, *, metrics: ServingMetrics | None = None
) -> FastAPI:
    """``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health`` and ``/metrics`` over ``client``."""
    app = FastAPI(title="distserve", description="OpenAI-compatible API of a disaggregated LLM server")
    server = _Server(client, served_model_name, metrics or ServingMetrics())
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, f"invalid JSON body: {first.get('ctx', {}).get('error', '')}".strip()))
        param = _validation_param(tuple(first.get("loc", ())))
        lines = (f"{_validation_param(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg', 'invalid')}" for e in errors)
        message = "; ".join(dict.fromkeys(lines))
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.get("/health")
    async def health() -> Response:
        """200 while every phase has a live (or restarting) instance; 503 naming the outage otherwise."""
        try:
            await asyncio.wait_for(client.check_health(), HEALTH_TIMEOUT_S)
        except ServiceUnavailableError as exc:
            return _error_response(_unavailable(str(exc)))
        except asyncio.TimeoutError:
            return _error_response(_unavailable(f"the engine did not answer a health check within {HEALTH_TIMEOUT_S:g} s"))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, root=client.model_name, max_model_len=client.max_model_len)])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            server.metrics.update_engine_stats(await asyncio.wait_for(client.stats(), STATS_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - the request-side metrics are still worth serving
            logger.warning("engine stats unavailable for /metrics: %s", exc)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response | CompletionResponse:
        server.check_model(body.model)
        prompt = body.prompt_input()
        # ``"max_tokens": null`` asks for the rest of the context, which depends on the prompt's length.
        num_prompt_tokens = None if body.max_tokens is not None else len(_prompt_ids(client, prompt))
        sampling = body.to_sampling_params(client.max_model_len, num_prompt_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream, first, timer = await server.start(request, prompt, sampling, request_id, body.priority, "prompt")
        want_logprobs = body.logprobs is not None
        top = bool(body.logprobs)
        if not body.stream:
            out = await server.collect(request, stream, first, timer)
            logprobs = _completion_logprobs(server.all_logprobs(out), 0, top) if want_logprobs else None
            return CompletionResponse(
                id=request_id,
                model=served_model_name,
                choices=[CompletionChoice(text=out.text, logprobs=logprobs, finish_reason=finish_reason(out.finish_reason))],
                usage=_usage(out),
            )
        created = int(time.time())
        emitted = {"chars": 0}

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            c = CompletionChunk(id=request_id, created=created, model=served_model_name, choices=choices, usage=usage)
            return sse(c, include_usage=body.include_usage)

        def render(out: RequestOutput) -> list[str]:
            if not (out.new_text or out.finished or (want_logprobs and out.new_token_ids)):
                return []
            logprobs = _completion_logprobs(server.new_logprobs(out), emitted["chars"], top) if want_logprobs else None
            emitted["chars"] += len(out.new_text)
            return [chunk([CompletionChoice(text=out.new_text, logprobs=logprobs, finish_reason=finish_reason(out.finish_reason))])]

        events = _events(stream, first, timer, render, body.include_usage, lambda u: chunk([], u))
        return _SSEResponse(events)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletionResponse:
        server.check_model(body.model)
        messages = body.chat_messages()
        try:
            prompt = client.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages' fault
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        if len(prompt) >= client.max_model_len:
            raise APIError(
                400,
                f"the messages have {len(prompt)} tokens but the context holds {client.max_model_len} "
                "(at least one output token must fit)",
                param="messages",
                code="context_length_exceeded",
            )
        sampling = body.to_sampling_params(len(prompt), client.max_model_len)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        names = {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else None
        stream, first, timer = await server.start(request, prompt, sampling, request_id, body.priority, "messages", names)
        if not body.stream:
            out = await server.collect(request, stream, first, timer)
            return ChatCompletionResponse(
                id=request_id,
                model=served_model_name,
                choices=[
                    ChatChoice(
                        message=ChatMessageOut(content=out.text),
                        logprobs=_chat_logprobs(server.all_logprobs(out)) if body.logprobs else None,
                        finish_reason=finish_reason(out.finish_reason),
                    )
                ],
                usage=_usage(out),
            )
        created = int(time.time())
        state = {"role_sent": False}

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=served_model_name, choices=choices, usage=usage)
            return sse(c, include_usage=body.include_usage)

        def render(out: RequestOutput) -> list[str]:
            events: list[str] = []
            if not state["role_sent"]:
                state["role_sent"] = True
                events.append(chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]))
            if out.new_text or out.finished or (body.logprobs and out.new_token_ids):
                logprobs = _chat_logprobs(server.new_logprobs(out)) if body.logprobs else None
                delta = ChatDelta(content=out.new_text) if out.new_text else ChatDelta()
                events.append(chunk([ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason(out.finish_reason))]))
            return events

        events = _events(stream, first, timer, render, body.include_usage, lambda u: chunk([], u))
        return _SSEResponse(events)

    return app


def open_listen_socket(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` now (port 0 picks a free one) so a busy port fails before the model loads.

    The socket only listens once uvicorn starts, so early clients are refused rather than left hanging.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidConfigError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def run_server(
    client: EngineClient | Callable[[], Awaitable[EngineClient]],
    served_model_name: str,
    sock: socket.socket,
    *,
    on_ready: Callable[[str], None] | None = None,
    log_level: str = "info",
    slo: SLO | None = None,
) -> int:
    """Serve on the bound ``sock`` with plain uvicorn until SIGINT/SIGTERM, then shut ``client`` down.

    ``client`` may be an async factory, for clients whose tasks must live in the server's event
    loop (the Ray runtime's controller). ``on_ready`` gets the base URL (``http://host:port``)
    once uvicorn accepts connections. Returns the process exit status: 0 after a signal, 1 if the
    engine died for good (``EngineClient.is_dead``) — the server stops then, so that a supervisor
    (systemd, Kubernetes) starts a fresh process instead of leaving one that answers 503 forever.
    """
    import uvicorn

    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host

    async def main() -> int:
        engine_client = client if isinstance(client, EngineClient) else await client()
        app = build_fastapi_app(engine_client, served_model_name, metrics=ServingMetrics(slo=slo))
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5
        )
        server = uvicorn.Server(config)
        try:
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started and on_ready is not None:
                on_ready(f"http://{url_host}:{port}")
            while not task.done():
                if engine_client.is_dead:
                    logger.critical("the engine is dead; stopping the server (exit status 1) so it can be restarted")
                    server.should_exit = True
                    await task
                    return 1
                await asyncio.wait({task}, timeout=ENGINE_WATCH_INTERVAL_S)
            await task
            return 0
        finally:
            await engine_client.shutdown()

    # uvicorn re-raises the signal it caught once it has stopped; a no-op handler makes that a clean exit.
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        return asyncio.run(main())
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
