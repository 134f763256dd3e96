"""Runs one session's dataflow on an ``EngineClient``: each call as soon as its inputs are ready, no client round trip.

``DataflowSession`` owns a ``DataflowGraph`` and the tasks running its calls. A call's prompt is
built by ``dataflow.prompts`` (token ids piece by piece at placeholder boundaries, or text — the
module docstring there is the exact recipe); a call with several outputs generates them in
order, each continuing after the ids the previous one was generated as, so a client issuing the
same prompts one by one gets the same greedy outputs. An output's value is usable by the calls
reading it as soon as it is generated, before the rest of its call.

Readers:

* ``get`` activates what the variable depends on, waits (with a timeout) until it has a value or
  has failed, and returns the value or raises ``VariableFailed``, which names the call that failed;
* ``stream`` does the same and yields the variable's text as it is generated: the deltas of its
  producing call's raw generation for that output (stop strings already cut, as in its value),
  then whatever the value adds to them. A reader that subscribes late first gets everything
  generated so far as one delta. Transforms belong to the *inputs* that read a variable, so a
  stream never shows them. Only outputs being generated keep their partial text (their deltas,
  at most the output's own length), and it is dropped as soon as the value is set. A reader
  leaving (a client disconnecting) never stops the call: other readers may need its outputs.

``close`` ends the session: its calls are cancelled (their request streams are closed, which
aborts the requests and frees their KV) and every variable still without a value fails, so
waiting readers return at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable

from distserve.cluster.classes import RequestClass
from distserve.cluster.tenants import ANONYMOUS_TENANT, TenantSpec
from distserve.dataflow.graph import CallNode, DataflowGraph, SemanticVariable, VarState
from distserve.dataflow.limits import DEFAULT_LIMITS, SessionLimits
from distserve.dataflow.prompts import PromptBuilder, kept_output_ids
from distserve.dataflow.template import Placeholder, SemanticCall, TextChunk
from distserve.dataflow.transforms import TransformFailed
from distserve.engine.outputs import RequestOutput
from distserve.errors import DataflowError, DistServeError
from distserve.runtime.client import EngineClient

SESSION_ENDED = "the session was ended"
# Wraps one call's request stream, seeing every output (the server's per-tenant metrics); closing
# the wrapper must close the stream it wraps.
CallMeter = Callable[[AsyncIterator[RequestOutput], RequestClass], AsyncIterator[RequestOutput]]


class VariableFailed(DataflowError):
    """A read of a variable whose producing call (or one upstream of it) failed."""


class SessionEnded(DataflowError):
    """The session was ended (deleted or expired) while a request was using it."""


class DataflowSession:
    """One session: its graph, bound to the engine that runs its calls for ``tenant``."""

    def __init__(
        self, session_id: str, client: EngineClient, limits: SessionLimits = DEFAULT_LIMITS, tenant: TenantSpec = ANONYMOUS_TENANT
    ) -> None:
        self.graph = DataflowGraph(session_id, limits)
        self.client = client
        self.tenant = tenant  # whose calls these are: their requests carry its name and tier
        self.meter: CallMeter | None = None  # set by the server: its calls' requests are counted as the tenant's
        self.closed = False
        self.num_readers = 0  # gets and streams waiting now: a session being read is not idle
        self._tasks: set[asyncio.Task[None]] = set()
        self._wakeups: dict[str, asyncio.Event] = {}  # var_id -> set (and dropped) when that variable changes
        self._partial: dict[str, list[str]] = {}  # var_id of an output being generated -> its text deltas so far

    # ---- the client's operations -------------------------------------------------------------
    def submit(self, call: SemanticCall, criteria: str | None = None) -> CallNode:
        self._check_open()
        node = self.graph.add_call(call, criteria)
        self._dispatch()
        return node

    async def set(self, var_id: str, value: object) -> None:
        self._check_open()
        self.graph.set_value(var_id, value)
        self._dispatch()
        self._wake(None)

    async def get(self, var_id: str, criteria: str, timeout_s: float | None = None) -> str:
        """The variable's value once it has one; ``VariableFailed`` if it failed; ``TimeoutError`` after ``timeout_s``."""
        var = self._read(var_id, criteria)

        async def settled() -> None:
            while var.state is VarState.PENDING:
                await self._event(var.var_id).wait()

        self.num_readers += 1
        try:
            await asyncio.wait_for(settled(), timeout_s)
        finally:
            self.num_readers -= 1
        return _value(var)

    async def stream(
        self, var_id: str, criteria: str, timeout_s: float | None = None, heartbeat_s: float | None = None
    ) -> AsyncGenerator[str, None]:
        """The variable's text deltas as generated (see the module docstring), ending when it has its value.

        Raises ``VariableFailed`` if it failed and ``TimeoutError`` once ``timeout_s`` passed without
        a value; yields ``""`` after ``heartbeat_s`` without news (for keep-alives).
        """
        var = self._read(var_id, criteria)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        num_chars = num_deltas = 0  # sent so far
        self.num_readers += 1
        try:
            while True:
                changed = self._event(var.var_id)
                if var.state is not VarState.PENDING:
                    rest = _value(var)[num_chars:]
                    if rest:
                        yield rest
                    return
                deltas = self._partial.get(var.var_id, ())
                if len(deltas) > num_deltas:
                    text = "".join(deltas[num_deltas:])
                    num_deltas, num_chars = len(deltas), num_chars + len(text)
                    yield text
                    continue
                wait = None if deadline is None else deadline - loop.time()
                if heartbeat_s is not None:
                    wait = heartbeat_s if wait is None else min(wait, heartbeat_s)
                try:
                    await asyncio.wait_for(changed.wait(), wait)
                except (TimeoutError, asyncio.TimeoutError):
                    if deadline is not None and loop.time() >= deadline:
                        raise TimeoutError(f"variable {var_id} has no value after {timeout_s:g} s") from None
                    yield ""
        finally:
            self.num_readers -= 1

    async def close(self) -> None:
        """End the session: cancel its calls (aborting their requests) and fail what has no value yet."""
        if self.closed:
            return
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.graph.end(SESSION_ENDED)
        self._partial.clear()
        self._wake(None)

    # ---- execution ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise SessionEnded(f"session {self.graph.session_id} was ended", "session_id")

    def _read(self, var_id: str, criteria: str) -> SemanticVariable:
        self._check_open()
        var = self.graph.read(var_id, criteria)
        self._dispatch()
        return var

    def _dispatch(self) -> None:
        if self.closed:
            return
        for node in self.graph.ready_calls():
            self.graph.start(node)
            task = asyncio.get_running_loop().create_task(self._run(node), name=node.call_id)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, node: CallNode) -> None:
        try:
            builder = PromptBuilder(self.client.tokenizer, node.call.model_type)
            # The pieces before each output are tokenized (and transformed) in a thread: a template or value
            # may be ~1M characters, seconds of tokenizing that must not hold the event loop.
            pieces: list[Callable[[], None]] = []
            for chunk in node.call.chunks:
                if isinstance(chunk, TextChunk):
                    pieces.append(functools.partial(builder.add_text, chunk.text))
                    continue
                ph = node.call.placeholders[chunk.name]
                if not ph.is_output:
                    value, ids = self.graph.input_value(node, ph)
                    pieces.append(functools.partial(builder.add_input, value, ids, ph.transforms))
                    continue
                await asyncio.to_thread(_add_all, pieces)
                pieces = []
                text, ids = await self._generate(node, ph, builder.prompt)
                builder.add_output(text, ids)
                self.graph.set_output(node, ph.name, text, ids)
                self._dispatch()  # its readers may start before the rest of this call
                self._wake(None)
            self.graph.complete(node)
        except asyncio.CancelledError:
            self.graph.fail(node, SESSION_ENDED)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure (bad transform, refused or failed request, outage) fails the call
            self.graph.fail(node, str(exc) if isinstance(exc, (DistServeError, TransformFailed)) else f"{type(exc).__name__}: {exc}")
        finally:
            self._dispatch()
            self._wake(None)

    async def _generate(self, node: CallNode, ph: Placeholder, prompt: str | list[int]) -> tuple[str, list[int]]:
        """Generate output ``ph`` after ``prompt``, publishing its text deltas; its value and kept ids."""
        assert ph.sampling is not None
        var_id = node.outputs[ph.name].var_id
        request_class = request_class_of(node, self.tenant)
        outputs = self.client.generate(prompt, ph.sampling, f"{node.call_id}-{ph.name}", request_class=request_class)  # the one generate call
        if self.meter is not None:
            outputs = self.meter(outputs, request_class)
        deltas = self._partial[var_id] = []
        last = None
        try:
            async for out in outputs:
                last = out
                if out.new_text:
                    deltas.append(out.new_text)
                    self._wake((var_id,))
        finally:
            self._partial.pop(var_id, None)
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:  # closing the stream aborts the request if it did not finish
                await aclose()
        if last is None or last.finish_reason == "error":
            raise DataflowError(f"generating {ph.name!r} failed: {last.error if last else 'no output'}")
        return last.text, kept_output_ids(self.client.tokenizer, last.token_ids, last.text, ph.sampling.stop_token_ids)

    def _event(self, var_id: str) -> asyncio.Event:
        event = self._wakeups.get(var_id)
        if event is None:
            event = self._wakeups[var_id] = asyncio.Event()
        return event

    def _wake(self, var_ids: Iterable[str] | None) -> None:
        """Wake the readers of ``var_ids`` (None: of every variable, after any change of state)."""
        for var_id in list(self._wakeups) if var_ids is None else var_ids:
            event = self._wakeups.pop(var_id, None)
            if event is not None:
                event.set()


def request_class_of(node: CallNode, tenant: TenantSpec = ANONYMOUS_TENANT) -> RequestClass:
    """The scheduling class a call's requests carry: its deduced objective and task group, the
    session's tenant and its tier, and whether it continues generated work (it reads another call's
    output: ``RequestClass.continues``)."""
    return RequestClass(objective=node.objective or "default", group=node.task_group, tenant=tenant.name, tier=tenant.tier,
                        continues=next(node.predecessors(), None) is not None)


def _value(var: SemanticVariable) -> str:
    if var.state is VarState.FAILED:
        raise VariableFailed(f"variable {var.var_id} ({var.name}) has no value: {var.error}", "var_id")
    assert var.value is not None
    return var.value


def _add_all(pieces: list[Callable[[], None]]) -> None:
    for add in pieces:
        add()


__all__ = ["DataflowSession", "SessionEnded", "VariableFailed"]
