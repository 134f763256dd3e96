"""The OpenAI-compatible HTTP API (FastAPI) over any ``EngineClient``: its routes (``serving.server`` runs them).

How engine failures become HTTP errors is in ``serving.http_errors``; how outputs stream to the client
(SSE, aborting on disconnect) in ``serving.streams``; request bodies and their ``SamplingParams`` in
``serving.protocol``; API keys and the tenant of a request in ``serving.auth`` (each request reaches
the engine with its tenant and tier in its ``RequestClass``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Scope

from distserve.cluster.classes import RequestClass
from distserve.config import SamplingParams
from distserve.engine.outputs import RequestOutput
from distserve.errors import DistServeError, InvalidConfigError, ServiceUnavailableError
from distserve.runtime.client import EngineClient
from distserve.dataflow.limits import DEFAULT_LIMITS, SessionLimits
from distserve.dataflow.sessions import SessionManager
from distserve.serving.api_keys import ApiKeys
from distserve.serving.auth import ApiKeyAuth, owner_of, tenant_of
from distserve.serving.cors import CorsOptions, add_cors
from distserve.serving.dataflow_routes import add_dataflow_routes
from distserve.serving.limits import DEFAULT_HTTP_LIMITS, HttpLimits, add_request_limits
from distserve.serving.http_errors import (
    ClientDisconnected,
    add_error_handlers,
    check_output,
    engine_error,
    error_response,
    unavailable,
)
from distserve.serving.metrics import CONTENT_TYPE, MetricsPeers, RequestTimer, ServingMetrics, rejection_reason
from distserve.serving.logprobs import LogprobsRenderer
from distserve.serving.metrics_exposition import OWN_PREFIX
from distserve.serving.overload_gate import OverloadDoor, OverloadGate
from distserve.serving.ops_routes import add_ops_routes
from distserve.serving.prompts import chat_prompt, text_prompt, truncate
from distserve.serving.request_fields import check_request_fields
from distserve.serving.request_ids import InFlightIds, RequestIdHeader
from distserve.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from distserve.serving.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    finish_reason,
    sse,
)
from distserve.serving.tool_parsers import ForcedToolCallParser, ParsedToolCall, ToolCallStream, get_tool_parser
from distserve.serving.streams import SSEResponse, aclose_stream, sse_events, unless_disconnected

logger = logging.getLogger(__name__)

MODEL_ALIASES: dict[str, tuple[str, ...]] = {"smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct",)}
STATS_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 5.0


class Started(NamedTuple):
    """A request the engine took: its id (``serving.request_ids``), its outputs' stream and the first output."""

    request_id: str
    stream: AsyncIterator[RequestOutput]
    first: RequestOutput
    timer: RequestTimer


class _Server:
    """Per-app state shared by the route handlers."""

    def __init__(self, client: EngineClient, served_model_name: str, metrics: ServingMetrics) -> None:
        self.client = client
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.request_ids = InFlightIds()
        names = {served_model_name, *MODEL_ALIASES.get(served_model_name, ())}
        names.update(MODEL_ALIASES.get(getattr(client, "model_name", ""), ()))
        self.accepted_models = names
        self.logprobs = LogprobsRenderer(client.tokenizer)
        self.overload = OverloadGate()

    def refused_at_the_door(self, scope: Scope) -> None:
        """``OverloadDoor`` refused a request while the gate was shut: counted as queue_full for its tenant."""
        self.metrics.reject(tenant_of(Request(scope)).name, "queue_full")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_models:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def start(
        self,
        request: Request,
        prompt: str | list[int],
        sampling: SamplingParams,
        id_prefix: str,
        body_request_id: str | None,
        priority: int,
        timeout_s: float | None,
        prompt_param: str,
        param_names: dict[str, str] | None = None,
    ) -> Started:
        """Submit for the request's tenant (under its client's id, ``serving.request_ids``) and wait for the
        first output, so bad input and a full queue become HTTP errors."""
        tenant = tenant_of(request)
        timer = self.metrics.request_timer(tenant=tenant.name, sampling=sampling)
        request_id = self.request_ids.request_id(request, id_prefix, body_request_id)
        stream = self.request_ids.held_by(
            self.client.generate(prompt, sampling, request_id, priority,
                                 request_class=RequestClass(tenant=tenant.name, tier=tenant.tier), timeout_s=timeout_s),
            request_id,
        )
        try:
            first = check_output(await unless_disconnected(request, anext(stream)))
        except ClientDisconnected:
            self.request_ids.release(request_id)  # the stream may have been cancelled before it started
            timer.finish("abort")
            raise
        except Exception as exc:
            await aclose_stream(stream)
            self.request_ids.release(request_id)
            self.overload.observe(exc)
            error = engine_error(exc, prompt_param, param_names)
            timer.reject(rejection_reason(error.status_code))
            raise error from exc
        timer.admitted()
        timer.observe(first)
        return Started(request_id, stream, first, timer)

    async def collect(
        self, request: Request, stream: AsyncIterator[RequestOutput], first: RequestOutput, timer: RequestTimer
    ) -> list[RequestOutput]:
        """The last output of each completion (one unless ``n`` > 1), by index."""
        async def run() -> list[RequestOutput]:
            last = {first.index: first}
            out = first
            try:
                while not out.finished:
                    out = check_output(await anext(stream))
                    timer.observe(out)
                    last[out.index] = out
            finally:
                await aclose_stream(stream)
            return [last[i] for i in sorted(last)]

        try:
            return await unless_disconnected(request, run())
        except ClientDisconnected:
            timer.finish("abort")
            raise
        except Exception as exc:
            timer.fail()
            raise engine_error(exc, "prompt") from exc

    async def check_structured(self, sampling: SamplingParams, request: Request) -> None:
        """Compile the request's grammar (cached) in the compiler's threads, not the engine's, for the request's
        tenant or client (``GrammarCompiler.check_async``): a bad or too complex one is a 400 naming its field,
        one refused because the compile threads are busy a 429."""
        spec = sampling.structured
        if spec is None:
            return
        compiler = self.client.grammar_compiler
        if compiler is None:
            raise APIError(400, "this server does not serve structured output", param=spec.param)
        try:
            await compiler.check_async(spec, owner_of(request))
        except DistServeError as exc:
            raise engine_error(exc, spec.param) from exc


