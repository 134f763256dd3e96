"""``DeploymentConfig``: everything that says what to deploy, passed unchanged through every runtime layer.

One frozen dataclass travels from the CLI (or ``DisaggLLM``, or a test) through
``ControllerClient`` → ``RemoteController`` → ``ControllerActor`` → ``Controller`` on the Ray
runtime, and into ``local_client.build_local_engine_client`` on the in-process one, so that adding a deployment
option means adding one field here rather than a keyword to each layer. It is validated on
construction: a bad value is refused in the caller's process, before anything is deployed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distserve.cluster.admission import AdmissionConfig
from distserve.cluster.routing import DEFAULT_ROUTER, check_router
from distserve.config import CacheConfig, SchedulerConfig
from distserve.errors import InvalidConfigError
from distserve.placement import Placement

DEFAULT_KV_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_MAX_INSTANCE_RESTARTS = 3  # per instance; then it stays dead and its phase runs on the survivors
DEFAULT_MAX_CONTROLLER_RESTARTS = 3  # per deployment; then a dead controller actor stays dead (the server exits)
DEFAULT_MAX_QUEUED_REQUESTS = 1024  # requests in flight before QueueFullError, for library use (DisaggLLM)
SERVER_MAX_QUEUED_REQUESTS = 256  # the HTTP server's default (``serve --max-queued-requests``): 429 beyond it


@dataclass(frozen=True)
class DeploymentConfig:
    """A model served with a placement, and the knobs of the runtime that serves it.

    ``scheduler_config`` applies to the instances that decode (decode and colocated);
    ``prefill_scheduler_config`` to prefill instances (``None``: the same as ``scheduler_config``).
    ``num_threads_per_worker`` is the torch threads each worker computes with where the placement's
    instance does not say (``InstanceSpec.threads``); ``None`` means 1 per Ray worker, and torch's
    default for the in-process engine thread. ``kv_transfer_timeout_s``, ``max_instance_restarts`` and
    ``max_controller_restarts`` (the controller actor redeployed after it died) apply to the Ray runtime (the in-process engines copy KV in memory and do not restart).
    ``router`` names the rule that picks a new request's entry instance on both runtimes, and
    ``admission`` how requests wait before it (policy, tenants, backpressure), on both runtimes too.
    """

    model: str
    placement: Placement = field(default_factory=Placement.disaggregated)
    dtype: str = "auto"
    cache_config: CacheConfig | None = None
    scheduler_config: SchedulerConfig | None = None
    prefill_scheduler_config: SchedulerConfig | None = None
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    num_threads_per_worker: int | None = None
    kv_transfer_timeout_s: float = DEFAULT_KV_TRANSFER_TIMEOUT_S
    max_instance_restarts: int = DEFAULT_MAX_INSTANCE_RESTARTS
    max_controller_restarts: int = DEFAULT_MAX_CONTROLLER_RESTARTS
    router: str = DEFAULT_ROUTER  # the entry rule, by name (``cluster.routing.ROUTERS``)
    admission: AdmissionConfig = AdmissionConfig()  # fair queueing, tenants and backpressure before the entry instances

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidConfigError(f"model must be a non-empty name or path, got {self.model!r}")
        if not isinstance(self.placement, Placement):
            raise InvalidConfigError(f"placement must be a Placement, got {type(self.placement).__name__}")
        if not _is_int(self.max_queued_requests) or self.max_queued_requests < 1:
            raise InvalidConfigError(f"max_queued_requests must be an integer >= 1, got {self.max_queued_requests!r}")
        if self.num_threads_per_worker is not None and (not _is_int(self.num_threads_per_worker) or self.num_threads_per_worker < 1):
            raise InvalidConfigError(f"num_threads_per_worker must be an integer >= 1, got {self.num_threads_per_worker!r}")
        timeout = self.kv_transfer_timeout_s
        if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
            raise InvalidConfigError(f"kv_transfer_timeout_s must be a positive number of seconds, got {timeout}")
        check_router(self.router)
        if not isinstance(self.admission, AdmissionConfig):
            raise InvalidConfigError(f"admission must be an AdmissionConfig, got {type(self.admission).__name__}", "admission")
        backends = {c.structured_output_backend for c in (self.scheduler_config, self.prefill_scheduler_config) if c is not None}
        if len(backends) > 1:  # a grammar is compiled by the front end and by each instance: all with one library
            raise InvalidConfigError(f"scheduler_config and prefill_scheduler_config name different structured output backends "
                                     f"({', '.join(sorted(backends))})", "structured_output_backend")
        for name in ("max_instance_restarts", "max_controller_restarts"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 0):
                raise InvalidConfigError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
