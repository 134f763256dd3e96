"""``ControllerClient``: the ``EngineClient`` of the Ray runtime, for the HTTP server's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence as Seq

from distserve.cluster.classes import RequestClass
from distserve.config import SamplingParams
from distserve.engine.outputs import RequestOutput
from distserve.runtime.client import EngineClient
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.remote_controller import RemoteController
from distserve.runtime.ray_env import init_ray_local


class ControllerClient(EngineClient):
    """Deploys a ``Placement`` with a ``Controller`` in its own Ray actor, called through ``RemoteController``."""

    def __init__(self, controller: RemoteController, owns_ray: bool = False) -> None:
        self.controller = controller
        self.model_name = controller.model_name
        self.tokenizer = controller.tokenizer
        self.grammar_compiler = controller.grammar_compiler
        self.max_model_len = controller.max_model_len
        self._owns_ray = owns_ray

    @classmethod
    async def create(
        cls, config: DeploymentConfig, *, ray_temp_dir: str | None = None, shared_name: str | None = None,
    ) -> "ControllerClient":
        """Deploy ``config`` (starting a local Ray if none is initialised); ``shared_name``: attach to the
        shared controller of that name instead, deploying it only if it does not exist yet (``RemoteController``)."""
        import ray

        owns_ray = not ray.is_initialized()
        init_ray_local(ray_temp_dir)
        try:
            controller = RemoteController(config, shared_name=shared_name)
            await controller.start()  # tears the deployment down itself if it fails
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        return cls(controller, owns_ray)

    def generate(
        self, prompt: str | Seq[int], sampling: SamplingParams, request_id: str, priority: int = 0,
        request_class: RequestClass | None = None, timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        return self.controller.generate(prompt, sampling, request_id, priority, request_class, timeout_s)

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
