"""Ray Serve application: any Placement (TP/PP, xPyD, a plan's JSON) behind ingress replicas that share one controller.

``serve run examples/serve_config.yaml``, ``serve run distserve.serving.app:build_app model=tiny placement=plan.json``
or ``distserve serve --ray-serve``. The app's args are a ``ServeAppConfig`` (``serving.app_config``), resolved
when the app is built. Every ingress replica attaches to one named, detached ``ControllerActor``
(get-or-create by ``ServeApp.controller_name``), which deploys the placement once: requests through any
replica share one admission queue and one KV pool. A replica is the FastAPI app of ``serving.api`` over
its handle on that controller; the last replica to stop tears the deployment down, and a controller
whose replicas all died tears itself down (``runtime.controller_actor``).

``/metrics`` on any replica shows the whole app: the engine's series come from the shared controller
(every instance), and the request-side series are summed over the replicas — each replica publishes
its own to the controller every ``METRICS_PUBLISH_INTERVAL_S`` and when scraped, and adds the others'
latest (``ServingMetrics.exchange``). Each response names the replica that answered in the
``x-distserve-replica`` header.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from distserve.errors import ServiceUnavailableError
from distserve.runtime.ray_client import ControllerClient
from distserve.runtime.ray_env import init_ray_local
from distserve.serving.app_config import REPLICA_CPUS, ServeApp, ServeAppConfig
from distserve.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

APP_NAME = "distserve"
REPLICA_HEADER = "x-distserve-replica"
METRICS_PUBLISH_INTERVAL_S = 5.0  # how stale another replica's request series may be on /metrics
HEALTH_CHECK_TIMEOUT_S = 10.0  # within Serve's own health-check timeout (30 s)


class _ReplicaHeader:
    """ASGI middleware naming the replica in every HTTP response (plain ASGI: streaming and disconnects pass through)."""

    def __init__(self, app: Any, replica_id: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.deployment(ray_actor_options={"num_cpus": REPLICA_CPUS})
@serve.ingress()
class DistServeIngress:
    """One ingress replica: the OpenAI API over a handle on the app's shared controller.

    (``serve_app``, not ``app``: Serve's ingress wrapper owns ``app``.)"""

    async def __init__(self, app: ServeApp) -> None:
        context = serve.get_replica_context()
        self.serve_app = app
        self.replica_id = context.replica_id.unique_id
        self.client = await ControllerClient.create(app.deployment, shared_name=app.controller_name(context.app_name))
        self.metrics = ServingMetrics(slo=app.slo, tenants=app.api_keys.tenant_names if app.api_keys else (),
                                      prefix=app.metrics_prefix, model_name=app.served_model_name)
        self._publisher = asyncio.create_task(self._publish_metrics())

    async def _publish_metrics(self) -> None:
        """Keep this replica's request series on the controller, for /metrics on the other replicas."""
        while True:
            await asyncio.sleep(METRICS_PUBLISH_INTERVAL_S)
            try:
                await self.client.controller.publish(self.metrics.request_families())
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.warning("publishing replica %s's metrics failed: %s", self.replica_id, exc)

    def __serve_build_asgi_app__(self) -> Any:
        from distserve.serving.api import build_fastapi_app

        api: FastAPI = build_fastapi_app(
            self.client, self.serve_app.served_model_name, metrics=self.metrics, session_limits=self.serve_app.session_limits,
            api_keys=self.serve_app.api_keys, tool_call_parser=self.serve_app.tool_call_parser,
            enable_auto_tool_choice=self.serve_app.enable_auto_tool_choice, chat_template=self.serve_app.chat_template,
            cors=self.serve_app.cors, metrics_peers=self.client.controller,
        )
        return _ReplicaHeader(api, self.replica_id)

    async def check_health(self) -> None:
        """Serve's replica health check: only a dead controller fails it (Serve then replaces the replicas, and the
        new ones deploy the placement anew); an outage of instances the controller is restarting does not."""
        with suppress(ServiceUnavailableError, asyncio.TimeoutError):
            await asyncio.wait_for(self.client.check_health(), HEALTH_CHECK_TIMEOUT_S)
        if self.client.is_dead:
            raise RuntimeError("the shared controller of this app is dead")

    async def __del__(self) -> None:
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            publisher.cancel()
        client = getattr(self, "client", None)
        if client is None:
            return
        try:  # this replica's counters keep counting after it is gone
            await client.controller.publish(self.metrics.request_families())
        except Exception:  # noqa: BLE001 - the controller may already be gone
            pass
        await client.shutdown()  # detaches; the last replica tears the deployment down


def bind(app: ServeApp) -> Application:
    """The Serve application of ``app``: its ingress deployment with ``num_replicas`` and ``max_ongoing_requests``."""
    return DistServeIngress.options(  # type: ignore[attr-defined,no-any-return]
        num_replicas=app.num_replicas, max_ongoing_requests=app.max_ongoing_requests,
        ray_actor_options={"num_cpus": app.replica_cpus},
    ).bind(app)


def build_app(args: Mapping[str, Any]) -> Application:
    """The Serve application of ``args`` (a ``ServeAppConfig``): ``serve run distserve.serving.app:build_app model=tiny``."""
    return bind(ServeAppConfig.from_args(args).resolve())


def run_ray_serve(app: ServeApp, host: str, port: int, *, on_ready: Callable[[str], None] | None = None) -> None:
    """Deploy on Ray Serve with the HTTP proxy on ``host:port`` and block until SIGINT/SIGTERM, then tear down."""
    import ray

    stop = threading.Event()
    handlers = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    started_ray = False
    try:
        started_ray = init_ray_local()
        serve.start(http_options={"host": host, "port": port})
        serve.run(bind(app), name=APP_NAME, route_prefix="/")
        if on_ready is not None:
            on_ready(f"http://{host}:{port}")
        while not stop.wait(0.5):
            pass
    finally:
        if ray.is_initialized():
            serve.shutdown()
        if started_ray:
            ray.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
