"""Ray Serve application: the OpenAI API as a Serve ingress deployment (``serve run distserve.serving.app:build_app model=tiny``).

``api_keys=FILE`` turns on API keys (``distserve.serving.api_keys``): the file is read and checked
when the application is built, and only the keys' digests travel to the replicas.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from distserve.cluster.admission import DEFAULT_MAX_WAITING, DEFAULT_WAITING_UNIT, AdmissionConfig
from distserve.cluster.fair_queue import DEFAULT_ADMISSION_POLICY
from distserve.cluster.routing import DEFAULT_ROUTER
from distserve.config import CacheConfig, SchedulerConfig, slo_scheduler_config
from distserve.dataflow.limits import DEFAULT_LIMITS, SessionLimits
from distserve.errors import DistServeError, InvalidConfigError
from distserve.placement import Placement
from distserve.runtime.config import SERVER_MAX_QUEUED_REQUESTS, DeploymentConfig
from distserve.runtime.ray_env import init_ray_local
from distserve.runtime.local_client import build_local_engine_client
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api_keys import ApiKeys, load_api_keys
from distserve.serving.metrics_exposition import OWN_PREFIX, check_prefix

APP_NAME = "distserve"


# ``distserve serve`` flags of the semantic-variable sessions -> their type; ``session_ttl`` is ``SessionLimits.ttl_s``.
_SESSION_LIMIT_ARGS: dict[str, Callable[[Any], Any]] = {
    "session_ttl": float, "max_sessions": int, "max_variables": int, "max_pending_calls": int, "max_value_chars": int,
}
_LIMIT_FIELD = {"session_ttl": "ttl_s"}


def _optional_int(value: Any) -> int | None:
    return None if str(value).strip().lower() in ("none", "null") else int(value)


@dataclass(frozen=True)
class ServeOptions:
    """What the ingress deployment runs, from ``key=value`` args (all strings on the ``serve run`` command line)."""

    model: str = "smollm2-135m"
    served_model_name: str | None = None
    colocated: int = 0
    prefill: int = 1
    decode: int = 1
    dtype: str = "auto"
    kv_cache_gb: float = 0.5
    block_size: int = 16
    decode_attention: str | None = None  # a kernels.backends name; None: the device's default (cascade on CPU)
    max_queued_requests: int = SERVER_MAX_QUEUED_REQUESTS
    tpot_slo: float | None = None  # seconds: steps of decoding instances stay within it ("slo" step budget)
    router: str = DEFAULT_ROUTER  # entry routing among the prefill instances (``cluster.routing.ROUTERS``)
    session_limits: SessionLimits = DEFAULT_LIMITS  # semantic-variable sessions (args ``session_ttl``, ``max_sessions``, ...)
    api_keys: ApiKeys | None = None  # tenants and their keys (arg ``api_keys``: the key file); None: no keys, one anonymous tenant
    admission_policy: str = DEFAULT_ADMISSION_POLICY  # fair | fcfs | priority (``cluster.fair_queue``)
    max_waiting: int | None = DEFAULT_MAX_WAITING  # backpressure (``cluster.admission``); arg ``max_waiting=none``: dispatch at once
    waiting_unit: str = DEFAULT_WAITING_UNIT  # tokens | requests (``cluster.backpressure``)
    metrics_prefix: str = OWN_PREFIX  # of the series vLLM also exports (``serving.metrics_exposition``)

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ServeOptions:
        fields: dict[str, Callable[[Any], Any]] = {
            "model": str,
            "served_model_name": str,
            "colocated": int,
            "prefill": int,
            "decode": int,
            "dtype": str,
            "kv_cache_gb": float,
            "block_size": int,
            "decode_attention": str,
            "max_queued_requests": int,
            "tpot_slo": float,
            "router": str,
            "api_keys": load_api_keys,
            "admission_policy": str,
            "max_waiting": _optional_int,
            "waiting_unit": str,
            "metrics_prefix": check_prefix,
            **_SESSION_LIMIT_ARGS,
        }
        unknown = sorted(set(args) - set(fields))
        if unknown:
            raise InvalidConfigError(f"unknown app args {unknown}; expected some of {sorted(fields)}")
        values: dict[str, Any] = {}
        for key, value in args.items():
            if value is None:
                continue
            try:
                values[key] = fields[key](value)
            except DistServeError as exc:
                raise InvalidConfigError(f"app arg {key}: {exc}") from None
            except (TypeError, ValueError) as exc:
                raise InvalidConfigError(f"app arg {key}={value!r} is not a valid {fields[key].__name__}") from exc
        limits = {_LIMIT_FIELD.get(key, key): values.pop(key) for key in _SESSION_LIMIT_ARGS if key in values}
        return cls(**values, session_limits=SessionLimits(**limits))

    def deployment(self) -> DeploymentConfig:
        if self.colocated < 0:
            raise InvalidConfigError(f"app arg colocated must be >= 0, got {self.colocated}")
        placement = (
            Placement.colocated_instances(self.colocated) if self.colocated > 0 else Placement.disaggregated(self.prefill, self.decode)
        )
        return DeploymentConfig(
            self.model, placement, dtype=self.dtype,
            cache_config=CacheConfig(block_size=self.block_size, kv_cache_memory_gb=self.kv_cache_gb, decode_attention=self.decode_attention),
            scheduler_config=slo_scheduler_config(self.tpot_slo), prefill_scheduler_config=SchedulerConfig(),
            max_queued_requests=self.max_queued_requests, router=self.router,
            admission=AdmissionConfig(self.admission_policy, tuple(self.api_keys.tenants.values()) if self.api_keys else (),
                                      max_waiting=self.max_waiting, waiting_unit=self.waiting_unit),
        )

    def build_client(self) -> ThreadedEngineClient:
        return build_local_engine_client(self.deployment())


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
@serve.ingress()
class DistServeIngress:
    """One replica: a ``ThreadedEngineClient`` over in-process engines behind the FastAPI app."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.client = options.build_client()

    def __serve_build_asgi_app__(self) -> FastAPI:
        from distserve.serving.api import build_fastapi_app

        return build_fastapi_app(
            self.client, self.options.served_model_name or self.options.model, session_limits=self.options.session_limits,
            api_keys=self.options.api_keys, metrics_prefix=self.options.metrics_prefix,
        )

    def check_health(self) -> None:
        """Serve's replica health check: a dead engine makes Serve replace this replica."""
        if self.client.is_dead:
            raise RuntimeError("the engine of this replica is dead")

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()


def build_app(args: Mapping[str, Any]) -> Application:
    """The Serve application for ``serve run distserve.serving.app:build_app model=tiny prefill=1 decode=1``."""
    return DistServeIngress.bind(ServeOptions.from_args(args))  # type: ignore[attr-defined]


def run_ray_serve(
    options: ServeOptions, host: str, port: int, *, on_ready: Callable[[str], None] | None = None
) -> None:
    """Deploy on Ray Serve with the HTTP proxy on ``host:port`` and block until SIGINT/SIGTERM, then tear down."""
    import ray

    stop = threading.Event()
    handlers = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    started_ray = False
    try:
        started_ray = init_ray_local()
        serve.start(http_options={"host": host, "port": port})
        serve.run(DistServeIngress.bind(options), name=APP_NAME, route_prefix="/")  # type: ignore[attr-defined]
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
