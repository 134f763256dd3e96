"""Runs one session's dataflow on an ``EngineClient``: each call as soon as its inputs are ready, no client round trip.

``DataflowSession`` owns a ``DataflowGraph`` and the tasks running its calls. A call with several
outputs is generated piecewise: the text before its first output is sent, the generated text is
appended, then the text up to the next output, and so on — exactly what a client issuing the same
prompts one by one would send, so greedy outputs are the same either way. A read (``get``)
activates what the variable depends on, waits (with a timeout) until it has a value or has failed,
and returns the value or raises the failure, which names the call that failed.
"""

from __future__ import annotations

import asyncio

from distserve.dataflow.graph import CallNode, DataflowGraph, SemanticVariable, VarState
from distserve.dataflow.template import SemanticCall
from distserve.dataflow.transforms import TransformFailed
from distserve.errors import DataflowError, DistServeError
from distserve.runtime.client import EngineClient


class VariableFailed(DataflowError):
    """A read of a variable whose producing call (or one upstream of it) failed."""


class DataflowSession:
    """One session: its graph, bound to the engine that runs its calls."""

    def __init__(self, session_id: str, client: EngineClient) -> None:
        self.graph = DataflowGraph(session_id)
        self.client = client
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- the client's operations -------------------------------------------------------------
    def submit(self, call: SemanticCall, criteria: str | None = None) -> CallNode:
        node = self.graph.add_call(call, criteria)
        self._dispatch()
        return node

    async def set(self, var_id: str, value: object) -> None:
        self.graph.set_value(var_id, value)
        self._dispatch()
        await self._notify()

    async def get(self, var_id: str, criteria: str, timeout_s: float | None = None) -> str:
        """The variable's value once it has one; ``VariableFailed`` if it failed; ``TimeoutError`` after ``timeout_s``."""
        var = self.graph.read(var_id, criteria)
        self._dispatch()

        async def settled() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: var.state is not VarState.PENDING)

        await asyncio.wait_for(settled(), timeout_s)
        return _value(var)

    async def close(self) -> None:
        """Stop every call in flight (their requests are aborted by closing their streams)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- execution ---------------------------------------------------------------------------
    def _dispatch(self) -> None:
        for node in self.graph.ready_calls():
            self.graph.start(node)
            task = asyncio.get_running_loop().create_task(self._run(node), name=node.call_id)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, node: CallNode) -> None:
        try:
            prompt = ""
            for text, ph in self.graph.segments(node, self._truncate):
                prompt += text
                assert ph.sampling is not None
                last = None
                async for out in self.client.generate(prompt, ph.sampling, f"{node.call_id}-{ph.name}"):
                    last = out
                if last is None or last.finish_reason == "error":
                    raise DataflowError(f"generating {ph.name!r} failed: {last.error if last else 'no output'}")
                self.graph.set_output(node, ph.name, last.text)
                prompt += last.text
            self.graph.complete(node)
        except asyncio.CancelledError:
            self.graph.fail(node, "the session was closed")
            raise
        except Exception as exc:  # noqa: BLE001 - any failure (bad transform, refused or failed request, outage) fails the call
            self.graph.fail(node, str(exc) if isinstance(exc, (DistServeError, TransformFailed)) else f"{type(exc).__name__}: {exc}")
        finally:
            self._dispatch()
            await self._notify()

    def _truncate(self, text: str, max_tokens: int) -> str:
        tok = self.client.tokenizer
        return tok.decode(tok.encode(text, add_special_tokens=False)[:max_tokens])

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


def _value(var: SemanticVariable) -> str:
    if var.state is VarState.FAILED:
        raise VariableFailed(f"variable {var.var_id} ({var.name}) has no value: {var.error}", "var_id")
    assert var.value is not None
    return var.value


__all__ = ["DataflowSession", "VariableFailed"]
