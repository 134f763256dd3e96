"""``DisaggLLM``: the synchronous Python API over a Ray deployment of a ``Placement``.

Same ``generate`` / ``stream`` calls as the colocated ``LLMEngine``. The controller runs in its own
Ray actor (``ControllerActor``), the instances in theirs; calls to it run on an event loop on a
background thread of the calling process.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Coroutine, Iterator, Sequence as Seq
from typing import Any, TypeVar

from distserve.config import SamplingParams
from distserve.engine.outputs import RequestOutput
from distserve.placement import Placement
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.controller import Controller
from distserve.runtime.remote_controller import RemoteController
from distserve.runtime.ray_env import init_ray_local

T = TypeVar("T")


class DisaggLLM:
    def __init__(
        self,
        model: str | DeploymentConfig = "tiny",
        placement: Placement | None = None,
        *,
        ray_temp_dir: str | None = None,
        controller_in_process: bool = False,
        **deployment: Any,
    ) -> None:
        """Deploy ``model`` with ``placement`` (default 1P1D); ``deployment`` holds the other
        ``DeploymentConfig`` fields (``dtype``, ``cache_config``, ...). Or pass a whole ``DeploymentConfig``.

        ``controller_in_process`` runs the ``Controller`` on this process's event loop instead of in
        its own actor, for tools that instrument it (``Controller.add_step_listener``).
        """
        if isinstance(model, DeploymentConfig):
            if placement is not None or deployment:
                raise TypeError("pass either a DeploymentConfig or a model name with DeploymentConfig fields, not both")
            config = model
        else:
            config = DeploymentConfig(model, placement or Placement.disaggregated(), **deployment)
        init_ray_local(ray_temp_dir)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="distserve-controller", daemon=True)
        self._thread.start()
        make = Controller if controller_in_process else RemoteController
        self.controller: Controller | RemoteController = make(config)
        self.tokenizer = self.controller.tokenizer
        self._ids = itertools.count()
        try:
            self.run(self.controller.start())
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the controller's event loop and return its result: for tools driving
        ``self.controller``'s async API directly (e.g. an open-loop replay of a trace)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def generate(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion concurrently; outputs in input order."""
        encoded, params = self.controller.encode_batch(prompts, sampling_params)

        async def one(ids: list[int], sp: SamplingParams) -> RequestOutput:
            last = None
            async for out in self.controller.generate(ids, sp, f"llm-{next(self._ids)}"):
                last = out
            assert last is not None
            return last

        async def run_all() -> list[RequestOutput]:
            return list(await asyncio.gather(*(one(e, sp) for e, sp in zip(encoded, params))))

        return self.run(run_all())

    def stream(self, prompt: str | Seq[int], sampling: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's outputs as tokens arrive."""
        ids = self.controller.encode_prompt(prompt)
        bridge: queue.Queue[RequestOutput | BaseException | None] = queue.Queue()

        async def pump() -> None:
            try:
                async for out in self.controller.generate(ids, sampling or SamplingParams(), f"llm-{next(self._ids)}"):
                    bridge.put(out)
            except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
                bridge.put(exc)
            finally:
                bridge.put(None)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := bridge.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    def stats(self) -> dict[str, object]:
        return self.run(self.controller.stats())

    def placement_report(self) -> list[dict[str, Any]]:
        return self.run(self.controller.placement_report())

    def shutdown(self) -> None:
        """Stop the deployment (its actors and placement groups) and the controller's loop; again: nothing."""
        if not self._thread.is_alive():
            return
        try:
            self.run(self.controller.shutdown(), timeout=60)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> "DisaggLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
