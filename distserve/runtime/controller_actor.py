"""The Controller as a Ray actor (``ControllerActor``) and the handle callers use (``RemoteController``).

The actor hosts one ``Controller`` on its event loop and owns its instance actors and placement
groups, so they die with it. Each ``RemoteController`` (a proxy) submits requests with plain actor
calls and reads the outputs of all its requests from one long-lived Ray streaming generator, each
item a batch of ``(request_id, output)`` pairs: one streamed item per engine step for every request
in flight rather than one per request. The proxy hands each request its own outputs, tokenizes
locally (no actor hop), unwraps errors to their own types and turns a dead controller into a
``ServiceUnavailableError``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence as Seq
from typing import Any, NoReturn

from distserve.config import SamplingParams
from distserve.engine.model import resolve_dtype
from distserve.engine.outputs import RequestFrontend, RequestOutput
from distserve.engine.sequence import Sequence
from distserve.engine.weights import load_model
from distserve.errors import DistServeError, ServiceUnavailableError
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.controller import Controller

log = logging.getLogger(__name__)

CONTROLLER_CPUS = 0.1  # Ray bookkeeping only, like the workers
# Concurrent actor calls: one output stream per proxy, plus submits, aborts and stats (all short).
CONTROL_CONCURRENCY = 256
MAX_EARLY_ABORTS = 4096  # ids aborted before they were submitted, remembered to refuse them on arrival
SHUTDOWN_TIMEOUT_S = 30.0

# What a proxy's stream carries for one request: an output, the error that ended it, or ``None``
# once it ended otherwise (after its finished output, or aborted without one).
StreamItem = RequestOutput | BaseException | None


class _Outbox:
    """One proxy's pending ``(request_id, item)`` pairs and the tasks relaying its requests."""

    def __init__(self) -> None:
        self.items: list[tuple[str, StreamItem]] = []
        self.ready = asyncio.Event()
        self.relays: dict[str, asyncio.Task[None]] = {}  # request id -> task relaying its outputs here

    def put(self, request_id: str, item: StreamItem) -> None:
        self.items.append((request_id, item))
        self.ready.set()

    async def take(self) -> list[tuple[str, StreamItem]]:
        """Everything put since the previous call, waiting for at least one item."""
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        items, self.items = self.items, []
        return items