def _prompt_ids(client: EngineClient, prompt: str | list[int]) -> list[int]:
    return client.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt


def _usage(outs: list[RequestOutput]) -> UsageInfo:
    """The prompt counted once (it was prefilled once), the completions' tokens summed."""
    return UsageInfo.of(len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs))


class _Usage:
    """A stream's usage so far: the prompt once, each completion's tokens."""

    def __init__(self) -> None:
        self.last: dict[int, RequestOutput] = {}

    def observe(self, out: RequestOutput) -> None:
        self.last[out.index] = out

    def info(self) -> UsageInfo:
        return _usage(list(self.last.values()))


def _tool_call_out(call: ParsedToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


def build_fastapi_app(
    client: EngineClient, served_model_name: str, *, metrics: ServingMetrics | None = None,
    session_limits: SessionLimits = DEFAULT_LIMITS, api_keys: ApiKeys | None = None,
    tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False, metrics_prefix: str = OWN_PREFIX,
    chat_template: str | None = None, cors: CorsOptions | None = None, metrics_peers: MetricsPeers | None = None,
    http_limits: HttpLimits = DEFAULT_HTTP_LIMITS,
) -> FastAPI:
    """``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health`` and ``/metrics`` over ``client``,
    vLLM's ``/tokenize``, ``/detokenize``, ``/version`` and ``/ping`` (``serving.ops_routes``), and the
    semantic-variable routes. With ``api_keys`` every route but ``/health``, ``/ping`` and ``/metrics``
    needs a tenant's key (``serving.auth``); without, every request is the anonymous tenant's.
    ``tool_call_parser`` (``serving.tool_parsers``) and ``enable_auto_tool_choice``: vLLM's
    ``--tool-call-parser`` and ``--enable-auto-tool-choice``, which ``tool_choice: "auto"`` needs.
    ``metrics_prefix``: of the ``ServingMetrics`` made here when ``metrics`` is None (``--metrics-prefix``);
    a ``metrics`` without a ``model_name`` gets ``served_model_name``.
    ``chat_template``: a Jinja chat template in place of the tokenizer's (``--chat-template``); ``cors``:
    ``serving.cors`` (None: no CORS headers). ``metrics_peers``: the other servers over the same engine
    (Ray Serve replicas), whose request-side series ``/metrics`` adds to this one's. ``http_limits``: body size,
    header count and read time (``serving.limits``)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise InvalidConfigError("--enable-auto-tool-choice needs --tool-call-parser", "tool_call_parser")
    try:
        tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    except ValueError as exc:
        raise InvalidConfigError(f"--tool-call-parser: {exc}", "tool_call_parser") from exc
    app = FastAPI(title="distserve", description="OpenAI-compatible API of a disaggregated LLM server")
    if metrics is None:
        metrics = ServingMetrics(tenants=api_keys.tenant_names if api_keys else (), prefix=metrics_prefix, model_name=served_model_name)
    metrics.model_name = metrics.model_name or served_model_name
    server = _Server(client, served_model_name, metrics)
    app.state.server = server
    add_error_handlers(app)
    app.add_middleware(OverloadDoor, gate=server.overload, on_refuse=server.refused_at_the_door)  # innermost: the tenant is known
    if api_keys is not None:
        app.add_middleware(ApiKeyAuth, keys=api_keys, metrics=server.metrics)
    add_request_limits(app, http_limits)  # outside the key check: a body is bounded before anything else runs
    app.add_middleware(RequestIdHeader)  # outside the key check: a 401 carries the id too
    if cors is not None:
        add_cors(app, cors)  # outermost: preflights carry no key
    app.state.sessions = SessionManager(client, session_limits)
    add_dataflow_routes(app, app.state.sessions, {served_model_name, client.model_name}, server.metrics)

    @app.get("/health")
    async def health() -> Response:
        """200 while every phase has a live (or restarting) instance; 503 naming the outage otherwise."""
        try:
            await asyncio.wait_for(client.check_health(), HEALTH_TIMEOUT_S)
        except ServiceUnavailableError as exc:
            return error_response(unavailable(str(exc)))
        except asyncio.TimeoutError:
            return error_response(unavailable(f"the engine did not answer a health check within {HEALTH_TIMEOUT_S:g} s"))
        return JSONResponse({"status": "ok"})

    add_ops_routes(app, client, server.check_model, chat_template, served_model_name, health)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, root=client.model_name, max_model_len=client.max_model_len)])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            server.metrics.update_engine_stats(await asyncio.wait_for(client.stats(), STATS_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - the request-side metrics are still worth serving
            logger.warning("engine stats unavailable for /metrics: %s", exc)
        if metrics_peers is not None:
            try:
                await asyncio.wait_for(server.metrics.exchange(metrics_peers), STATS_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the peers' previous figures are served instead
                logger.warning("the other replicas' metrics are unavailable for /metrics: %s", exc)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response | CompletionResponse:
        check_request_fields(body)
        server.check_model(body.model)
        # Tokenizing is done in a thread: a long prompt takes seconds, and the event loop serves everyone.
        prompt = await asyncio.to_thread(text_prompt, client.tokenizer, body.prompt_input(), body.add_special_tokens,
                                         body.truncate_prompt_tokens, client.max_model_len)
        # ``"max_tokens": null`` asks for the rest of the context, which depends on the prompt's length.
        num_prompt_tokens = None if body.max_tokens is not None else len(await asyncio.to_thread(_prompt_ids, client, prompt))
        sampling = body.to_sampling_params(client.max_model_len, num_prompt_tokens)
        await server.check_structured(sampling, request)
        request_id, stream, first, timer = await server.start(request, prompt, sampling, "cmpl", body.request_id, body.priority,
                                                              body.timeout, "prompt",
                                                              {"top_logprobs": "logprobs"})
        want_logprobs = body.logprobs is not None
        k = body.logprobs or 0
        fmt = server.logprobs
        # vLLM's echo: the prompt as given, or decoded when given as token ids.
        echo_text = (prompt if isinstance(prompt, str) else client.tokenizer.decode(prompt)) if body.echo else ""
        if not body.stream:
            outs = await server.collect(request, stream, first, timer)
            choices = []
            for out in outs:
                entries = (fmt.prompt_entries(out) if body.echo else []) + fmt.output_entries(out)
                choices.append(CompletionChoice(
                    index=out.index, text=echo_text + out.text, finish_reason=finish_reason(out.finish_reason),
                    logprobs=fmt.completion(entries, 0, k) if want_logprobs else None,
                    prompt_logprobs=fmt.prompt_logprobs(out, body.prompt_logprobs) if body.prompt_logprobs is not None else None,
                ))
            return CompletionResponse(id=request_id, model=served_model_name, choices=choices, usage=_usage(outs))
        created = int(time.time())
        emitted: dict[int, int] = {}  # chars streamed per completion (its echoed prompt's included)
        usage = _Usage()

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            c = CompletionChunk(id=request_id, created=created, model=served_model_name, choices=choices, usage=usage)
            return sse(c, include_usage=body.include_usage)

        def render(out: RequestOutput) -> list[str]:
            usage.observe(out)
            done = out.finish_reason is not None  # this completion ended (the request: ``out.finished``)
            starts = out.index not in emitted  # its first chunk carries the echoed prompt
            if not (out.new_text or done or (want_logprobs and out.new_token_ids) or (starts and body.echo)):
                return []
            offset = emitted.get(out.index, 0)
            text = echo_text + out.new_text if starts else out.new_text
            logprobs = None
            if want_logprobs:
                entries = (fmt.prompt_entries(out) if starts and body.echo else []) + fmt.output_entries(out, new_only=True)
                logprobs = fmt.completion(entries, offset, k)
            emitted[out.index] = offset + len(text)
            return [chunk([CompletionChoice(index=out.index, text=text, logprobs=logprobs,
                                            finish_reason=finish_reason(out.finish_reason))])]

        events = sse_events(stream, first, timer, render, body.include_usage, lambda _: chunk([], usage.info()))
        return SSEResponse(events)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletionResponse:
        check_request_fields(body)
        server.check_model(body.model)
        mode = body.tool_mode(enable_auto_tool_choice)
        parser = tool_parser if mode == "auto" else ForcedToolCallParser(body.forced_function) if mode == "forced" else None
        prompt = truncate(await asyncio.to_thread(chat_prompt, client.tokenizer, body, chat_template, served_model_name,
                                                  client.max_model_len), body.truncate_prompt_tokens, client.max_model_len)
        one_call = body.parallel_tool_calls is False
        if len(prompt) >= client.max_model_len:
            raise APIError(
                400,
                f"the messages have {len(prompt)} tokens but the context holds {client.max_model_len} "
                "(at least one output token must fit)",
                param="messages",
                code="context_length_exceeded",
            )
        sampling = body.to_sampling_params(len(prompt), client.max_model_len)
        await server.check_structured(sampling, request)
        names = {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else None
        request_id, stream, first, timer = await server.start(request, prompt, sampling, "chatcmpl", body.request_id, body.priority,
                                                              body.timeout, "messages", names)
        fmt, k = server.logprobs, body.top_logprobs or 0
        if not body.stream:
            outs = await server.collect(request, stream, first, timer)
            choices = []
            for out in outs:
                content: str | None = out.text
                calls: list[ParsedToolCall] = []
                if parser is not None:
                    extracted = parser.extract(out.text)
                    content, calls = extracted.content, extracted.tool_calls[:1] if one_call else extracted.tool_calls
                choices.append(ChatChoice(
                    index=out.index,
                    message=ChatMessageOut(content=content, tool_calls=[_tool_call_out(c) for c in calls]),
                    logprobs=fmt.chat(fmt.output_entries(out), k) if body.logprobs else None,
                    finish_reason="tool_calls" if calls else finish_reason(out.finish_reason),
                ))
            prompt_logprobs = fmt.prompt_logprobs(outs[0], body.prompt_logprobs) if body.prompt_logprobs is not None else None
            return ChatCompletionResponse(id=request_id, model=served_model_name, choices=choices, usage=_usage(outs),
                                          prompt_logprobs=prompt_logprobs)
        created = int(time.time())
        role_sent: set[int] = set()  # completions whose first chunk (the role) is out
        usage = _Usage()
        tool_streams: dict[int, ToolCallStream] = {}

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=served_model_name, choices=choices, usage=usage)
            return sse(c, include_usage=body.include_usage)

        def render(out: RequestOutput) -> list[str]:
            usage.observe(out)
            events: list[str] = []
            if out.index not in role_sent:
                role_sent.add(out.index)
                events.append(chunk([ChatChunkChoice(index=out.index, delta=ChatDelta(role="assistant", content=""))]))
            done = out.finish_reason is not None  # this completion ended
            text = out.new_text
            calls: list[ParsedToolCall] = []
            if parser is not None:  # content streams until a call may start; calls are sent whole at the end
                tool_stream = tool_streams.setdefault(out.index, ToolCallStream(parser))
                text = tool_stream.feed(out.new_text)
                if done:
                    rest, calls = tool_stream.finish()
                    text += rest
                    calls = calls[:1] if one_call else calls
            if text or (done and not calls) or (body.logprobs and out.new_token_ids):
                logprobs = fmt.chat(fmt.output_entries(out, new_only=True), k) if body.logprobs else None
                delta = ChatDelta(content=text) if text else ChatDelta()
                events.append(chunk([ChatChunkChoice(index=out.index, delta=delta, logprobs=logprobs,
                                                     finish_reason=None if calls else finish_reason(out.finish_reason))]))
            if calls:
                deltas = [DeltaToolCall(index=k, id=c.id, type="function", function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                          for k, c in enumerate(calls)]
                events.append(chunk([ChatChunkChoice(index=out.index, delta=ChatDelta(tool_calls=deltas))]))
                events.append(chunk([ChatChunkChoice(index=out.index, delta=ChatDelta(), finish_reason="tool_calls")]))
            return events

        events = sse_events(stream, first, timer, render, body.include_usage, lambda _: chunk([], usage.info()))
        return SSEResponse(events)

    return app
