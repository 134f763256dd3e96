"""``ThreadedEngineClient``: drives in-process engines from one background thread for the async HTTP layer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from distserve.config import SamplingParams
from distserve.cluster.admission import AdmissionConfig, AdmissionItem
from distserve.cluster.classes import RequestClass, check_request_class
from distserve.cluster.routing import DEFAULT_ROUTER, RouteState, check_router, pick_entry
from distserve.engine.compute_thread import use_compute_threads
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.frontend import EngineBase
from distserve.engine.outputs import RequestOutput
from distserve.errors import DistServeError, EngineDeadError, InvalidConfigError, QueueFullError
from distserve.runtime.client import EngineClient
from distserve.runtime.colocated_admission import ColocatedAdmission, QueuedRequest
from distserve.runtime.config import SERVER_MAX_QUEUED_REQUESTS
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.stats import ClientStats, InstanceStats, instance_stats, merge_admission_stats, prefill_totals

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 30.0


@dataclass
class _Stream:
    """Where one request's outputs go: an ``asyncio.Queue`` living on the caller's event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


_Add = QueuedRequest  # a new request: its stream, prompt, sampling, priority, class and timeout


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stats:
    future: concurrent.futures.Future[ClientStats]


@dataclass
class _Stop:
    reason: str = "the engine client was shut down"


_Command = _Add | _Abort | _Stats | _Stop


@dataclass
class _EngineSlot:
    engine: EngineBase
    index: int
    route: RouteState = field(default_factory=RouteState)  # requests routed here and not yet ended (``cluster.routing``)


EngineFactory = Callable[[], "EngineBase | Seq[EngineBase]"]


