"""``OutputStreams``: a ``ControllerActor``'s output stream, read once per caller and handed to each request.

The controller actor sends every request's outputs of one caller (one ``RemoteController`` on one
event loop) through one stream, named by a proxy id. A reader thread blocks on it (a thread blocked
on the stream costs half the CPU per item of an ``async for`` over it) and hands each batch to the
event loop, where each request's items go to its own queue. When the stream ends (the actor died,
or closed it), every request still reading it gets the error (``ControllerDiedError`` for a dead actor).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

from distserve.errors import ServiceUnavailableError
from distserve.runtime.controller_actor import StreamItem


class ControllerDiedError(ServiceUnavailableError):
    """The controller actor a call went to died (its handle redeploys it, ``RemoteController._recover``)."""


class OutputStreams:
    """The open requests of one controller handle, each with the output stream it reads and its queue.

    ``on_actor_died(actor)``: called on the event loop when a stream ends because its actor died.
    ``shutting_down()``: whether the handle is shutting down (a stream then ends by design).
    """

    def __init__(self, on_actor_died: Callable[[Any], None], shutting_down: Callable[[], bool]) -> None:
        self._on_actor_died = on_actor_died
        self._shutting_down = shutting_down
        # Open requests -> (the output stream they were submitted to, their outputs).
        self._requests: dict[str, tuple[str, asyncio.Queue[StreamItem]]] = {}
        self._proxy_id = ""  # names the current output stream to the actor; new for each stream opened
        self.proxy_ids: list[str] = []  # every stream opened, ended when the handle detaches from a shared controller
        self._reader: threading.Thread | None = None  # reads the current output stream
        self._reader_loop: asyncio.AbstractEventLoop | None = None  # where it hands the outputs
        self._reader_actor: Any = None  # the actor whose stream it reads

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def open(self, actor: Any, request_id: str) -> tuple[str, asyncio.Queue[StreamItem]]:
        """Register ``request_id`` to read ``actor``'s output stream for this event loop (opened, with
        its reader thread, if need be): returns the stream's id and the request's queue."""
        loop = asyncio.get_running_loop()
        if self._reader is None or not self._reader.is_alive() or self._reader_loop is not loop or self._reader_actor is not actor:
            self._proxy_id = uuid.uuid4().hex
            self.proxy_ids.append(self._proxy_id)
            self._reader_loop = loop
            self._reader_actor = actor
            self._reader = threading.Thread(target=self._read, args=(actor, self._proxy_id, loop), name="distserve-outputs", daemon=True)
            self._reader.start()
        entry: tuple[str, asyncio.Queue[StreamItem]] = (self._proxy_id, asyncio.Queue())
        self._requests[request_id] = entry
        return entry

    def close(self, request_id: str, entry: tuple[str, asyncio.Queue[StreamItem]]) -> None:
        """``request_id`` stops reading (if ``entry`` is still its registration)."""
        if self._requests.get(request_id) is entry:
            del self._requests[request_id]

    async def wait_reader_done(self, deadline: float) -> None:
        """Until the current reader thread ends (its stream ended), or ``deadline`` (``time.monotonic()``)."""
        reader = self._reader
        while reader is not None and reader.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _read(self, actor: Any, proxy_id: str, loop: asyncio.AbstractEventLoop) -> None:
        """The reader thread: hand each batch of the stream to the event loop, then how the stream ended."""
        import ray

        failure: BaseException = RuntimeError("the controller closed the output stream")
        try:
            for ref in actor.outputs.remote(proxy_id):
                loop.call_soon_threadsafe(self._dispatch, proxy_id, ray.get(ref))
        except BaseException as exc:  # noqa: BLE001 - every open request gets it
            failure = exc
        try:
            loop.call_soon_threadsafe(self._stream_ended, actor, proxy_id, failure)
        except RuntimeError:  # the event loop is closed: nothing waits on it
            pass

    def _dispatch(self, proxy_id: str, batch: list[tuple[str, StreamItem]]) -> None:
        for request_id, item in batch:
            entry = self._requests.get(request_id)
            if entry is not None and entry[0] == proxy_id:  # else it was closed early or is over
                entry[1].put_nowait(item)

    def _stream_ended(self, actor: Any, proxy_id: str, failure: BaseException) -> None:
        import ray

        if proxy_id == self._proxy_id:
            self._reader = None  # the next request opens a new stream
        for stream_id, queue in self._requests.values():
            if stream_id == proxy_id:
                queue.put_nowait(self._stream_error(failure))
        if isinstance(failure, ray.exceptions.RayActorError) and not self._shutting_down():
            self._on_actor_died(actor)  # even with no request left waiting for it

    def _stream_error(self, exc: BaseException) -> BaseException:
        """What a request open when the output stream failed with ``exc`` raises."""
        import ray

        if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, Exception):
            return exc.cause  # type: ignore[no-any-return]
        err: Exception
        if self._shutting_down():
            err = ServiceUnavailableError("the controller was shut down")
        elif isinstance(exc, ray.exceptions.RayActorError):
            err = ControllerDiedError(f"the controller actor died: {exc}")
        else:
            err = ServiceUnavailableError(f"the controller's output stream failed: {exc!r}")
        err.__cause__ = exc
        return err


async def call(ref: Any) -> Any:
    """Await an actor call, raising the controller's own exception types."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayError as exc:
        reraise(exc)


def reraise(exc: BaseException) -> NoReturn:
    """Raise what the controller raised (``ControllerDiedError`` if its actor died), chained to ``exc``."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, Exception):
        raise exc.cause from exc
    if isinstance(exc, ray.exceptions.RayActorError):
        raise ControllerDiedError(f"the controller actor died: {exc}") from exc
    raise exc
