"""Where requests go: the entry instance of a new request, and the order decode instances are asked
for room for a finished prefill. One rule, driven by the Ray ``Controller``, ``LocalDisaggEngine``
and the simulator alike, so the simulator's routing is the production routing.

Each driver keeps a ``RouteState`` per instance: how many requests it was given that have not
finished or moved on (``num_assigned``), and the content hashes of the prompt blocks it saw most
recently. Entry routing (``pick_entry``) is **prefix affinity** bounded by load: among the
instances within ``MAX_AFFINITY_IMBALANCE`` requests of the least assigned, the one that saw the
longest prefix of this prompt (its blocks are likely still in its prefix cache), then the least
assigned, then the first. Decode instances are asked fewest-assigned first (``decode_order``); the
first with room takes the request (pull-based migration).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

MAX_REMEMBERED_BLOCKS = 65536  # prefix hashes remembered per entry instance for affinity routing
MAX_AFFINITY_IMBALANCE = 4  # requests more than the least assigned instance that still wins on affinity

T = TypeVar("T")


@dataclass(eq=False)  # mutable state of one instance: compared by identity
class RouteState:
    """What routing knows about one instance."""

    num_assigned: int = 0  # requests routed here and not yet finished or moved on
    recent_prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)  # block hashes, LRU

    def remember(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.recent_prefixes[h] = None
            self.recent_prefixes.move_to_end(h)
        while len(self.recent_prefixes) > MAX_REMEMBERED_BLOCKS:
            self.recent_prefixes.popitem(last=False)

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt (by content hash) this instance saw recently."""
        n = 0
        while n < len(hashes) and hashes[n] in self.recent_prefixes:
            n += 1
        return n

    def release(self) -> None:
        """A request routed here finished or moved on."""
        self.num_assigned = max(0, self.num_assigned - 1)


def pick_entry(candidates: Sequence[T], state: Callable[[T], RouteState], hashes: Sequence[int] = ()) -> T:
    """The entry instance for a new prompt whose block hashes are ``hashes`` (``prefix_block_hashes``;
    empty where prefixes are not modelled, e.g. the simulator's synthetic prompts); counts it as
    assigned there and remembers its blocks."""
    if not candidates:
        raise ValueError("no instance to route to")
    least = min(state(i).num_assigned for i in candidates)
    best, best_key = None, None
    for inst in candidates:  # first of the best: ties go to the earlier instance
        s = state(inst)
        if s.num_assigned - least > MAX_AFFINITY_IMBALANCE:
            continue
        key = (-s.cached_blocks(hashes) if hashes else 0, s.num_assigned)
        if best_key is None or key < best_key:
            best, best_key = inst, key
    assert best is not None
    chosen = state(best)
    if hashes:
        chosen.remember(hashes)
    chosen.num_assigned += 1
    return best


def decode_order(candidates: Sequence[T], state: Callable[[T], RouteState]) -> list[T]:
    """The decode instances to ask for room, in order: fewest assigned first, then the earlier."""
    return sorted(candidates, key=lambda i: state(i).num_assigned)


__all__ = ["MAX_AFFINITY_IMBALANCE", "MAX_REMEMBERED_BLOCKS", "RouteState", "decode_order", "pick_entry"]
