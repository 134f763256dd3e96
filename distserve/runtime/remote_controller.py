"""``RemoteController``: the callers' handle on a ``ControllerActor`` (the ``Controller``'s async interface over actor calls).

It tokenizes and validates locally (no actor hop), submits with plain actor calls, reads all its
requests' outputs from the actor's one stream (``output_streams.OutputStreams``) and hands each request
its own, unwraps errors to their own types and turns a dead controller into a ``ServiceUnavailableError``.

When the controller actor dies (a crash, an OOM kill), the handle deploys a new one (up to
``DeploymentConfig.max_controller_restarts`` times) and submits its open requests again: each re-run
continues the stream where the client is (``rerun.StreamedSoFar``), or fails clearly if its tokens
differ. Requests that arrive meanwhile wait for the new controller.

With a ``shared_name`` it attaches to the named, detached controller of that name, creating it if
none exists (a Ray Serve app's replicas share one deployment this way): the placement is deployed
once, and ``shutdown`` only detaches unless this handle is the last one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence as Seq
from contextlib import aclosing, suppress
from typing import Any

from distserve.cluster.admission import check_timeout
from distserve.cluster.classes import RequestClass, check_request_class
from distserve.config import SamplingParams
from distserve.dtypes import resolve_dtype
from distserve.engine.frontend import RequestFrontend
from distserve.engine.outputs import RequestOutput
from distserve.engine.sequence import Sequence
from distserve.engine.weights import load_model
from distserve.errors import DistServeError, ServiceUnavailableError
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.controller_actor import CONTROL_CONCURRENCY, CONTROLLER_CPUS, SHUTDOWN_TIMEOUT_S, ControllerActor
from distserve.runtime.output_streams import ControllerDiedError, OutputStreams, call as _call, reraise as _reraise
from distserve.runtime.ray_env import ACTOR_TASK_EVENTS
from distserve.runtime.rerun import StreamedSoFar

log = logging.getLogger(__name__)

SHARED_NAMESPACE = "distserve"  # the Ray namespace of shared (named) controllers


class _Tokenizer(RequestFrontend):
    """The Controller's prompt validation and tokenization, computed in the caller's process."""

    def _submit(self, seq: Sequence) -> None:
        raise TypeError("requests go through RemoteController.generate")


class RemoteController:
    """The callers' handle on a ``ControllerActor``: the ``Controller``'s async interface over actor calls.

    Construct, then ``await start()``; ``shutdown()`` stops the deployment and kills the actor.
    ``shared_name``: attach to the shared controller of that name (see the module docstring).
    """

    def __init__(self, config: DeploymentConfig, *, shared_name: str | None = None) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.config = config
        self.shared_name = shared_name
        self._holder_id = uuid.uuid4().hex  # this handle, to a shared controller
        self.model_name = config.model
        loaded = load_model(config.model, resolve_dtype(config.dtype), weights=False)
        self._frontend = _Tokenizer(loaded, config.cache_config, config.scheduler_config)
        self.tokenizer = self._frontend.tokenizer
        self.grammar_compiler = self._frontend.grammar_compiler
        self.max_model_len = self._frontend.max_model_len
        self.num_blocks = self._frontend.num_blocks
        self._placement_groups: list[Any] = []  # known once started: removed at shutdown whatever became of the actor
        self._shutting_down = False
        self._streams = OutputStreams(self._recover_soon, lambda: self._shutting_down)  # the open requests' outputs
        self._actor_died = False  # dead for good: not redeployed (again)
        self._recovery: asyncio.Future[None] | None = None  # redeploying the controller after its actor died
        self.num_controller_restarts = 0
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._actor_options: dict[str, Any] = {
            "num_cpus": CONTROLLER_CPUS, "max_concurrency": CONTROL_CONCURRENCY, "max_restarts": 0, "scheduling_strategy": here,
            **ACTOR_TASK_EVENTS,
        }
        if shared_name is not None:
            # Detached: it must outlive whichever holder happened to create it.
            self._actor_options.update(name=shared_name, namespace=SHARED_NAMESPACE, get_if_exists=True, lifetime="detached")
        self.actor = self._make_actor()

    def _make_actor(self) -> Any:
        import ray

        return ray.remote(ControllerActor).options(**self._actor_options).remote(self.config)

    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        return self._frontend.encode_prompt(prompt)

    def encode_batch(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        return self._frontend.encode_batch(prompts, sampling_params)

    async def start(self) -> None:
        """Deploy the placement; on failure the deployment is torn down and the error re-raised."""
        try:
            if self.shared_name is not None:
                await self._attach()
            await _call(self.actor.start.remote())
            self._placement_groups = await _call(self.actor.placement_groups.remote())
        except BaseException:
            await self.shutdown()
            raise

    async def _attach(self) -> None:
        """Become a holder of the shared controller; one being torn down is waited out and made anew."""
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        while not await _call(self.actor.attach.remote(self._holder_id, _current_actor())):
            await _wait_dead(self.actor, deadline)
            if time.monotonic() >= deadline:
                raise ServiceUnavailableError(f"the shared controller {self.shared_name!r} did not finish shutting down")
            self.actor = self._make_actor()

    async def generate(
        self, prompt: str | Seq[int], sampling: SamplingParams, request_id: str, priority: int = 0,
        request_class: RequestClass | None = None, timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; closing the iterator early aborts the request. If the controller
        actor dies meanwhile, the request runs again on its replacement and its stream continues."""
        # Text is tokenized in a thread: a long prompt takes seconds, and this loop serves every request.
        ids = await asyncio.to_thread(self.encode_prompt, prompt) if isinstance(prompt, str) else self.encode_prompt(prompt)
        self._frontend.check_request(ids, sampling, priority)  # refused here, without a trip to the actor
        request_class = check_request_class(request_class)
        timeout_s = check_timeout(timeout_s)
        if request_id in self._streams:
            raise DistServeError(f"request id {request_id!r} is already in flight")
        so_far = StreamedSoFar()
        while True:
            actor = await self._live_actor()
            try:
                async with aclosing(self._attempt(actor, ids, sampling, request_id, priority, request_class, timeout_s)) as outs:
                    async for out in outs:
                        unseen = so_far.continue_with(out)
                        if unseen is not None:
                            so_far.record(unseen)
                            yield unseen
                return
            except ControllerDiedError:
                if self._shutting_down:
                    raise ServiceUnavailableError("the controller was shut down") from None
                await self._recover(actor)  # raises if it is not redeployed
                log.warning("re-running request %s on the redeployed controller", request_id)

    async def _live_actor(self) -> Any:
        """The controller actor to submit to: once a redeployment in progress is done."""
        if self._recovery is not None and not self._recovery.done():
            await asyncio.shield(self._recovery)
        if self._actor_died and not self._shutting_down:
            raise ServiceUnavailableError("the controller actor died and was not redeployed")
        return self.actor

    async def _attempt(
        self, actor: Any, ids: list[int], sampling: SamplingParams, request_id: str, priority: int,
        request_class: RequestClass | None, timeout_s: float | None,
    ) -> AsyncIterator[RequestOutput]:
        """One submission of the request to ``actor``, streamed; ``ControllerDiedError`` if the actor dies."""
        entry = self._streams.open(actor, request_id)  # before submitting: its first output may beat the reply
        proxy_id, queue = entry
        over = False  # the actor's side of the request has ended: nothing to abort
        try:
            try:
                refused = await _call(actor.submit.remote(proxy_id, ids, sampling, request_id, priority, request_class, timeout_s))
            except Exception:
                over = True
                raise
            if refused is not None:
                over = True
                raise refused
            while True:
                item = await queue.get()
                if item is None:  # ended without a finished output: the request was aborted
                    over = True
                    return
                if isinstance(item, BaseException):
                    over = True
                    raise item
                over = item.finished
                yield item
                if over:
                    return
        finally:
            self._streams.close(request_id, entry)
            if not over:
                actor.abort.remote(request_id)  # not awaited: this may run in a cancelled task

    async def abort(self, request_id: str) -> None:
        await _call(self.actor.abort.remote(request_id))

    @property
    def is_dead(self) -> bool:
        """The controller actor died and was not redeployed: this deployment can never serve again."""
        return self._actor_died and not self._shutting_down

    async def check_health(self) -> None:
        """Raises ``ServiceUnavailableError`` in an outage, e.g. while a dead controller is redeployed (which it starts)."""
        import ray

        if self._recovery is not None and not self._recovery.done():
            raise ServiceUnavailableError("the controller actor died; a new one is being deployed")
        if self._actor_died:
            raise ServiceUnavailableError("the controller actor died and was not redeployed")
        actor = self.actor
        try:
            await actor.check_health.remote()
        except ray.exceptions.RayActorError as exc:
            if not self._shutting_down:
                self._recover_soon(actor)
            raise ServiceUnavailableError(f"the controller actor died; a new one is being deployed ({exc})") from exc
        except ray.exceptions.RayError as exc:
            _reraise(exc)

    def _recover_soon(self, dead: Any) -> None:
        """Start redeploying the controller in place of ``dead`` (unless done or under way) without waiting."""
        task = asyncio.ensure_future(self._recover(dead))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its failure is is_dead's business

    async def _recover(self, dead: Any) -> None:
        """Deploy a new controller actor in place of ``dead``, once however many callers found it dead;
        raises ``ServiceUnavailableError`` if it is not redeployed (``is_dead`` then)."""
        if self.actor is dead and (self._recovery is None or self._recovery.done()) and not self._actor_died:
            self._recovery = asyncio.ensure_future(self._redeploy(dead))
        if self._recovery is not None and not self._recovery.done():
            await asyncio.shield(self._recovery)
        if self._actor_died:
            raise ServiceUnavailableError("the controller actor died and was not redeployed")

    async def _redeploy(self, dead: Any) -> None:
        """Replace ``dead`` by a new controller actor and deploy the placement again; a failed attempt
        (e.g. a worker OOM-killed while loading) is retried while the restart budget lasts."""
        import ray
        from ray.util.placement_group import remove_placement_group

        limit = self.config.max_controller_restarts
        while True:
            if self.num_controller_restarts >= limit or self._shutting_down:
                log.error("the controller actor died; not redeploying it (%d of %d restarts done)", self.num_controller_restarts, limit)
                self._actor_died = True
                return
            self.num_controller_restarts += 1
            log.warning("the controller actor died; deploying a new one (restart %d of %d)", self.num_controller_restarts, limit)
            started = time.monotonic()
            try:
                ray.kill(dead, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            await _wait_dead(dead, time.monotonic() + SHUTDOWN_TIMEOUT_S)
            for group in self._placement_groups:  # the dead deployment's resources, for the new one
                try:
                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - already removed
                    pass
            self._placement_groups = []
            self.actor = dead = self._make_actor()
            try:
                if self.shared_name is not None:
                    await self._attach()
                await _call(self.actor.start.remote())
                self._placement_groups = await _call(self.actor.placement_groups.remote())
            except Exception as exc:  # noqa: BLE001 - tried again, as a new death
                log.error("redeploying the controller failed: %r", exc)
                with suppress(Exception):
                    self._placement_groups = await asyncio.wait_for(_call(self.actor.placement_groups.remote()), 5.0)
                continue
            log.warning("the controller is redeployed (%.1f s)", time.monotonic() - started)
            return

    async def inject_step_fault(self, request_id: str, kind: str = "raise", phase: str | None = None) -> None:
        await _call(self.actor.inject_step_fault.remote(request_id, kind, phase))

    async def stats(self) -> dict[str, object]:
        return await _call(self.actor.stats.remote())  # type: ignore[no-any-return]

    async def placement_report(self) -> list[dict[str, Any]]:
        return await _call(self.actor.placement_report.remote())  # type: ignore[no-any-return]

    async def worker_pids(self) -> dict[str, list[int]]:
        return await _call(self.actor.worker_pids.remote())  # type: ignore[no-any-return]

    async def publish(self, snapshot: Any) -> None:
        """Make ``snapshot`` this handle's latest for the shared controller's other holders (``published``)."""
        await _call(self.actor.publish.remote(self._holder_id, snapshot))

    async def published(self) -> list[tuple[Any, bool]]:
        """The other holders' latest snapshots, each with whether its holder is still attached."""
        entries = await _call(self.actor.published.remote())
        return [(snapshot, attached) for holder_id, snapshot, attached in entries if holder_id != self._holder_id]

    async def shutdown(self) -> None:
        """Stop the instances, remove their placement groups and kill the controller actor; of a
        shared controller, only detach unless this is its last holder."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._shutting_down = True
        if self._recovery is not None and not self._recovery.done():
            await asyncio.gather(self._recovery, return_exceptions=True)  # then tear down what it deployed
        if self.shared_name is not None and not await self._detach_was_last():
            await self._streams.wait_reader_done(time.monotonic() + SHUTDOWN_TIMEOUT_S)  # the actor ends its stream
            return
        try:
            self._placement_groups = await asyncio.wait_for(_call(self.actor.placement_groups.remote()), SHUTDOWN_TIMEOUT_S)
            await asyncio.wait_for(_call(self.actor.shutdown.remote()), SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - killing the actor below takes its instances with it
            log.warning("controller shutdown failed (%r); killing its actor", exc)
        finally:
            ray.kill(self.actor, no_restart=True)
            deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
            await _wait_dead(self.actor, deadline)  # ray.kill returns before the actor is gone
            await self._streams.wait_reader_done(deadline)  # its stream fails with the actor
            # Placement groups outlive the actor that created them until the job ends: remove them
            # here too, for a controller that died or could not shut down.
            for group in self._placement_groups:
                try:
                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - already removed
                    pass

    async def _detach_was_last(self) -> bool:
        """Detach from the shared controller: True if no holder is left (or its actor is gone), so this one tears it down."""
        try:
            return bool(await asyncio.wait_for(_call(self.actor.detach.remote(self._holder_id, self._streams.proxy_ids)), SHUTDOWN_TIMEOUT_S))
        except ServiceUnavailableError:
            return True  # its actor died: what is left to remove is its placement groups
        except Exception as exc:  # noqa: BLE001 - leave a deployment others may use standing
            log.warning("detaching from the shared controller %r failed (%r); leaving it to its other holders", self.shared_name, exc)
            return False


def _current_actor() -> Any:
    """The handle of the actor this runs in (a Ray Serve replica), or None in a driver."""
    import ray

    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


async def _wait_dead(actor: Any, deadline: float) -> None:
    """Until calls to ``actor`` fail because it died (or ``deadline``, a ``time.monotonic()``)."""
    import ray

    while time.monotonic() < deadline:
        try:
            await asyncio.wait_for(actor.pid.remote(), max(0.01, min(1.0, deadline - time.monotonic())))
        except ray.exceptions.RayActorError:
            return
        except (asyncio.TimeoutError, ray.exceptions.RayError):
            pass
        await asyncio.sleep(0.02)
