"""Parrot's public v1 API (semantic variables) on the same app and port as the OpenAI API.

Routes, with Parrot's JSON fields (its clients send them as a JSON body, also on GET and DELETE;
query parameters work too, for curl):

* ``POST /v1/session`` → ``{session_id, session_auth}``; ``GET|DELETE /v1/session/{id}`` (get:
  counts of variables, calls by state, and reads waiting)
* ``POST /v1/semantic_call`` (``session_id``, ``session_auth``, ``template``, ``placeholders`` or
  ``parameters``, ``models``, ``model_type``, ``remove_pure_fill``, ``cache_prefix``,
  ``output_criteria``, ``fuse_fill``, ``func_name``) → ``{request_id, call_id, session_id,
  param_info}`` (``request_id`` an integer, as Parrot's clients parse it; ``param_info`` also as
  ``placeholders_mapping``, the older name; each entry names its placeholder both as
  ``placeholder_name``, Parrot's server's key, and ``parameter_name``, its frontend's): the
  variable of every placeholder. An output placeholder with a ``var_id`` is generated into that
  created variable (400 if it already has a producer or a value), so calls can be submitted
  before the calls producing their inputs
* ``POST /v1/semantic_var`` (``var_name``) → ``{var_id}``; ``POST /v1/semantic_var/{id}``
  (``content``) sets it; ``GET /v1/semantic_var/{id}`` (``criteria``, optional ``timeout``)
  waits for its value → ``{content}``; ``GET /v1/semantic_var`` lists the session's variables
* ``GET /v1/semantic_var/{id}/stream`` (same fields as get; ours, not Parrot's): Server-Sent
  Events — ``{"var_id", "delta"}`` as the producing call generates the output (a late reader
  first gets all text so far), then ``{"var_id", "content"}`` with the value, then ``[DONE]``;
  on failure or timeout an ``{"error": {...}, "status": 424|408}`` event before ``[DONE]``. It is
  the output's raw generation: transforms apply where a call reads the variable, never here.
  A reader disconnecting does not stop the call. ``: keep-alive`` comments every 15 s of silence.
* ``POST /v1/py_native_call`` → 400: we never execute client code

Errors use the OpenAI error body: 400 naming the ``param``, 403 for a wrong ``session_auth``,
404 for an unknown session or variable (or a session ended under the request, or another tenant's
session: with API keys a tenant sees only its own sessions and their variables), 408 when a read
times out, 413 for a value or template over ``max_value_chars``, 424 when the variable's call (or
one upstream) failed — its message names that call — and 429 when a ``SessionLimits`` count is
reached (sessions of the server or of the tenant, variables per session, unfinished calls per
session). ``cache_prefix``,
``fuse_fill`` and ``remove_pure_fill`` are accepted: prefixes are always cached, and fills are
never sent alone. Idle sessions are ended by a background sweep started with the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from distserve.cluster.classes import RequestClass
from distserve.dataflow.executor import CallMeter, DataflowSession, SessionEnded, VariableFailed
from distserve.dataflow.graph import UnknownVariable, VariableTaken, check_criteria
from distserve.dataflow.limits import LimitExceeded, ValueTooLarge
from distserve.dataflow.sessions import SessionForbidden, SessionManager, SessionNotFound
from distserve.dataflow.template import parse_call
from distserve.engine.outputs import RequestOutput
from distserve.errors import DataflowError
from distserve.serving.auth import tenant_of
from distserve.serving.http_errors import check_output, engine_error
from distserve.serving.metrics import ServingMetrics, rejection_reason
from distserve.serving.protocol import APIError
from distserve.serving.responses import SSE_DONE, sse
from distserve.serving.streams import SSEResponse, aclose_stream

MAX_GET_TIMEOUT_S = 3600.0
STREAM_KEEPALIVE_S = 15.0
_READ_ERRORS = (TimeoutError, asyncio.TimeoutError, DataflowError)  # what a get or stream answers as a 4xx
_CALL_FIELDS = {
    "session_id", "session_auth", "template", "placeholders", "parameters", "models", "model_type",
    "remove_pure_fill", "cache_prefix", "output_criteria", "fuse_fill", "func_name",
}


def add_dataflow_routes(
    app: FastAPI, sessions: SessionManager, served_model_names: set[str], metrics: ServingMetrics | None = None
) -> None:
    """Mount the semantic-variable API on ``app``; ``sessions`` run their calls on the app's engine
    for the tenant of the request (``serving.auth``). ``metrics`` count sessions refused by a limit
    and, in the per-tenant series, the requests of the sessions' calls (``call_meter``).

    The app's lifespan also runs ``sessions.sweep_forever`` (idle sessions ended in the background)
    and ends every session at shutdown.
    """
    run_sweeper_with_app(app, sessions)

    async def session_of(request: Request, payload: Mapping[str, Any], require_token: bool = True, hint: str = "") -> DataflowSession:
        try:
            return await sessions.get(payload.get("session_id"), payload.get("session_auth"), require_token, tenant_of(request).name)
        except SessionNotFound as exc:
            raise APIError(404, str(exc), param="session_id", type="not_found_error") from None
        except SessionForbidden as exc:
            missing = hint if payload.get("session_auth") is None else ""
            raise APIError(403, f"{exc}{missing}", param="session_auth", type="permission_error") from None

    @app.post("/v1/session")
    async def register_session(request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        try:
            session_id, token = await sessions.create(tenant)
        except LimitExceeded as exc:
            if metrics is not None:
                metrics.reject(tenant.name, "session_limit")
            raise as_api_error(exc) from None
        if metrics is not None:
            (await sessions.get(session_id, token, tenant=tenant.name)).meter = call_meter(metrics)
        return JSONResponse({"session_id": int(session_id), "session_auth": token})

    @app.get("/v1/session/{session_id}")
    async def session_info(session_id: str, request: Request) -> JSONResponse:
        session = await session_of(request, {**await body(request), "session_id": session_id})
        calls = session.graph.calls.values()
        return JSONResponse({
            "session_id": int(session_id), "num_variables": len(session.graph.variables), "num_calls": len(calls),
            "num_readers": session.num_readers,
            "calls": {state: sum(1 for c in calls if c.state.value == state) for state in ("waiting", "running", "done", "failed")},
        })

    @app.delete("/v1/session/{session_id}")
    async def remove_session(session_id: str, request: Request) -> JSONResponse:
        payload = {**await body(request), "session_id": session_id}
        await session_of(request, payload)  # 404/403 first
        await sessions.delete(session_id, payload.get("session_auth"), tenant_of(request).name)
        return JSONResponse({})

    @app.post("/v1/semantic_call")
    async def submit_semantic_call(request: Request) -> JSONResponse:
        payload = await body(request)
        session = await session_of(request, payload, require_token=sessions.limits.require_auth_on_calls, hint=(
            " (it is missing: Parrot's released frontend sends calls without it; a server started with"
            " --parrot-unauthenticated-calls accepts them)"))
        unknown = sorted(set(payload) - _CALL_FIELDS)
        if unknown:
            raise APIError(400, f"unknown fields {unknown}", param=unknown[0])
        check_metadata(payload, served_model_names)
        placeholders = payload.get("placeholders", payload.get("parameters"))
        call = await guarded_sync(lambda: parse_call(
            payload.get("template"), placeholders, model_type=payload.get("model_type", "token_id"), limits=sessions.limits))
        criteria = payload.get("output_criteria")
        node = await guarded_sync(lambda: session.submit(call, criteria))
        info = [
            {"placeholder_name": name, "parameter_name": name, "is_output": ph.is_output, "var_name": var.name, "var_id": var.var_id,
             "var_desc": f"{'output' if ph.is_output else 'input'} {name} of call {node.call_id}", "var_scope": "session"}
            for name, ph in call.placeholders.items()
            if (var := (node.outputs.get(name) or node.inputs.get(name))) is not None and not isinstance(var, str)
        ]
        return JSONResponse({"request_id": node.number, "call_id": node.call_id, "session_id": int(payload["session_id"]),
                             "param_info": info, "placeholders_mapping": info})

    @app.post("/v1/py_native_call")
    async def py_native_call() -> JSONResponse:
        raise APIError(400, "native (Python) calls are not supported: the server never executes client code; "
                            "use declarative transforms on a call's inputs instead", param="py_native_call")

    @app.post("/v1/semantic_var")
    async def register_variable(request: Request) -> JSONResponse:
        payload = await body(request)
        session = await session_of(request, payload)
        name = payload.get("var_name", "var")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise APIError(400, "var_name must be a non-empty string of at most 256 characters", param="var_name")
        var = await guarded_sync(lambda: session.graph.new_variable(name))
        return JSONResponse({"var_id": var.var_id})

    @app.post("/v1/semantic_var/{var_id}")
    async def set_variable(var_id: str, request: Request) -> JSONResponse:
        payload = await body(request)
        session = await session_of(request, payload)
        await guarded(session.set(var_id, payload.get("content")))
        return JSONResponse({})

    @app.get("/v1/semantic_var/{var_id}")
    async def get_variable(var_id: str, request: Request) -> JSONResponse:
        payload = await body(request)
        session = await session_of(request, payload)
        criteria, timeout = read_fields(payload)
        try:
            content = await session.get(var_id, criteria, timeout)
        except _READ_ERRORS as exc:
            raise read_error(exc, var_id, timeout) from None
        return JSONResponse({"content": content})

    @app.get("/v1/semantic_var/{var_id}/stream", response_model=None)
    async def stream_variable(var_id: str, request: Request) -> SSEResponse:
        payload = await body(request)
        session = await session_of(request, payload)
        criteria, timeout = read_fields(payload)
        await guarded_sync(lambda: session.graph.variable(var_id))  # an unknown variable is a 404 before the stream starts
        return SSEResponse(variable_events(session, var_id, criteria, timeout))

    @app.get("/v1/semantic_var")
    async def list_variables(request: Request) -> JSONResponse:
        session = await session_of(request, await body(request))
        return JSONResponse({"variables": [
            {"var_id": v.var_id, "var_name": v.name, "state": v.state.value,
             "producer": v.producer.call_id if v.producer is not None else None}
            for v in session.graph.variables.values()
        ]})


def call_meter(metrics: ServingMetrics) -> CallMeter:
    """Counts a semantic call's request in ``metrics`` as an OpenAI route counts its own: admitted or
    rejected (by the status its error would have), TTFT, tokens and end, under its tenant and objective."""

    async def meter(stream: AsyncIterator[RequestOutput], request_class: RequestClass) -> AsyncIterator[RequestOutput]:
        timer = metrics.request_timer(objective=request_class.objective, tenant=request_class.tenant)
        started = False

        def failed(status_code: int) -> None:
            if started:
                timer.fail()
            else:
                timer.reject(rejection_reason(status_code))

        try:
            async for out in stream:
                try:
                    check_output(out)
                except APIError as exc:
                    failed(exc.status_code)
                    yield out
                    return
                if not started:
                    started = True
                    timer.admitted()
                timer.observe(out)
                yield out
        except Exception as exc:  # refused or failed: counted, then the call sees it as before
            failed(engine_error(exc, "template").status_code)
            raise
        finally:
            if not timer.done:
                timer.finish("abort")  # the session ended under it
            await aclose_stream(stream)

    return meter


async def body(request: Request) -> dict[str, Any]:
    """The JSON body (Parrot sends one on every method) merged over the query parameters."""
    payload: dict[str, Any] = dict(request.query_params)
    raw = await request.body()
    if raw.strip():
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"the body is not JSON: {exc.msg}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        payload.update(data)
    return payload


def check_metadata(payload: Mapping[str, Any], served: set[str]) -> None:
    models = payload.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise APIError(400, "models must be a list of model names", param="models")
    if models and not set(models) & served:
        raise APIError(404, f"none of the models {models} is served here (serving {sorted(served)})", param="models", type="not_found_error")
    for flag in ("remove_pure_fill", "cache_prefix", "fuse_fill"):
        if flag in payload and not isinstance(payload[flag], bool):
            raise APIError(400, f"{flag} must be true or false", param=flag)
    if payload.get("output_criteria") is not None and payload["output_criteria"] not in ("latency", "throughput"):
        raise APIError(400, "output_criteria must be 'latency', 'throughput' or null", param="output_criteria")


def read_fields(payload: Mapping[str, Any]) -> tuple[str, float | None]:
    """A read's ``criteria`` (default latency) and ``timeout`` in seconds (None: wait as long as it takes)."""
    criteria = payload.get("criteria", "latency")
    timeout = payload.get("timeout")
    if timeout is not None:
        try:
            timeout = float(timeout)
        except (TypeError, ValueError):
            raise APIError(400, f"timeout must be a number of seconds, got {timeout!r}", param="timeout") from None
        if not 0 < timeout <= MAX_GET_TIMEOUT_S:
            raise APIError(400, f"timeout must be in (0, {MAX_GET_TIMEOUT_S:g}] seconds", param="timeout")
    try:
        return check_criteria(criteria), timeout
    except DataflowError as exc:
        raise as_api_error(exc) from None