class ControllerActor:
    """An async Ray actor hosting one ``Controller``, which ``start`` constructs and deploys.

    The Controller is built in ``start`` rather than ``__init__`` so that a bad argument reaches
    the caller as its own exception type: an error in an actor's constructor only surfaces as
    ``ActorDiedError``.
    """

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.controller: Controller | None = None
        self._outboxes: dict[str, _Outbox] = {}  # proxy id -> its outbox
        self._early_aborts: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> None:
        self.controller = Controller(self.config)
        await self.controller.start()

    def _started(self) -> Controller:
        if self.controller is None:
            raise ServiceUnavailableError("the controller is not started")
        return self.controller

    def _outbox(self, proxy_id: str) -> _Outbox:
        box = self._outboxes.get(proxy_id)
        if box is None:
            box = self._outboxes[proxy_id] = _Outbox()
        return box

    async def outputs(self, proxy_id: str) -> AsyncIterator[list[tuple[str, StreamItem]]]:
        """The proxy's one stream: each item, all its requests' outputs since the previous item.

        When the stream closes (its proxy left or was cancelled), that proxy's requests are aborted.
        """
        box = self._outbox(proxy_id)
        try:
            while True:
                yield await box.take()
        finally:
            if self._outboxes.get(proxy_id) is box:
                del self._outboxes[proxy_id]
            for relay in box.relays.values():
                relay.cancel()

    async def submit(
        self, proxy_id: str, prompt_ids: list[int], sampling: SamplingParams, request_id: str, priority: int = 0
    ) -> None:
        """Start a request whose outputs go to ``proxy_id``'s stream; raises if the Controller refuses it."""
        controller = self._started()
        box = self._outbox(proxy_id)
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            box.put(request_id, None)  # its caller left before it was submitted
            return
        stream = controller.generate(prompt_ids, sampling, request_id, priority)
        first = asyncio.ensure_future(anext(stream))
        # One loop turn runs the Controller's admission (queue bound, duplicate id, routing), which
        # is synchronous: a refusal is raised to the caller here. Should it ever come later, it
        # reaches the caller through the stream instead, with the same type.
        await asyncio.sleep(0)
        refused = first.exception() if first.done() and not first.cancelled() else None
        if isinstance(refused, Exception) and not isinstance(refused, StopAsyncIteration):
            raise refused
        relay = asyncio.create_task(_relay(stream, first, request_id, box))
        box.relays[request_id] = relay

        def done(task: asyncio.Task[None]) -> None:
            # Closes the Controller's stream (aborting the request) if the relay was cancelled before
            # it took over ``first``; a no-op otherwise.
            first.cancel()
            if box.relays.get(request_id) is task:
                del box.relays[request_id]
            box.put(request_id, None if task.cancelled() else _sendable(task.exception()))

        relay.add_done_callback(done)

    async def abort(self, request_id: str) -> None:
        """Stop the request and free its KV everywhere; its stream ends without an error."""
        for box in self._outboxes.values():
            relay = box.relays.pop(request_id, None)
            if relay is not None:
                relay.cancel()  # closes the Controller's stream, which aborts the request
                await asyncio.gather(relay, return_exceptions=True)
                return
        self._early_aborts[request_id] = None
        while len(self._early_aborts) > MAX_EARLY_ABORTS:
            self._early_aborts.popitem(last=False)
        await self._started().abort(request_id)

    async def stats(self) -> dict[str, object]:
        return await self._started().stats()

    async def check_health(self) -> None:
        if self.controller is None:
            raise ServiceUnavailableError("the controller is not started")
        await self.controller.check_health()

    async def inject_step_fault(self, request_id: str, kind: str = "raise") -> None:
        """Test hook: ``Controller.inject_step_fault``."""
        await self._started().inject_step_fault(request_id, kind)

    async def placement_report(self) -> list[dict[str, Any]]:
        return await self._started().placement_report()

    async def worker_pids(self) -> dict[str, list[int]]:
        return await self._started().worker_pids()

    async def shutdown(self) -> None:
        """Stop the instances and remove their placement groups; open streams fail with a ServiceUnavailableError."""
        if self.controller is not None:
            await self.controller.shutdown()

    def placement_groups(self) -> list[Any]:
        """The instances' placement groups, all created when ``start`` begins."""
        return [] if self.controller is None else [i.placement_group for i in self.controller.instances]

    def kill_instance(self, instance_id: str) -> None:
        """Test hook: kill one instance's actor (its workers die with it), as a crash would."""
        import ray

        for inst in self._started().instances:
            if inst.spec.instance_id == instance_id:
                ray.kill(inst.actor, no_restart=True)
                return
        raise DistServeError(f"no instance named {instance_id!r}")

    def pid(self) -> int:
        return os.getpid()


async def _relay(
    stream: AsyncIterator[RequestOutput], first: asyncio.Future[RequestOutput], request_id: str, box: _Outbox
) -> None:
    """Copy a Controller stream, whose first output ``first`` is already awaited, into ``box``.

    Cancelling this task closes the Controller's stream early, which aborts the request; an error
    it raises is the request's error.
    """
    try:
        box.put(request_id, await first)
    except StopAsyncIteration:
        return
    async for out in stream:
        box.put(request_id, out)


def _sendable(exc: BaseException | None) -> BaseException | None:
    """``exc`` if it survives the trip to the proxy, else a ``RuntimeError`` describing it (a 500, not the caller's fault)."""
    import ray.cloudpickle

    if exc is None:
        return None
    try:
        ray.cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"the request failed: {exc!r}")
    return exc