class ThreadedEngineClient(EngineClient):
    """An ``EngineClient`` over one or more in-process engines (``LLMEngine``, ``LocalDisaggEngine``).

    One background thread owns the engines and is the only thread that calls them; commands
    (add, abort, stats, stop) arrive through a thread-safe queue, and outputs go back to each
    request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``. The thread steps while any
    engine has work and blocks on the command queue otherwise (or until the next admission
    deadline). A ``LocalDisaggEngine`` queues its requests itself (its ``admission``), so they go
    to it on arrival; colocated engines (``LLMEngine``) get the same queue here
    (``runtime.colocated_admission``): a request waits in it until a slot accepts it under
    backpressure, then goes where the cluster's entry rule (``cluster.routing.pick_entry``) sends
    it among the accepting slots. Routing reads no prompt hashes, so these engines get no prefix
    affinity (every router picks the engine with the fewest requests in flight).

    **Build the engines on the engine thread** (pass a factory) when serving: the engine thread is
    the process's compute thread, and a model loaded on another thread makes every step slower
    (``distserve.engine.compute_thread`` says why and by how much).

    Args:
        engines: the engine, or engines of the same model, to drive; or a factory that builds
            them, called on the engine thread (errors it raises come out of this constructor).
        max_queued_requests: bound on requests in flight; beyond it ``generate`` raises ``QueueFullError``.
        model_name: defaults to the first engine's model name.
        num_threads: torch threads for the engine thread's compute (default: torch's, all cores).
        router: the entry rule by name (``cluster.routing.ROUTERS``).
        admission: the admission queue in front of colocated engines (policy, tenants,
            backpressure, bounds; ``cluster.admission.AT_ONCE``: every request to an engine on
            arrival). Engines that queue themselves (``LocalDisaggEngine``) are built with their own.
    """

    _slots: list[_EngineSlot]  # set on the engine thread before the constructor returns

    def __init__(
        self,
        engines: EngineBase | Seq[EngineBase] | EngineFactory,
        *,
        max_queued_requests: int = SERVER_MAX_QUEUED_REQUESTS,
        model_name: str | None = None,
        num_threads: int | None = None,
        router: str = DEFAULT_ROUTER,
        admission: AdmissionConfig = AdmissionConfig(),
    ) -> None:
        self._router = check_router(router)
        self._admission_config = admission
        if max_queued_requests < 1:
            raise InvalidConfigError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        if num_threads is not None and num_threads < 1:
            raise InvalidConfigError(f"num_threads must be >= 1, got {num_threads}")
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._dead: EngineDeadError | None = None
        built: concurrent.futures.Future[list[EngineBase]] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(engines, num_threads, built), name="distserve-engine", daemon=True
        )
        self._thread.start()
        engine_list = built.result()  # re-raises what building failed with
        first = engine_list[0]
        self.engines = engine_list
        self.model_name = model_name or first.model_config.name
        self.tokenizer = first.tokenizer
        self.grammar_compiler = first.grammar_compiler
        self.max_model_len = min(e.max_model_len for e in engine_list)
        self.max_queued_requests = max_queued_requests
        self._streams: dict[str, tuple[_Stream, _EngineSlot]] = {}  # engine thread only: dispatched to an engine
        self._num_outstanding = 0
        self._count_lock = threading.Lock()

    # ---- async API (any event loop) ----------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def num_outstanding(self) -> int:
        return self._num_outstanding

    async def generate(
        self,
        prompt: str | Seq[int],
        sampling: SamplingParams,
        request_id: str,
        priority: int = 0,
        request_class: RequestClass | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if isinstance(prompt, str):  # tokenized here, in a thread: a long prompt would hold every request's steps
            prompt = await asyncio.to_thread(self.engines[0].encode_prompt, prompt)
        with self._count_lock:
            if self._num_outstanding >= self.max_queued_requests:
                raise QueueFullError(
                    f"server is at its limit of {self.max_queued_requests} requests in flight; retry later", shared=True
                )
            self._num_outstanding += 1
        stream = _Stream(request_id, asyncio.get_running_loop(), asyncio.Queue())
        finished = False
        try:
            self._commands.put(_Add(stream, prompt, sampling, priority, request_class, timeout_s))
            if self._dead is not None:  # died before it could see the command
                finished = True
                raise EngineDeadError(str(self._dead))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._count_lock:
                self._num_outstanding -= 1
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")

    async def stats(self) -> dict[str, object]:
        """Per-instance gauges and migration figures in the shape documented in ``serving.metrics``."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        fut: concurrent.futures.Future[ClientStats] = concurrent.futures.Future()
        self._commands.put(_Stats(fut))
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        snapshot: ClientStats = await asyncio.wait_for(asyncio.wrap_future(fut), STATS_TIMEOUT_S)
        return dict(snapshot)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread (failing requests still in flight) and wait for it."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout_s)

    # ---- the engine thread ---------------------------------------------------------------------
    def _has_work(self) -> bool:
        return any(slot.engine.has_unfinished_requests() for slot in self._slots)

    def _build(
        self, engines: EngineBase | Seq[EngineBase] | EngineFactory, num_threads: int | None
    ) -> list[EngineBase]:
        use_compute_threads(num_threads)
        made = engines() if callable(engines) and not isinstance(engines, EngineBase) else engines
        engine_list = [made] if isinstance(made, EngineBase) else list(made)
        if not engine_list:
            raise InvalidConfigError("ThreadedEngineClient needs at least one engine")
        if 0 < sum(isinstance(e, LocalDisaggEngine) for e in engine_list) < len(engine_list):
            raise InvalidConfigError("ThreadedEngineClient drives LocalDisaggEngines (each queues itself) or colocated engines, not both")
        return engine_list

    def _run(
        self,
        engines: EngineBase | Seq[EngineBase] | EngineFactory,
        num_threads: int | None,
        built: concurrent.futures.Future[list[EngineBase]],
    ) -> None:
        try:
            engine_list = self._build(engines, num_threads)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            built.set_exception(exc)
            return
        self._slots = [_EngineSlot(e, i) for i, e in enumerate(engine_list)]
        self._admission: ColocatedAdmission[_EngineSlot] | None = (
            None if isinstance(engine_list[0], LocalDisaggEngine) else ColocatedAdmission(self._admission_config))
        for slot in self._slots:
            if isinstance(slot.engine, LocalDisaggEngine):  # a backlogged prefill yields to a waiting command
                slot.engine.set_should_yield(lambda: not self._commands.empty())
                # First tokens reach their streams when the prefill ends, not after the round's decode steps.
                slot.engine.on_prefill_outputs = functools.partial(self._publish, slot)
        built.set_result(engine_list)
        try:
            while True:
                cmd: _Command | None = self._next_command() if self._has_work() else self._wait_command()
                while cmd is not None:
                    if isinstance(cmd, _Stop):
                        self._fail_all(EngineDeadError(cmd.reason))
                        return
                    self._handle(cmd)
                    cmd = self._next_command()
                self._admit()
                self._step()
        except BaseException as exc:  # noqa: BLE001 - any engine failure must reach every waiting stream
            logger.exception("engine thread crashed")
            self._fail_all(EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}"))

    def _next_command(self) -> _Command | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _wait_command(self) -> _Command | None:
        """The next command, blocking while no engine has work: until one arrives, or (requests
        queued for admission) until the next admission deadline, polling at most ``IDLE_POLL_S``."""
        timeout = self._admission.wait_s(time.monotonic()) if self._admission is not None else None
        try:
            return self._commands.get(timeout=timeout)
        except queue.Empty:
            return None

    def _handle(self, cmd: _Command) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            self._drop(cmd.request_id)
        elif isinstance(cmd, _Stats):
            try:
                cmd.future.set_result(self._collect_stats())
            except Exception as exc:  # noqa: BLE001 - reported to the caller, the engine keeps running
                cmd.future.set_exception(exc)

    def _add(self, cmd: _Add) -> None:
        rid = cmd.stream.request_id
        if rid in self._streams or (self._admission is not None and rid in self._admission):
            self._deliver([(cmd.stream, DistServeError(f"request id {rid!r} is already in flight"))])
            return
        try:  # validation errors and QueueFullError go to this request only
            if self._admission is not None:
                return self._admission.push(self._slots[0].engine, rid, cmd, time.monotonic())
            request_class = check_request_class(cmd.request_class)
        except Exception as exc:  # noqa: BLE001
            return self._deliver([(cmd.stream, exc)])
        self._start(rid, pick_entry(self._slots, _slot_route, (), self._router, rid, request_class), cmd)

    def _start(self, rid: str, slot: _EngineSlot, cmd: QueuedRequest, dispatch_time: float | None = None, rank: int = 0) -> None:
        """Hand the request to ``slot``'s engine (the entry rule has assigned it there)."""
        try:
            slot.engine.add_request(cmd.prompt, cmd.sampling, request_id=rid, priority=cmd.priority, arrival_time=cmd.arrival_time,
                                    request_class=cmd.request_class, timeout_s=cmd.timeout_s, dispatch_time=dispatch_time,
                                    admission_rank=rank)
        except Exception as exc:  # noqa: BLE001 - validation errors go to this request only
            slot.route.release(rid)
            self._deliver([(cmd.stream, exc)])
            return
        self._streams[rid] = (cmd.stream, slot)

    def _admit(self) -> None:
        """Fail the queued requests past their deadline, then start what the colocated slots accept."""
        if self._admission is None or not self._admission:
            return
        now = time.monotonic()
        self._deliver([(request.stream, out) for request, out in self._admission.expire(now)])

        def place(item: AdmissionItem, accepting: list[_EngineSlot]) -> _EngineSlot:
            return pick_entry(accepting, _slot_route, (), self._router, item.request_id, item.request_class)

        for rid, request, slot, rank in self._admission.dispatch(now, self._slots, lambda slot: slot.engine, place):
            self._start(rid, slot, request, dispatch_time=now, rank=rank)

    def _step(self) -> None:
        for slot in self._slots:
            if slot.engine.has_unfinished_requests():
                self._publish(slot, slot.engine.step_or_recover())  # a failed step is recovered from (EngineBase)

    def _publish(self, slot: _EngineSlot, outputs: list[RequestOutput]) -> None:
        """Hand ``slot``'s engine's outputs to their streams (and forget the finished requests)."""
        batch: list[tuple[_Stream, RequestOutput | BaseException]] = []
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            batch.append((entry[0], out))
            if out.finished:
                del self._streams[out.request_id]
                slot.route.release(out.request_id)
        self._deliver(batch)

    def _deliver(self, items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
        """Hand outputs to their event loops, one wake-up per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, group)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                for stream, _ in group:
                    self._drop(stream.request_id)

    def _drop(self, request_id: str) -> None:
        if self._admission is not None and self._admission.remove(request_id) is not None:
            return  # still queued: no engine holds it
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            entry[1].route.release(request_id)
            entry[1].engine.abort_request(request_id)

    def _fail_all(self, exc: EngineDeadError) -> None:
        self._dead = exc
        streams = [entry[0] for entry in self._streams.values()]
        for rid, (_, slot) in list(self._streams.items()):
            try:
                slot.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken; the streams must still fail
                pass
        self._streams.clear()
        queued: list[QueuedRequest] = self._admission.remove_all() if self._admission is not None else []
        self._deliver([(s, exc) for s in streams] + [(request.stream, exc) for request in queued])
        while (cmd := self._next_command()) is not None:
            if isinstance(cmd, _Add):
                self._deliver([(cmd.stream, exc)])
            elif isinstance(cmd, _Stats):
                cmd.future.set_exception(exc)

    def _collect_stats(self) -> ClientStats:
        instances: list[InstanceStats] = []
        migration: dict[str, float] = {}  # ClusterCounters.migration_stats, summed over the engines
        durations: list[float] = []
        num_awaiting_migration = 0
        for slot in self._slots:
            engine = slot.engine
            if isinstance(engine, LocalDisaggEngine):
                for phase, group in (("prefill", engine.prefill), ("decode", engine.decode)):
                    for inst in group:
                        instances.append(instance_stats(inst.stats(), _qualified(inst.instance_id, slot), phase))
                for key, value in engine.counters.migration_stats().items():
                    migration[key] = migration.get(key, 0) + value
                durations.extend(engine.counters.drain_migration_durations())  # each reported once; the engine keeps none
                num_awaiting_migration += engine.num_requests_awaiting_migration
            elif isinstance(engine, LLMEngine):
                instances.append(instance_stats(engine.stats(), f"colocated-{slot.index}", "colocated"))
            else:
                raw: Callable[[], Any] | None = getattr(engine, "stats", None)
                stats = raw() if callable(raw) else {}
                instances.append(instance_stats(stats, f"engine-{slot.index}", "colocated"))
        queues = [slot.engine.admission for slot in self._slots if isinstance(slot.engine, LocalDisaggEngine)]
        queues += [self._admission.queue] if self._admission is not None else []
        return {
            "instances": instances,
            "admission": merge_admission_stats(q.stats() for q in queues),
            "kv_migration_bytes_total": migration.get("kv_migration_bytes_total", 0),
            "kv_migration_blocks_skipped_total": migration.get("kv_migration_blocks_skipped_total", 0),
            "kv_migration_failures_total": migration.get("kv_migration_failures_total", 0),
            "kv_migration_timeouts_total": migration.get("kv_migration_timeouts_total", 0),
            "kv_migration_seconds": durations,
            "num_requests_awaiting_migration": num_awaiting_migration,
            "requests_failed_poison_total": sum(slot.engine.num_poison_requests for slot in self._slots),
            "failed_steps_total": sum(slot.engine.num_failed_steps for slot in self._slots),
            **prefill_totals(instances),  # type: ignore[typeddict-item]
        }


def _slot_route(slot: _EngineSlot) -> RouteState:
    return slot.route


def _qualified(instance_id: str, slot: _EngineSlot) -> str:
    return instance_id if slot.index == 0 else f"{instance_id}@{slot.index}"


def _put_all(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
