"""How one request's outputs reach the HTTP client: awaiting the engine while watching for the client
to leave, the SSE events of a stream, and an SSE response that always closes its event generator (which
is what aborts the request in the engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from distserve.engine.outputs import RequestOutput
from distserve.serving.http_errors import ClientDisconnected, check_output, engine_error
from distserve.serving.metrics import RequestTimer
from distserve.serving.responses import SSE_DONE, UsageInfo, sse

T = TypeVar("T")


async def wait_for_disconnect(request: Request) -> None:
    """Until the client leaves: uvicorn says ``http.disconnect``, Ray Serve's ``receive`` raises (``TaskCancelledError``)."""
    with suppress(Exception):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, cancelling it (which closes the streams it iterates) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(Exception, asyncio.CancelledError):
        await task
    raise ClientDisconnected()


async def aclose_stream(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class SSEResponse(StreamingResponse):
    """Streams server-sent events and always closes the event generator at the end.

    Closing it on disconnect is what aborts the request in the engine; Starlette alone only
    cancels the task that iterates it, leaving the generator for the garbage collector.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                with suppress(Exception):  # Ray Serve's receive raises when the client left
                    await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def usage_of(out: RequestOutput) -> UsageInfo:
    return UsageInfo.of(len(out.prompt_token_ids), len(out.token_ids))


async def sse_events(
    stream: AsyncIterator[RequestOutput],
    first: RequestOutput,
    timer: RequestTimer,
    render: Callable[[RequestOutput], list[str]],
    include_usage: bool,
    usage_chunk: Callable[[UsageInfo], str],
) -> AsyncIterator[str]:
    """SSE events for one request; closing this generator early aborts the request."""
    out = first
    failed = False
    try:
        while True:
            for event in render(out):
                yield event
            if out.finished:
                break
            out = check_output(await anext(stream))
            timer.observe(out)
        if include_usage:
            yield usage_chunk(usage_of(out))
        yield SSE_DONE
    except Exception as exc:  # noqa: BLE001 - the status line is sent: the error becomes the last event
        failed = True  # not counted as a finished request
        timer.fail()
        yield sse(engine_error(exc, "prompt").body())
        yield SSE_DONE
    finally:
        if not out.finished and not failed:
            timer.finish("abort")
        await aclose_stream(stream)
