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

Scheduling classes (``distserve.cluster.classes``) come first where a request has one: a later
member of a task group enters where the group's first member did, and is decoded preferably where
the group's earlier members were (each ``RouteState`` remembers its recent groups, LRU); a latency
request prefers decode instances without throughput work and a throughput request ones without
latency work, and an instance holding latency requests is kept to a small batch while another has
room (``decode_preference``); then fewest assigned.

Class pools come before all of that: a decode instance may belong to the pool of one objective
(``InstanceSpec.pool``, kept in its ``RouteState.pool``; None is the shared pool). A request is
decoded on its objective's pool first, then on shared instances; the pools of other objectives are
tried only when the candidates hold neither (e.g. every one of them died), so a request is never
stranded — a pool's batch cap (``InstanceSpec.max_num_seqs``) is what keeps its class's TPOT low.

The entry rule is a plug-in chosen by name (``ROUTERS``: ``prefix-affinity``, the default, and
``least-loaded``, which ignores prefixes); ``pick_entry`` applies the chosen one and does the
bookkeeping every rule shares (counting the assignment, remembering the prompt's blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from distserve.cluster.classes import DEFAULT, LATENCY, MAX_REMEMBERED_GROUPS, THROUGHPUT, RequestClass, decode_preference
from distserve.config import SchedulerConfig
from distserve.engine.block_manager import seq_block_hashes
from distserve.engine.sequence import Sequence as SequenceT
from distserve.errors import InvalidConfigError

MAX_REMEMBERED_BLOCKS = 65536  # prefix hashes remembered per entry instance for affinity routing
MAX_AFFINITY_IMBALANCE = 4  # requests more than the least assigned instance that still wins on affinity
DEFAULT_LATENCY_CAP = SchedulerConfig.latency_max_num_seqs

T = TypeVar("T")


@dataclass(eq=False)  # mutable state of one instance: compared by identity
class RouteState:
    """What routing knows about one instance."""

    num_assigned: int = 0  # requests routed here and not yet finished or moved on
    recent_prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)  # block hashes, LRU
    recent_groups: OrderedDict[str, None] = field(default_factory=OrderedDict)  # task groups routed here, LRU
    # Of the requests assigned, the ones of the latency or throughput class: request id -> objective.
    classed: dict[str, str] = field(default_factory=dict)
    num_latency: int = 0
    num_throughput: int = 0
    pool: str | None = None  # the class pool of a decode instance (an objective; None: shared)

    def assign(self, request_id: str | None = None, request_class: RequestClass | None = None) -> None:
        """A request was routed here: count it, by class, and remember its task group."""
        self.num_assigned += 1
        if request_class is None:
            return
        if request_class.group is not None:
            _touch(self.recent_groups, (request_class.group,), MAX_REMEMBERED_GROUPS)
        objective = request_class.objective
        if objective != DEFAULT and request_id is not None and request_id not in self.classed:
            self.classed[request_id] = objective
            if objective == LATENCY:
                self.num_latency += 1
            else:
                self.num_throughput += 1

    def remember(self, hashes: Sequence[int]) -> None:
        _touch(self.recent_prefixes, hashes, MAX_REMEMBERED_BLOCKS)

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt (by content hash) this instance saw recently."""
        n = 0
        while n < len(hashes) and hashes[n] in self.recent_prefixes:
            n += 1
        return n

    def release(self, request_id: str | None = None) -> None:
        """The request ``request_id`` routed here finished or moved on."""
        self.num_assigned = max(0, self.num_assigned - 1)
        objective = self.classed.pop(request_id, None) if request_id is not None else None
        if objective == LATENCY:
            self.num_latency -= 1
        elif objective == THROUGHPUT:
            self.num_throughput -= 1


K = TypeVar("K")


def _touch(lru: OrderedDict[K, None], keys: Iterable[K], limit: int) -> None:
    """Mark ``keys`` most recently seen in ``lru``, keeping at most ``limit`` (the least recent go)."""
    for key in keys:
        lru[key] = None
        lru.move_to_end(key)
    while len(lru) > limit:
        lru.popitem(last=False)


class EntryRouter(Protocol):
    """Chooses the entry instance among ``states`` (one per candidate, in order) for a prompt with block hashes ``hashes``."""

    def __call__(self, states: Sequence[RouteState], hashes: Sequence[int]) -> int: ...


def prefix_affinity(states: Sequence[RouteState], hashes: Sequence[int]) -> int:
    """Among the instances within ``MAX_AFFINITY_IMBALANCE`` of the least assigned: the longest
    remembered prefix of this prompt, then the least assigned, then the first."""
    least = min(s.num_assigned for s in states)
    best, best_key = 0, None
    for i, s in enumerate(states):  # first of the best: ties go to the earlier instance
        if s.num_assigned - least > MAX_AFFINITY_IMBALANCE:
            continue
        key = (-s.cached_blocks(hashes) if hashes else 0, s.num_assigned)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def least_loaded(states: Sequence[RouteState], hashes: Sequence[int]) -> int:
    """The least assigned instance, then the first; prompts' prefixes play no part."""
    return min(range(len(states)), key=lambda i: states[i].num_assigned)


