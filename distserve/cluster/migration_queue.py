"""``MigrationQueue``: finished prefills waiting, KV held on their prefill instance, for a decode
instance with room — pull-based and FCFS. One queue discipline for the Ray ``Controller``,
``LocalDisaggEngine`` and the simulator.

The oldest waiting request is offered first, and nobody overtakes a request that found no room:
``drain`` stops at the first entry whose move fails, so a long prompt cannot be starved by short
ones that would fit. Entries are whatever the driver needs to move a request (its source instance
and id, or a prepared copy); ``drop`` removes the ones that ended meanwhile (finished, aborted,
re-prefilled, or their instance died).

With class pools (``routing.decode_lane``) the queue has one lane per pool: an entry that found no
room holds up only the later entries of its own lane, as the others wait for other instances.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, TypeVar

E = TypeVar("E")
Lane = Callable[[E], object]  # an entry's lane: entries of one lane keep FCFS among themselves


class MigrationQueue(Generic[E]):
    def __init__(self) -> None:
        self._entries: deque[E] = deque()

    def push(self, entry: E) -> None:
        self._entries.append(entry)

    def drop(self, gone: Callable[[E], bool]) -> None:
        """Remove every entry for which ``gone`` is true."""
        self._entries = deque(e for e in self._entries if not gone(e))

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[E]:
        return iter(list(self._entries))

    def drain(self, move: Callable[[E], bool], lane: Lane[E] | None = None) -> None:
        """Offer entries oldest first; ``move`` returns True when the entry leaves the queue (moved,
        or no longer waiting), False when it found no room: then it and everything after it stay
        (with ``lane``: everything after it in its lane)."""
        if lane is None:
            while self._entries:
                if not move(self._entries[0]):
                    return
                self._entries.popleft()
            return
        blocked: set[object] = set()
        kept: deque[E] = deque()
        for entry in list(self._entries):
            key = lane(entry)
            if key in blocked or not move(entry):
                blocked.add(key)
                kept.append(entry)
        self._entries = kept

    async def drain_async(self, move: Callable[[E], Awaitable[bool]], lane: Lane[E] | None = None) -> None:
        """``drain`` for a driver whose moves await (the Ray controller): entries dropped or pushed
        while a move is awaited are honoured."""
        if lane is None:
            while self._entries:
                head = self._entries[0]
                if not await move(head):
                    return
                if head in self._entries:
                    self._entries.remove(head)
            return
        blocked: set[object] = set()
        for entry in list(self._entries):
            key = lane(entry)
            if key in blocked or entry not in self._entries:
                continue
            if not await move(entry):
                blocked.add(key)
            elif entry in self._entries:
                self._entries.remove(entry)


__all__ = ["MigrationQueue"]
