"""``build_local_engine_client``: the in-process runtime of a ``DeploymentConfig`` — its engines,
built on the engine thread of a ``ThreadedEngineClient``."""

from __future__ import annotations

from distserve.config import SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.frontend import EngineBase
from distserve.errors import InvalidConfigError
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.threaded_client import ThreadedEngineClient


def build_local_engine_client(config: DeploymentConfig) -> ThreadedEngineClient:
    """The in-process runtime of ``config``: colocated instances are ``LLMEngine``s (least-loaded
    routing); a disaggregated placement is one ``LocalDisaggEngine`` xPyD.

    The model is loaded and the engines are built on the engine thread (see ``ThreadedEngineClient``),
    which computes with ``config.num_threads_per_worker`` torch threads (or the placement's, if its
    instances say). In-process instances have no TP/PP: a placement that asks for it is refused.
    """
    from distserve.dtypes import resolve_dtype
    from distserve.engine.weights import load_model

    placement = config.placement
    specs = placement.prefill + placement.decode + placement.colocated
    if any(s.tp != 1 or s.pp != 1 for s in specs):
        raise InvalidConfigError("the in-process runtime runs instances without TP/PP; use the Ray runtime for tp/pp > 1")
    threads = {s.threads for s in specs if s.threads is not None}
    if len(threads) > 1:
        raise InvalidConfigError(f"the in-process runtime computes on one thread; the placement asks for {sorted(threads)} threads")
    num_threads = threads.pop() if threads else config.num_threads_per_worker

    def build() -> list[EngineBase]:
        loaded = load_model(config.model, resolve_dtype(config.dtype))
        if placement.colocated:
            base = config.scheduler_config or SchedulerConfig()
            return [
                LLMEngine(loaded, cache_config=config.cache_config, scheduler_config=spec.scheduler_config(base))
                for spec in placement.colocated
            ]
        return [
            LocalDisaggEngine(
                loaded, placement=placement, cache_config=config.cache_config,
                prefill_scheduler_config=config.prefill_scheduler_config, decode_scheduler_config=config.scheduler_config,
                router=config.router, admission=config.admission,
            )
        ]

    return ThreadedEngineClient(build, max_queued_requests=config.max_queued_requests, num_threads=num_threads, router=config.router,
                                admission=config.admission)