def read_error(exc: BaseException, var_id: str, timeout: float | None) -> APIError:
    if isinstance(exc, VariableFailed):
        return APIError(424, str(exc), param="var_id", type="failed_dependency")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return APIError(408, f"variable {var_id} has no value after {timeout or 0:g} s", param="timeout", type="timeout_error")
    assert isinstance(exc, DataflowError)
    return as_api_error(exc)


async def variable_events(session: DataflowSession, var_id: str, criteria: str, timeout: float | None) -> AsyncIterator[str]:
    """The SSE events of one variable stream (see the module docstring); closing them leaves the call running."""
    deltas = session.stream(var_id, criteria, timeout, heartbeat_s=STREAM_KEEPALIVE_S)
    try:
        async for delta in deltas:
            yield sse({"var_id": var_id, "delta": delta}) if delta else ": keep-alive\n\n"
        yield sse({"var_id": var_id, "content": session.graph.variable(var_id).value})
    except _READ_ERRORS as exc:
        err = read_error(exc, var_id, timeout)
        yield sse({**err.body(), "status": err.status_code})
    finally:
        await deltas.aclose()
    yield SSE_DONE


def run_sweeper_with_app(app: FastAPI, sessions: SessionManager) -> None:
    """Wrap ``app``'s lifespan: the idle-session sweep runs while the app does; sessions end at shutdown."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(owner: Any) -> AsyncIterator[Any]:
        sweeper = asyncio.create_task(sessions.sweep_forever(), name="dataflow-session-sweep")
        try:
            async with inner(owner) as state:
                yield state
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await sessions.close()

    app.router.lifespan_context = lifespan


def as_api_error(exc: DataflowError) -> APIError:
    if isinstance(exc, (UnknownVariable, SessionEnded)):
        return APIError(404, str(exc), param=exc.param, type="not_found_error")
    if isinstance(exc, LimitExceeded):
        return APIError(429, str(exc), param=exc.param, type="rate_limit_error", code="limit_exceeded")
    if isinstance(exc, ValueTooLarge):
        return APIError(413, str(exc), param=exc.param, code="value_too_large")
    if isinstance(exc, VariableTaken):
        return APIError(409, str(exc), param=exc.param, type="conflict_error", code="variable_taken")
    return APIError(400, str(exc), param=exc.param)


async def guarded(awaitable: Any) -> Any:
    try:
        return await awaitable
    except DataflowError as exc:
        raise as_api_error(exc) from None


async def guarded_sync(fn: Any) -> Any:
    try:
        return fn()
    except DataflowError as exc:
        raise as_api_error(exc) from None