ROUTERS: dict[str, EntryRouter] = {"prefix-affinity": prefix_affinity, "least-loaded": least_loaded}
DEFAULT_ROUTER = "prefix-affinity"


def check_router(name: str) -> str:
    """``name`` if it names a router, else an ``InvalidConfigError`` listing them."""
    if name not in ROUTERS:
        raise InvalidConfigError(f"unknown router {name!r}; known: {sorted(ROUTERS)}")
    return name


def entry_hashes(seq: SequenceT, block_size: int, prefix_caching: bool) -> list[int]:
    """The block hashes entry routing goes by: the prompt's (computed once, kept on the sequence, so
    the instance's admission reuses them), or none where there is no prefix cache to be near."""
    return seq_block_hashes(seq, block_size) if prefix_caching else []


def pick_entry(
    candidates: Sequence[T],
    state: Callable[[T], RouteState],
    hashes: Sequence[int] = (),
    router: str = DEFAULT_ROUTER,
    request_id: str | None = None,
    request_class: RequestClass | None = None,
) -> T:
    """The entry instance for a new prompt whose block hashes are ``hashes`` (``seq_block_hashes``;
    empty where prefixes are not modelled or cached): where its task group's earlier members went,
    else by the router named ``router``; counts it as assigned there (by class) and remembers its
    blocks and group."""
    if not candidates:
        raise ValueError("no instance to route to")
    states = [state(c) for c in candidates]
    group = request_class.group if request_class is not None else None
    i = next((i for i, s in enumerate(states) if group in s.recent_groups), None) if group is not None else None
    best = candidates[ROUTERS[check_router(router)](states, hashes) if i is None else i]
    chosen = state(best)
    if hashes:
        chosen.remember(hashes)
    chosen.assign(request_id, request_class)
    return best


def pool_rank(objective: str, pool: str | None) -> int:
    """How a decode instance of class pool ``pool`` suits a request of ``objective``: its own pool
    (0), the shared pool (1), another objective's pool (2: only when there is nothing else)."""
    if pool is None:
        return 1
    return 0 if pool == objective else 2


def decode_lane(request_class: RequestClass | None, pools: Iterable[str | None]) -> str | None:
    """The migration-queue lane of a request (``MigrationQueue.drain``'s ``lane``) in a deployment
    whose decode instances are in ``pools``: its objective's, if that has a pool, else the shared
    lane (None). Without pools every request is in the one lane: plain FCFS."""
    objective = request_class.objective if request_class is not None else DEFAULT
    return objective if objective in set(pools) else None


def decode_order(
    candidates: Sequence[T], state: Callable[[T], RouteState], request_class: RequestClass | None = None,
    latency_cap: int = DEFAULT_LATENCY_CAP,
) -> list[T]:
    """The decode instances to ask for room, in order. The request's class pool first, then the
    shared pool (other objectives' pools only if the candidates have neither: ``pool_rank``); within
    a pool fewest assigned first, then the earlier; for a request with a class, first the instances
    that took its task group's earlier members, then by ``decode_preference`` (latency and
    throughput apart, instances holding latency requests kept to ``latency_cap`` requests while
    another has room: ``SchedulerConfig.latency_max_num_seqs``)."""
    objective = request_class.objective if request_class is not None else DEFAULT
    group = request_class.group if request_class is not None else None
    if objective == DEFAULT and group is None and all(state(c).pool is None and not state(c).num_latency for c in candidates):
        # The key below but its last part is the same for every candidate (shared pool, no group,
        # no latency work: preference 0): fewest assigned, then the earlier. Every migration asks this.
        return sorted(candidates, key=lambda c: state(c).num_assigned)
    ranks = {id(c): pool_rank(objective, state(c).pool) for c in candidates}
    if any(r < 2 for r in ranks.values()):
        candidates = [c for c in candidates if ranks[id(c)] < 2]

    def key(inst: T) -> tuple[int, int, int, int]:
        s = state(inst)
        return (ranks[id(inst)], 0 if group is not None and group in s.recent_groups else 1,
                decode_preference(objective, s.num_latency, s.num_throughput, s.num_assigned, latency_cap), s.num_assigned)

    return sorted(candidates, key=key)


__all__ = [
    "DEFAULT_LATENCY_CAP", "DEFAULT_ROUTER", "MAX_AFFINITY_IMBALANCE", "MAX_REMEMBERED_BLOCKS", "ROUTERS", "EntryRouter", "RouteState",
    "check_router", "decode_lane", "decode_order", "entry_hashes", "least_loaded", "pick_entry", "pool_rank", "prefix_affinity",
]
