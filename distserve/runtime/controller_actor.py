"""The Controller as a Ray actor: ``ControllerActor`` hosts one ``Controller`` and streams its outputs to proxies.

The actor owns its instance actors and placement groups, so they die with it. Each proxy
(``RemoteController``, ``remote_controller.py``) submits requests with plain actor calls and reads
the outputs of all its requests from one long-lived Ray streaming generator (``outputs``), each item
a batch of ``(request_id, output)`` pairs: one streamed item per engine step for every request in
flight rather than one per request.

A named actor can be **shared** by several callers (the ingress replicas of a Ray Serve app): each
``attach``es as a holder, ``start`` deploys the placement once whoever calls it first, and the
holder whose ``detach`` leaves none tears the deployment down.

An outbox whose stream is never read (its proxy left before opening it, or submitted after its stream
closed) would keep its requests running and their outputs for ever: ``sweep_orphans``, run every
``ORPHAN_CHECK_INTERVAL_S``, drops one unread for ``ORPHAN_TIMEOUT_S``, aborting its requests. Holders that die without detaching
(a crashed replica) are noticed by ``check_holders``, run every ``HOLDER_CHECK_INTERVAL_S``: when
none is left alive, the actor tears itself down. Holders may ``publish`` a snapshot of their own
state (their HTTP metrics) for the others to read (``published``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from distserve.cluster.classes import RequestClass
from distserve.config import SamplingParams
from distserve.engine.outputs import RequestOutput
from distserve.errors import DistServeError, ServiceUnavailableError
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.controller import Controller

log = logging.getLogger(__name__)

CONTROLLER_CPUS = 0.1  # Ray bookkeeping only, like the workers
# Concurrent actor calls: one output stream per proxy, plus submits, aborts and stats (all short).
CONTROL_CONCURRENCY = 256
MAX_EARLY_ABORTS = 4096  # ids aborted before they were submitted, remembered to refuse them on arrival
SHUTDOWN_TIMEOUT_S = 30.0
HOLDER_CHECK_INTERVAL_S = 10.0  # how often a shared controller checks that its holders are alive
HOLDER_PING_TIMEOUT_S = 30.0  # a holder that does not answer within it is alive but busy, not dead
ORPHAN_CHECK_INTERVAL_S = 30.0
ORPHAN_TIMEOUT_S = 60.0  # an outbox nobody has read for this long belongs to a proxy that is gone

# What a proxy's stream carries for one request: an output, the error that ended it, or ``None``
# once it ended otherwise (after its finished output, or aborted without one).
StreamItem = RequestOutput | BaseException | None


class _Outbox:
    """One proxy's pending ``(request_id, item)`` pairs and the tasks relaying its requests."""

    def __init__(self) -> None:
        self.items: list[tuple[str, StreamItem]] = []
        self.ready = asyncio.Event()
        self.relays: dict[str, asyncio.Task[None]] = {}  # request id -> task relaying its outputs here
        self.closed = False
        self.reading = False  # its stream is open
        self.last_read = time.monotonic()  # when its stream last took items (or when it was made)

    def put(self, request_id: str, item: StreamItem) -> None:
        self.items.append((request_id, item))
        self.ready.set()

    def close(self) -> None:
        """End the stream once its pending items are taken (its proxy left)."""
        self.closed = True
        self.ready.set()

    async def take(self) -> list[tuple[str, StreamItem]] | None:
        """Everything put since the previous call, waiting for at least one item; None once closed and empty."""
        while not self.items:
            if self.closed:
                return None
            self.ready.clear()
            await self.ready.wait()
        items, self.items = self.items, []
        self.last_read = time.monotonic()
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
        self._starting: asyncio.Future[None] | None = None
        self._outboxes: dict[str, _Outbox] = {}  # proxy id -> its outbox
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._holders: dict[str, Any] = {}  # holder id -> its actor handle (None: not an actor, never checked)
        self._published: dict[str, tuple[Any, bool]] = {}  # holder id -> (its latest snapshot, whether it is attached)
        self._closing = False  # the last holder left: no holder may attach any more
        self._watch: asyncio.Task[None] | None = None
        self._sweep: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Deploy the placement; later and concurrent calls wait for the first call's outcome (and raise its error)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        self.controller = Controller(self.config)
        await self.controller.start()

    def attach(self, holder_id: str, holder: Any = None) -> bool:
        """Register a holder (``holder``: its actor handle, so that its death is noticed); False if
        the deployment is being torn down (the caller should wait for this actor to die and make a new one)."""
        if self._closing:
            return False
        self._holders[holder_id] = holder
        if holder is not None and self._watch is None:
            self._watch = asyncio.create_task(self._watch_holders())
        return True

    def detach(self, holder_id: str, proxy_ids: list[str]) -> bool:
        """Forget a holder and end its output streams (aborting its requests); True if it was the
        last one, in which case the caller tears the deployment down (``shutdown``) and kills this actor."""
        for proxy_id in proxy_ids:
            box = self._outboxes.get(proxy_id)
            if box is not None:
                box.close()
        self._forget(holder_id)
        if not self._holders:
            self._closing = True
        return self._closing

    def _forget(self, holder_id: str) -> None:
        self._holders.pop(holder_id, None)
        if holder_id in self._published:
            self._published[holder_id] = (self._published[holder_id][0], False)

    async def check_holders(self) -> int:
        """Forget the holders whose actor died; with none left, tear the deployment down and exit. The holders left."""
        import ray

        async def dead(holder: Any) -> bool:
            try:
                await asyncio.wait_for(holder.__ray_ready__.remote(), HOLDER_PING_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                return True
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                pass
            return False

        watched = [(h, a) for h, a in self._holders.items() if a is not None]
        for (holder_id, _), gone in zip(watched, await asyncio.gather(*(dead(a) for _, a in watched))):
            if gone:
                log.warning("holder %s of the shared controller died without detaching", holder_id)
                self._forget(holder_id)
        if not self._holders and not self._closing:
            self._closing = True
            log.warning("every holder of the shared controller is gone; tearing the deployment down")
            await self._teardown_and_exit()
        return len(self._holders)

    async def _watch_holders(self) -> None:
        while not self._closing:
            await asyncio.sleep(HOLDER_CHECK_INTERVAL_S)
            try:
                await self.check_holders()
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("checking the shared controller's holders failed")

    async def _teardown_and_exit(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        groups = self.placement_groups()
        try:
            await asyncio.wait_for(self.shutdown(), SHUTDOWN_TIMEOUT_S)
        finally:
            for group in groups:
                try:
                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - already removed
                    pass
            # Killed rather than ``exit_actor()``, which only exits from an actor call, not from the watch task.
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def publish(self, holder_id: str, snapshot: Any) -> None:
        """Keep ``snapshot`` as the holder's latest (what it is, e.g. its HTTP metrics, is the holders' business)."""
        self._published[holder_id] = (snapshot, holder_id in self._holders)

    def published(self) -> list[tuple[str, Any, bool]]:
        """Every holder's latest snapshot, with whether the holder is still attached (a detached or
        dead holder's last snapshot is kept: its counters still count)."""
        return [(holder_id, snapshot, attached) for holder_id, (snapshot, attached) in self._published.items()]

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
        box.reading = True
        try:
            while (batch := await box.take()) is not None:
                yield batch
        finally:
            box.reading = False
            if self._outboxes.get(proxy_id) is box:
                del self._outboxes[proxy_id]
            for relay in box.relays.values():
                relay.cancel()

    async def submit(
        self, proxy_id: str, prompt_ids: list[int], sampling: SamplingParams, request_id: str, priority: int = 0,
        request_class: RequestClass | None = None, timeout_s: float | None = None,
    ) -> DistServeError | None:
        """Start a request whose outputs go to ``proxy_id``'s stream. A refusal for overload or bad input
        (``DistServeError``: 429 / 400 at the HTTP layer) is returned, not raised: under overload most
        submissions are refused, and Ray formats the traceback of every exception an actor call raises
        (parsing source lines), which took ~15% of this actor's CPU at 80 refusals/s. Anything else raises."""
        controller = self._started()
        box = self._outbox(proxy_id)
        if self._sweep is None:
            self._sweep = asyncio.create_task(self._sweep_orphans_periodically())
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            box.put(request_id, None)  # its caller left before it was submitted
            return None
        stream = controller.generate(prompt_ids, sampling, request_id, priority, request_class, timeout_s)
        first = asyncio.ensure_future(anext(stream))
        # One loop turn runs the Controller's admission (queue bound, duplicate id, routing), which
        # is synchronous: a refusal is raised to the caller here. Should it ever come later, it
        # reaches the caller through the stream instead, with the same type.
        await asyncio.sleep(0)
        refused = first.exception() if first.done() and not first.cancelled() else None
        if isinstance(refused, DistServeError):
            return refused.with_traceback(None)
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
        return None

    def sweep_orphans(self, max_age_s: float = ORPHAN_TIMEOUT_S) -> list[str]:
        """Drop the outboxes whose stream is not open and has not been read for ``max_age_s``, aborting
        their requests; the proxy ids dropped."""
        now = time.monotonic()
        orphans = [pid for pid, box in self._outboxes.items() if not box.reading and now - box.last_read >= max_age_s]
        for proxy_id in orphans:
            box = self._outboxes.pop(proxy_id)
            log.warning("dropping the outbox of proxy %s, unread for %.0f s (%d requests aborted)", proxy_id, now - box.last_read, len(box.relays))
            for relay in list(box.relays.values()):
                relay.cancel()  # closes the Controller's stream, which aborts the request
        return orphans

    async def _sweep_orphans_periodically(self) -> None:
        while True:
            await asyncio.sleep(ORPHAN_CHECK_INTERVAL_S)
            self.sweep_orphans()

    def num_outboxes(self) -> int:
        return len(self._outboxes)

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

    async def inject_step_fault(self, request_id: str, kind: str = "raise", phase: str | None = None) -> None:
        """Test hook: ``Controller.inject_step_fault``."""
        await self._started().inject_step_fault(request_id, kind, phase)

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
