"""The order in which the admission queue releases requests: one plug-in per policy, chosen by name.

A policy holds ``AdmissionItem``s (``distserve.cluster.admission``) and answers two questions:
which item goes next (``peek``, without taking it: backpressure may hold it back) and ``pop`` it.
Every policy breaks ties by arrival, then by push order, so its order is deterministic. Each item
also gets a **rank** at push (``AdmissionItem.rank``, lower first): the policy's strict levels. The
rank goes with the request to the entry instance, whose scheduler orders by it right after the
objective class (``Sequence.admission_rank``), and a prompt of a lower rank is computed before the
remaining chunks of a higher-ranked one (chunked prefill): the order chosen here holds there too.

* ``fcfs``: arrival order (what every driver did before there was an admission queue); rank 0.
* ``priority``: (tier, objective class rank, request priority, arrival) over all tenants; rank: ``LEVELS × tier``.
* ``fair`` (the default): tiers are strict across tenants (interactive > default > batch); within a
  tier, tenants share by **deficit round robin on tokens** (Shreedhar & Varghese): each tenant's
  turn adds ``quantum × weight`` tokens to its deficit, and it sends its head request while the
  request's cost (prompt + max output tokens) fits the deficit. A tenant's share of the tokens is
  then its weight's share whatever the number or length of its requests; a tenant whose queue
  empties loses its deficit (no banking of idle time). Within a tenant, requests go by (objective
  class rank, priority, arrival): a latency-class call never waits behind its tenant's throughput
  backlog. **Sparse tenants first** (FQ-CoDel's sparse-flow priority): within a tier, a tenant that
  got less than its weight's share of the tier's recently dispatched tokens (the last
  ``SHARE_WINDOW_QUANTA`` quanta or so, decayed per dispatched token, so the same in every driver
  whatever its clock) ranks before the others: its requests go first here and in the instance's
  scheduler. A tenant's queued requests share one level (its own order holds); a sparse tenant
  whose dispatches take it past its share drops to the backlogged level with what it has queued,
  and a tenant alone in its tier is never sparse (there is no one to go before). As FQ-CoDel's new
  flows, sparse requests are split once more by **burst**: a sparse tenant's request is ``FRESH``
  when it starts a burst — the tenant's tokens dispatched lately (decayed with time,
  ``BURST_TAU_S``, 1 s) are under half a quantum (× weight): it was quiet for a second or so, as
  FQ-CoDel's new flows had an empty queue — and the tenant got at most ``FRESH_SHARE_FACTOR`` (2)
  times its share recently (so chat tenants that had the capacity to themselves before a flood began
  are not put behind the flood's first prompts); else ``SPARSE`` (under its share) or backlogged.
  Each tier has three levels (rank ``3 × tier + level``). A chat tenant's requests are FRESH; a
  tenant that starts flooding has its first request FRESH, and its next ones, sent within a second
  or so, at most SPARSE, even while a share measured over the long window still counts it under its
  share — so its long prompts, dispatched early, do not hold up the light requests that arrive while
  they are computed (a lower rank is computed first, and preempts a running plan between layers:
  ``engine.preemptible``). A light tenant's chat then waits neither behind a flooding tenant's queue
  nor behind its prompts already dispatched, while a tenant sending more than its share, however it
  paces its requests, is not sparse.
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from distserve.errors import InvalidConfigError

if TYPE_CHECKING:
    from distserve.cluster.admission import AdmissionItem

DEFAULT_QUANTUM_TOKENS = 512  # tokens a weight-1 tenant may send per round under ``fair``
SHARE_WINDOW_QUANTA = 32  # ``fair``: a tenant is sparse while under its share of the tier's last this many quanta of tokens
BURST_TAU_S = 1.0  # a tenant's burst (its dispatched tokens) decays with this time constant (seconds)
FRESH, SPARSE, BACKLOGGED = 0, 1, 2  # ``fair``'s levels within a tier (rank = LEVELS × tier rank + level)
LEVELS = 3
# A tenant's first request of a burst is FRESH while the tenant got at most this many times its
# share recently: what it used while no one else wanted the capacity (chats before a flood began)
# does not put its chats behind the flood's first prompts.
FRESH_SHARE_FACTOR = 2.0

WeightOf = Callable[[str], float]  # tenant name -> its weight


class QueuePolicy(ABC):
    """The items waiting for dispatch, in one policy's order. ``now``: the driver's clock at the
    latest push or dispatch (``AdmissionQueue`` sets it; a policy may read it)."""

    now: float = 0.0

    @abstractmethod
    def push(self, item: AdmissionItem) -> None: ...

    @abstractmethod
    def peek(self) -> AdmissionItem | None:
        """The item that goes next (None: empty); the same one until ``pop`` or a ``push``/``remove``."""

    @abstractmethod
    def pop(self) -> AdmissionItem:
        """Take the item ``peek`` returns."""

    @abstractmethod
    def remove(self, item: AdmissionItem) -> None:
        """Take ``item`` out wherever it is (expired or aborted)."""

    @abstractmethod
    def __len__(self) -> int: ...


class SortedQueue(QueuePolicy):
    """A list kept sorted by a key of the item (``key``), ties by push order."""

    def __init__(self, key: Callable[[AdmissionItem], tuple]) -> None:
        self._key = key
        self._keys: list[tuple] = []
        self._items: list[AdmissionItem] = []

    def push(self, item: AdmissionItem) -> None:
        key = (*self._key(item), item.order)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._items.insert(i, item)

    def peek(self) -> AdmissionItem | None:
        return self._items[0] if self._items else None

    def pop(self) -> AdmissionItem:
        self._keys.pop(0)
        return self._items.pop(0)

    def remove(self, item: AdmissionItem) -> None:
        i = bisect.bisect_left(self._keys, (*self._key(item), item.order))
        assert self._items[i] is item
        del self._keys[i], self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[AdmissionItem]:
        return iter(self._items)


def tenant_key(item: AdmissionItem) -> tuple:
    """The order within one tenant: objective class rank, then priority (lower first), then arrival
    (a task group's members at its first one's, so they stay adjacent)."""
    return (item.request_class.rank, item.priority, item.group_arrival, item.group_order)


class FcfsQueue(SortedQueue):
    def __init__(self, weight_of: WeightOf, quantum: int = DEFAULT_QUANTUM_TOKENS) -> None:
        super().__init__(lambda item: (item.group_arrival, item.group_order))

    def push(self, item: AdmissionItem) -> None:
        item.rank = 0
        super().push(item)


class PriorityQueue(SortedQueue):
    def __init__(self, weight_of: WeightOf, quantum: int = DEFAULT_QUANTUM_TOKENS) -> None:
        super().__init__(lambda item: (item.tier_rank, *tenant_key(item)))

    def push(self, item: AdmissionItem) -> None:
        item.rank = LEVELS * item.tier_rank  # as ``fair``'s ranks: the tier is ``rank // LEVELS`` under every policy
        super().push(item)


class _Tier:
    """Deficit round robin across the tenants of one level (a tier's sparse or backlogged requests)."""

    def __init__(self) -> None:
        self.queues: dict[str, SortedQueue] = {}  # tenant -> its items, in ``tenant_key`` order
        self.active: deque[str] = deque()  # tenants with items, in round-robin order; [0] has the turn
        self.deficit: dict[str, float] = {}
        self.in_turn = False  # whether active[0]'s turn began (its quantum was added)
        self.size = 0


class _RecentShares:
    """A tier's recently dispatched tokens by tenant: sums decayed by ``exp(-cost / window)`` at each
    dispatch, so they weigh the tier's last ``window`` or so tokens, whatever the time they took."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.total = 0.0
        self.tokens: dict[str, float] = {}
        # A tenant's dispatched tokens, decayed with time (``BURST_TAU_S``), and when they were last
        # updated: how far into a burst the tenant is.
        self._burst: dict[str, tuple[float, float]] = {}

    def burst(self, tenant: str, now: float) -> float:
        """``tenant``'s dispatched tokens at ``now``, each decayed by ``exp(-age / BURST_TAU_S)``."""
        value, at = self._burst.get(tenant, (0.0, now))
        return value * math.exp(-max(0.0, now - at) / BURST_TAU_S)

    def level(self, tenant: str, weight_of: WeightOf, quantum: float, now: float) -> int:
        """The level within its tier of ``tenant``'s next request at ``now``: ``FRESH`` (the first
        request of a burst — the tenant's tokens dispatched lately, decayed with time, under half a
        ``quantum`` — from a tenant within ``FRESH_SHARE_FACTOR`` times its share), ``SPARSE`` (under
        its share) or ``BACKLOGGED`` (also: no other tenant got any recently)."""
        ratio = self.share_ratio(tenant, weight_of)
        if ratio is None:
            return BACKLOGGED
        if self.burst(tenant, now) < quantum / 2 and ratio <= FRESH_SHARE_FACTOR:
            return FRESH
        return SPARSE if ratio < 1.0 else BACKLOGGED

    def share_ratio(self, tenant: str, weight_of: WeightOf) -> float | None:
        """``tenant``'s recent tokens per weight over the tier's (among the tenants that got any, and
        it): below 1, under its weight's share. None while no other tenant got any (no one to go before)."""
        if not any(t != tenant for t in self.tokens):
            return None
        mine = self.tokens.get(tenant, 0.0)
        weight = sum(map(weight_of, self.tokens)) + (0.0 if tenant in self.tokens else weight_of(tenant))
        return (mine / weight_of(tenant)) / (self.total / weight)

    def charge(self, tenant: str, cost: int, now: float) -> None:
        """A dispatch of ``cost`` tokens by ``tenant`` at ``now``."""
        decay = math.exp(-cost / self.window)
        self.total = self.total * decay + cost
        tokens = self.tokens
        for t in tokens:
            tokens[t] *= decay
        tokens[tenant] = tokens.get(tenant, 0.0) + cost
        if len(tokens) > 1 and min(tokens.values()) < 1.0:  # forgotten: a tenant idle for many windows
            self.tokens = {t: n for t, n in tokens.items() if n >= 1.0}
        self._burst[tenant] = (self.burst(tenant, now) + cost, now)
        if len(self._burst) > 64:  # forgotten: bursts long over
            self._burst = {t: (v, at) for t, (v, at) in self._burst.items() if self.burst(t, now) >= 1.0}


class FairQueue(QueuePolicy):
    """Strict tiers, sparse tenants first within a tier; deficit round robin by tokens across the
    tenants of each level; ``tenant_key`` within a tenant. Level (= rank) ``LEVELS × tier + FRESH | SPARSE | BACKLOGGED``."""

    def __init__(self, weight_of: WeightOf, quantum: int = DEFAULT_QUANTUM_TOKENS) -> None:
        if not (isinstance(quantum, int) and quantum >= 1):
            raise InvalidConfigError(f"quantum must be an integer number of tokens >= 1, got {quantum!r}")
        self.weight_of, self.quantum = weight_of, quantum
        self._tiers: dict[int, _Tier] = {}  # by level
        self._shares: dict[int, _RecentShares] = {}  # by tier rank
        self._head: AdmissionItem | None = None  # what ``peek`` returned, until the queue changes

    def push(self, item: AdmissionItem) -> None:
        self._head = None
        base = LEVELS * item.tier_rank
        queued = None
        for rank in range(base, base + LEVELS):
            tier = self._tiers.get(rank)
            if tier is not None and item.tenant in tier.queues:
                queued = rank
                break
        if queued is not None:
            item.rank = queued  # a tenant's queued requests share one level: its own order holds
        else:
            shares = self._shares.get(item.tier_rank)
            if shares is None:
                shares = self._shares[item.tier_rank] = _RecentShares(SHARE_WINDOW_QUANTA * self.quantum)
            item.rank = base + shares.level(item.tenant, self.weight_of, self._quantum(item.tenant), self.now)
        tier = self._level(item.rank)
        queue = tier.queues.get(item.tenant)
        if queue is None:
            queue = tier.queues[item.tenant] = SortedQueue(tenant_key)
            tier.active.append(item.tenant)
            tier.deficit[item.tenant] = 0.0
        queue.push(item)
        tier.size += 1

    def _level(self, rank: int) -> _Tier:
        tier = self._tiers.get(rank)
        if tier is None:
            tier = self._tiers[rank] = _Tier()
        return tier

    def _demote(self, tier: _Tier, tenant: str, rank: int) -> None:
        """Move ``tenant``'s queued requests from their level (``tier``) to a later one (``rank``)."""
        queue = tier.queues[tenant]
        tier.size -= len(queue)
        self._leave(tier, tenant)
        target = self._level(rank)
        for item in queue:
            item.rank = rank
        target.queues[tenant] = queue
        target.active.append(tenant)
        target.deficit[tenant] = 0.0
        target.size += len(queue)

    def _top(self) -> _Tier | None:
        ranks = [r for r, t in self._tiers.items() if t.size]
        return self._tiers[min(ranks)] if ranks else None

    def _quantum(self, tenant: str) -> float:
        return self.quantum * self.weight_of(tenant)

    def peek(self) -> AdmissionItem | None:
        if self._head is not None:  # (asked again before the queue changed: the same answer, as the loop below gives)
            return self._head
        tier = self._top()
        if tier is None:
            return None
        while True:
            tenant = tier.active[0]
            head = tier.queues[tenant].peek()
            assert head is not None
            if not tier.in_turn:
                if head.cost > tier.deficit[tenant] + self._quantum(tenant):
                    self._skip_idle_rounds(tier)
                tier.deficit[tenant] += self._quantum(tenant)
                tier.in_turn = True
            if head.cost <= tier.deficit[tenant]:
                self._head = head
                return head
            tier.active.rotate(-1)  # the turn ends; the deficit carries over to the next round
            tier.in_turn = False

    def _skip_idle_rounds(self, tier: _Tier) -> None:
        """Add at once the quanta of the rounds in which no tenant of ``tier`` could send anything
        (requests much longer than the quantum), instead of looping through them."""
        rounds = min(
            math.ceil((q.peek().cost - tier.deficit[t]) / self._quantum(t))  # type: ignore[union-attr]
            for t, q in ((t, tier.queues[t]) for t in tier.active)
        )
        if rounds > 1:
            for t in tier.active:
                tier.deficit[t] += (rounds - 1) * self._quantum(t)

    def pop(self) -> AdmissionItem:
        head = self.peek()
        assert head is not None
        self._head = None
        shares = self._shares[head.tier_rank]
        base = LEVELS * head.tier_rank
        shares.charge(head.tenant, head.cost, self.now)
        tier = self._tiers[head.rank]
        tier.queues[head.tenant].pop()
        tier.deficit[head.tenant] -= head.cost
        tier.size -= 1
        self._drop_if_empty(tier, head.tenant)
        if head.tenant in tier.queues:
            now = base + shares.level(head.tenant, self.weight_of, self._quantum(head.tenant), self.now)
            if now > head.rank:  # its burst or share is used up: what it still has queued waits its turn
                self._demote(tier, head.tenant, now)
        return head

    def remove(self, item: AdmissionItem) -> None:
        self._head = None
        tier = self._tiers[item.rank]
        tier.queues[item.tenant].remove(item)
        tier.size -= 1
        self._drop_if_empty(tier, item.tenant)

    def _drop_if_empty(self, tier: _Tier, tenant: str) -> None:
        if not tier.queues[tenant]:
            self._leave(tier, tenant)

    @staticmethod
    def _leave(tier: _Tier, tenant: str) -> None:
        if tier.active[0] == tenant:
            tier.in_turn = False
        tier.active.remove(tenant)
        del tier.deficit[tenant], tier.queues[tenant]

    def __len__(self) -> int:
        return sum(t.size for t in self._tiers.values())


PolicyFactory = Callable[[WeightOf, int], QueuePolicy]
ADMISSION_POLICIES: dict[str, PolicyFactory] = {"fcfs": FcfsQueue, "fair": FairQueue, "priority": PriorityQueue}
DEFAULT_ADMISSION_POLICY = "fair"


def check_admission_policy(name: object) -> str:
    """``name`` if it names an admission policy, else an ``InvalidConfigError`` listing them."""
    if name not in ADMISSION_POLICIES:
        raise InvalidConfigError(f"unknown admission policy {name!r}; known: {', '.join(sorted(ADMISSION_POLICIES))}", "admission_policy")
    return name  # type: ignore[return-value]


__all__ = [
    "ADMISSION_POLICIES", "BACKLOGGED", "DEFAULT_ADMISSION_POLICY", "DEFAULT_QUANTUM_TOKENS", "FRESH", "FairQueue", "LEVELS", "SPARSE", "FcfsQueue", "PriorityQueue",
    "QueuePolicy", "SortedQueue", "check_admission_policy", "tenant_key",
]
