"""``ControllerClient``: the ``EngineClient`` of the Ray runtime, for the HTTP server's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence as Seq

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.outputs import RequestOutput
from distserve.placement import Placement
from distserve.runtime.client import EngineClient
from distserve.runtime.controller_actor import RemoteController
from distserve.runtime.ray_env import init_ray_local


class ControllerClient(EngineClient):
    """Deploys a ``Placement`` with a ``Controller`` in its own Ray actor, called through ``RemoteController``."""

    def __init__(self, controller: RemoteController, owns_ray: bool = False) -> None:
        self.controller = controller
        self.model_name = controller.model_name
        self.tokenizer = controller.tokenizer
        self.max_model_len = controller.max_model_len
        self._owns_ray = owns_ray

    @classmethod
    async def create(
        cls,
        model: str,
        placement: Placement,
        *,
        dtype: str = "auto",
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        prefill_scheduler_config: SchedulerConfig | None = None,
        max_queued_requests: int = 1024,
        ray_temp_dir: str | None = None,
        kv_transfer_timeout_s: float | None = None,
        num_threads_per_worker: int = 1,
    ) -> "ControllerClient":
        import ray

        owns_ray = not ray.is_initialized()
        init_ray_local(ray_temp_dir)
        try:
            controller = RemoteController(
                model, placement, dtype=dtype, cache_config=cache_config, scheduler_config=scheduler_config,
                prefill_scheduler_config=prefill_scheduler_config, max_queued_requests=max_queued_requests,
                num_threads_per_worker=num_threads_per_worker,
                **({} if kv_transfer_timeout_s is None else {"kv_transfer_timeout_s": kv_transfer_timeout_s}),
            )
            await controller.start()  # tears the deployment down itself if it fails
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        return cls(controller, owns_ray)

    def generate(
        self, prompt: str | Seq[int], sampling: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        return self.controller.generate(prompt, sampling, request_id, priority)

    async def abort(self, request_id: str) -> None:
        await self.controller.abort(request_id)

    async def stats(self) -> dict[str, object]:
        return await self.controller.stats()

    @property
    def is_dead(self) -> bool:
        return self.controller.is_dead

    async def check_health(self) -> None:
        await self.controller.check_health()

    async def shutdown(self) -> None:
        await self.controller.shutdown()
        if self._owns_ray:
            import ray

            ray.shutdown()
