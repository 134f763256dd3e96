"""Running the HTTP API: binding the port before the model loads, plain uvicorn with the connection limits,
the drain on SIGINT/SIGTERM, and stopping (exit status 1) when the engine is dead for good."""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import threading
from collections.abc import Awaitable, Callable

from distserve.dataflow.limits import DEFAULT_LIMITS, SessionLimits
from distserve.errors import InvalidConfigError
from distserve.runtime.client import EngineClient
from distserve.serving.api import build_fastapi_app
from distserve.serving.api_keys import ApiKeys
from distserve.serving.cors import CorsOptions
from distserve.serving.draining import DrainGate, DrainingServer
from distserve.serving.limits import DEFAULT_HTTP_LIMITS, HttpLimits, uvicorn_config
from distserve.serving.metrics import ServingMetrics
from distserve.serving.metrics_exposition import OWN_PREFIX
from distserve.serving.request_log import RequestLog
from distserve.slo import SLO

logger = logging.getLogger(__name__)

ENGINE_WATCH_INTERVAL_S = 0.5
DEFAULT_SHUTDOWN_GRACE_S = 10.0  # on SIGINT/SIGTERM, for the requests in flight to finish (``serving.draining``)
SHUTDOWN_SLACK_S = 5.0  # then uvicorn cuts what is left


def open_listen_socket(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` now (port 0 picks a free one) so a busy port fails before the model loads.

    The socket only listens once uvicorn starts, so early clients are refused rather than left hanging.
    """
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP, and
    # without it Nagle holds each small write (a response's body after its head, an SSE token after the last)
    # until the client's delayed ACK, ~40 ms later, on every keep-alive connection.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
    session_limits: SessionLimits = DEFAULT_LIMITS,
    api_keys: ApiKeys | None = None,
    request_log: RequestLog | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    metrics_prefix: str = OWN_PREFIX,
    chat_template: str | None = None,
    cors: CorsOptions | None = None,
    http_limits: HttpLimits = DEFAULT_HTTP_LIMITS,
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
) -> int:
    """Serve on the bound ``sock`` with plain uvicorn until SIGINT/SIGTERM, then shut ``client`` down.

    ``client`` may be an async factory, for clients whose tasks must live in the server's event
    loop (the Ray runtime's controller). ``on_ready`` gets the base URL (``http://host:port``)
    once uvicorn accepts connections. Returns the process exit status: 0 after a signal, 1 if the
    engine died for good (``EngineClient.is_dead``) — the server stops then, so that a supervisor
    (systemd, Kubernetes) starts a fresh process instead of leaving one that answers 503 forever.
    On a signal it answers new requests 503 at once, gives the requests in flight ``shutdown_grace_s``
    to finish and then fails the rest clearly (an SSE error event), then stops (``serving.draining``).
    ``request_log``: where each finished request is written (closed when the server stops).
    ``metrics_prefix``: of the series vLLM also exports (``serving.metrics_exposition``); ``http_limits``:
    ``serving.limits``, on the app and on uvicorn's connections.
    """
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host

    async def main() -> int:
        engine_client = client if isinstance(client, EngineClient) else await client()
        if in_main:  # ray.init installs a SIGTERM handler that exits with status 15 when uvicorn re-raises the signal
            signal.signal(signal.SIGTERM, lambda *_: None)
        metrics = ServingMetrics(slo=slo, tenants=api_keys.tenant_names if api_keys else (), request_log=request_log,
                                 prefix=metrics_prefix, model_name=served_model_name)
        app = build_fastapi_app(engine_client, served_model_name, metrics=metrics, session_limits=session_limits, api_keys=api_keys,
                                tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                                chat_template=chat_template, cors=cors, http_limits=http_limits)
        gate = DrainGate(app)
        config = uvicorn_config(gate, http_limits, host=host, port=port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=math.ceil(SHUTDOWN_SLACK_S))
        server = DrainingServer(config, gate)
        drain: asyncio.Task[bool] | None = None  # once signalled: waits for the requests in flight, fails what outlasts the grace

        try:
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started and on_ready is not None:
                on_ready(f"http://{url_host}:{port}")
            while not task.done():
                if engine_client.is_dead and drain is None:  # not the shutdown of the grace period
                    logger.critical("the engine is dead; stopping the server (exit status 1) so it can be restarted")
                    server.should_exit = True
                    await task
                    return 1
                if server.signalled_at is not None and drain is None:
                    drain = asyncio.create_task(server.drain(shutdown_grace_s, engine_client.shutdown))
                await asyncio.wait({task}, timeout=ENGINE_WATCH_INTERVAL_S)
            await task
            return 0
        finally:
            if drain is not None and not drain.done():
                drain.cancel()
                await asyncio.gather(drain, return_exceptions=True)
            if drain is None or drain.cancelled() or drain.exception() is not None or not drain.result():
                await engine_client.shutdown()  # unless the drain did

    # uvicorn re-raises the signal it caught once it has stopped; a no-op handler makes that a clean exit.
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        return asyncio.run(main())
    finally:
        sock.close()
        if request_log is not None:
            request_log.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