class _Tokenizer(RequestFrontend):
    """The Controller's prompt validation and tokenization, computed in the caller's process."""

    def _submit(self, seq: Sequence) -> None:
        raise TypeError("requests go through RemoteController.generate")


class RemoteController:
    """The callers' handle on a ``ControllerActor``: the ``Controller``'s async interface over actor calls.

    Construct, then ``await start()``; ``shutdown()`` stops the deployment and kills the actor.
    """

    def __init__(self, config: DeploymentConfig) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.config = config
        self.model_name = config.model
        loaded = load_model(config.model, resolve_dtype(config.dtype), weights=False)
        self._frontend = _Tokenizer(loaded, config.cache_config, config.scheduler_config)
        self.tokenizer = self._frontend.tokenizer
        self.max_model_len = self._frontend.max_model_len
        self.num_blocks = self._frontend.num_blocks
        self._placement_groups: list[Any] = []  # known once started: removed at shutdown whatever became of the actor
        # Open requests -> (the output stream they were submitted to, their outputs).
        self._requests: dict[str, tuple[str, asyncio.Queue[StreamItem]]] = {}
        self._proxy_id = ""  # names the current output stream to the actor; new for each stream opened
        self._reader: threading.Thread | None = None  # reads the current output stream
        self._reader_loop: asyncio.AbstractEventLoop | None = None  # where it hands the outputs
        self._shutting_down = False
        self._actor_died = False
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.actor = (
            ray.remote(ControllerActor)
            .options(
                num_cpus=CONTROLLER_CPUS, max_concurrency=CONTROL_CONCURRENCY,
                max_restarts=0, scheduling_strategy=here,
            )
            .remote(config)
        )

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
            await _call(self.actor.start.remote())
            self._placement_groups = await _call(self.actor.placement_groups.remote())
        except BaseException:
            await self.shutdown()
            raise

    async def generate(
        self, prompt: str | Seq[int], sampling: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; closing the iterator early aborts the request."""
        ids = self.encode_prompt(prompt)
        self._frontend.check_request(ids, sampling, priority)  # refused here, without a trip to the actor
        if request_id in self._requests:
            raise DistServeError(f"request id {request_id!r} is already in flight")
        proxy_id = self._open_stream()
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        entry = (proxy_id, queue)
        self._requests[request_id] = entry  # before submitting: its first output may beat the reply
        over = False  # the actor's side of the request has ended: nothing to abort
        try:
            try:
                await _call(self.actor.submit.remote(proxy_id, ids, sampling, request_id, priority))
            except Exception:
                over = True
                raise
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
            if self._requests.get(request_id) is entry:
                del self._requests[request_id]
            if not over:
                self.actor.abort.remote(request_id)  # not awaited: this may run in a cancelled task

    def _open_stream(self) -> str:
        """The id of the output stream read for this event loop, opened (with its reader thread) if need be."""
        loop = asyncio.get_running_loop()
        if self._reader is None or not self._reader.is_alive() or self._reader_loop is not loop:
            self._proxy_id = uuid.uuid4().hex
            self._reader_loop = loop
            self._reader = threading.Thread(target=self._read, args=(self._proxy_id, loop), name="distserve-outputs", daemon=True)
            self._reader.start()
        return self._proxy_id

    def _read(self, proxy_id: str, loop: asyncio.AbstractEventLoop) -> None:
        """The reader thread: hand each batch of the stream to the event loop, then how the stream ended.

        A thread blocked on the stream costs half the CPU per item of an ``async for`` over it.
        """
        import ray

        failure: BaseException = RuntimeError("the controller closed the output stream")
        try:
            for ref in self.actor.outputs.remote(proxy_id):
                loop.call_soon_threadsafe(self._dispatch, proxy_id, ray.get(ref))
        except BaseException as exc:  # noqa: BLE001 - every open request gets it
            failure = exc
        try:
            loop.call_soon_threadsafe(self._stream_ended, proxy_id, failure)
        except RuntimeError:  # the event loop is closed: nothing waits on it
            pass

    def _dispatch(self, proxy_id: str, batch: list[tuple[str, StreamItem]]) -> None:
        for request_id, item in batch:
            entry = self._requests.get(request_id)
            if entry is not None and entry[0] == proxy_id:  # else it was closed early or is over
                entry[1].put_nowait(item)

    def _stream_ended(self, proxy_id: str, failure: BaseException) -> None:
        if proxy_id == self._proxy_id:
            self._reader = None  # the next request opens a new stream
        for stream_id, queue in self._requests.values():
            if stream_id == proxy_id:
                queue.put_nowait(self._stream_error(failure))

    def _stream_error(self, exc: BaseException) -> BaseException:
        """What a request open when the output stream failed with ``exc`` raises."""
        import ray

        if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, Exception):
            return exc.cause  # type: ignore[no-any-return]
        err: Exception
        if self._shutting_down:
            err = ServiceUnavailableError("the controller was shut down")
        elif isinstance(exc, ray.exceptions.RayActorError):
            self._actor_died = True
            err = ServiceUnavailableError(f"the controller actor died: {exc}")
        else:
            err = ServiceUnavailableError(f"the controller's output stream failed: {exc!r}")
        err.__cause__ = exc
        return err

    async def abort(self, request_id: str) -> None:
        await _call(self.actor.abort.remote(request_id))

    @property
    def is_dead(self) -> bool:
        """The controller actor died: this deployment can never serve again."""
        return self._actor_died and not self._shutting_down

    async def check_health(self) -> None:
        import ray

        try:
            await self.actor.check_health.remote()
        except ray.exceptions.RayActorError as exc:
            self._actor_died = True
            raise ServiceUnavailableError(f"the controller actor died: {exc}") from exc
        except ray.exceptions.RayError as exc:
            _reraise(exc)

    async def inject_step_fault(self, request_id: str, kind: str = "raise") -> None:
        await _call(self.actor.inject_step_fault.remote(request_id, kind))

    async def stats(self) -> dict[str, object]:
        return await _call(self.actor.stats.remote())  # type: ignore[no-any-return]

    async def placement_report(self) -> list[dict[str, Any]]:
        return await _call(self.actor.placement_report.remote())  # type: ignore[no-any-return]

    async def worker_pids(self) -> dict[str, list[int]]:
        return await _call(self.actor.worker_pids.remote())  # type: ignore[no-any-return]

    async def shutdown(self) -> None:
        """Stop the instances, remove their placement groups and kill the controller actor."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._shutting_down = True
        try:
            self._placement_groups = await asyncio.wait_for(_call(self.actor.placement_groups.remote()), SHUTDOWN_TIMEOUT_S)
            await asyncio.wait_for(_call(self.actor.shutdown.remote()), SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - killing the actor below takes its instances with it
            log.warning("controller shutdown failed (%r); killing its actor", exc)
        finally:
            ray.kill(self.actor, no_restart=True)
            deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
            await _wait_dead(self.actor, deadline)  # ray.kill returns before the actor is gone
            reader = self._reader
            while reader is not None and reader.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # its stream fails with the actor
            # Placement groups outlive the actor that created them until the job ends: remove them
            # here too, for a controller that died or could not shut down.
            for group in self._placement_groups:
                try:
                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - already removed
                    pass


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


async def _call(ref: Any) -> Any:
    """Await an actor call, raising the controller's own exception types."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayError as exc:
        _reraise(exc)


def _reraise(exc: BaseException) -> NoReturn:
    """Raise what the controller raised (a ``ServiceUnavailableError`` if its actor died), chained to ``exc``."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, Exception):
        raise exc.cause from exc
    if isinstance(exc, ray.exceptions.RayActorError):
        raise ServiceUnavailableError(f"the controller actor died: {exc}") from exc
    raise exc
