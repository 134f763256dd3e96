"""The admission queue: where requests wait between their arrival and their dispatch to an entry
(prefill or colocated) instance, and the rules that decide when and in which order they leave.

Every driver (``LocalDisaggEngine``, the simulator, the Ray controller, the threaded client) holds
one ``AdmissionQueue`` and drives it with plain calls and its own clock (``now``), no threads:

* ``push(item, now)`` on arrival: refused with ``QueueFullError`` (HTTP 429) when the tenant's
  queue (``TenantSpec.max_queued_requests``) or the whole queue (``max_queued_requests``) is at its
  bound — ``retry_after_s`` is the time one slot takes to drain at the measured dispatch rate —,
  when the wait it would have (the requests queued ahead of it, and those dispatched that still wait
  in the entry instances — ``push(item, now, waiting_ahead)`` —, at the rate the queue drains while
  it is backlogged, ``BacklogRate``) exceeds ``max_queue_delay_s`` — a request that cannot meet its
  TTFT SLO is refused at once, and the ones admitted keep meeting it under overload; ``retry_after_s``
  is the predicted excess, at least ``QUEUE_BOUND_RETRY_SHARE`` of the bound —, or when the
  tenant's tokens per minute (``TenantSpec.tokens_per_minute``, a token bucket charged prompt + max
  output tokens) are spent: ``retry_after_s`` is the time until they refill. A request that continues
  work done already (``RequestClass.continues``: a dataflow call reading another call's output) is not
  refused for its predicted wait, nor shed for it by ``expire``.
* ``expire(now)``: removes the items past their deadline (``timeout``) and, with ``max_queue_delay_s``,
  those that have waited that long (the prediction at ``push`` lags a drain that slows down, e.g.
  when a burst hits a cold server: no request waits longer than the bound, whatever the estimate);
  the driver fails each with ``expired_error``: a ``RequestTimeoutError`` (HTTP 408, ``error_kind``
  ``TIMED_OUT``) or, for the latter, a ``QueueFullError`` (HTTP 429, ``error_kind`` ``SHED``).
* ``dispatch(now, instances, load, place)``: releases items in the policy's order
  (``distserve.cluster.fair_queue``: ``fair`` by default, ``fcfs``, ``priority``) while some entry
  instance accepts one under ``Backpressure``, and returns (item, instance) pairs; ``place`` (the
  driver's ``pick_entry`` among the accepting instances) chooses where each goes.

Backpressure (``distserve.cluster.backpressure``) holds a request in the fair queues while the
entry instances have enough waiting ahead of it: by default until the prompt tokens waiting there
ahead of it (of its admission rank or a lower one) are fewer than a step computes; TNG's rule
(fewer than ``max_waiting`` requests waiting) is ``waiting_unit="requests"``. A request held back
stays in the fair queues, where a later, more urgent one can still overtake it — whereas a request
in an instance's scheduler queue competes there by its scheduling key: its objective class, then
its admission rank (``AdmissionItem.rank``, which the driver copies to ``Sequence.admission_rank``
at dispatch), then its dispatch order.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from mypy_extensions import mypyc_attr

from distserve.cluster.classes import GroupArrivals, RequestClass
from distserve.cluster.fair_queue import ADMISSION_POLICIES, DEFAULT_ADMISSION_POLICY, DEFAULT_QUANTUM_TOKENS, check_admission_policy
from distserve.cluster.backpressure import (
    DEFAULT_MAX_WAITING, DEFAULT_WAITING_UNIT, NO_BACKPRESSURE, REQUESTS, TOKENS, WAITING_UNITS, Backpressure, EntryLoad, entry_load,
    measured_tpot_s,
)
from distserve.cluster.queue_rates import (  # noqa: F401 - DrainRate, BacklogRate re-exported
    DEFAULT_RETRY_AFTER_S, MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, QUEUE_BOUND_RETRY_SHARE, BacklogRate, DrainRate, TokenBucket,
)
from distserve.cluster.tenants import DEFAULT_TIER, TenantSpec, tenant_weight, tier_rank
from distserve.errors import InvalidConfigError, QueueFullError, RequestTimeoutError

TIMED_OUT = "timeout"  # ``RequestOutput.error_kind`` of a request that waited past its timeout (HTTP 408)
SHED = "shed"  # ``RequestOutput.error_kind`` of a request that waited max_queue_delay_s in the queue (HTTP 429)

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class AdmissionItem:
    """One request waiting for dispatch; ``payload`` is the driver's (its ``Sequence``)."""

    request_id: str
    request_class: RequestClass
    cost: int  # prompt + max output tokens: what fair queueing and the token bucket charge
    arrival: float  # the policies' arrival order (the request's arrival time)
    priority: int = 0  # vLLM's convention: lower first, within a tenant
    timeout_s: float | None = None  # longest wait in the queue before it is dropped
    payload: Any = None
    num_prompt_tokens: int | None = None  # what its prefill computes (None: ``cost``); token backpressure counts it
    tier: str = ""  # set by ``push``: the effective tier (``AdmissionQueue.tier_of``)
    tier_rank: int = 0
    rank: int = 0  # set by ``push``: the policy's level (``fair_queue``); the entry scheduler orders by it too
    order: int = 0  # push order: the last tie-breaker of every policy
    group_arrival: float = 0.0  # set by ``push``: its task group's first (arrival, order), its own if none,
    group_order: int = 0  # so a group's members stay adjacent in every policy's order, as in the schedulers'
    enqueued_at: float = 0.0  # the driver's clock at push
    deadline: float = math.inf
    wait_s: float | None = None  # time queued, set at dispatch (a TTFT breakdown's first term)
    shed: bool = False  # set by ``expire``: it waited max_queue_delay_s (rather than past its own timeout)

    @property
    def prompt_tokens(self) -> int:
        """What its prefill computes (``cost`` when not told)."""
        return self.cost if self.num_prompt_tokens is None else self.num_prompt_tokens

    @property
    def expired_kind(self) -> str:
        """The ``RequestOutput.error_kind`` of this item once expired: ``SHED`` or ``TIMED_OUT``."""
        return SHED if self.shed else TIMED_OUT

    @property
    def tenant(self) -> str:
        return self.request_class.tenant


def _check_delay(max_queue_delay_s: object) -> float | None:
    if max_queue_delay_s is not None and (isinstance(max_queue_delay_s, bool) or not isinstance(max_queue_delay_s, (int, float))
                                          or not (max_queue_delay_s > 0 and math.isfinite(max_queue_delay_s))):
        raise InvalidConfigError(f"max_queue_delay_s must be null or a positive number of seconds, got {max_queue_delay_s!r:.80}",
                                 "max_queue_delay_s")
    return None if max_queue_delay_s is None else float(max_queue_delay_s)


def _check_bound(max_queued_requests: object) -> int | None:
    if max_queued_requests is not None and not (
            isinstance(max_queued_requests, int) and not isinstance(max_queued_requests, bool) and max_queued_requests >= 1):
        raise InvalidConfigError(f"max_queued_requests must be null or an integer >= 1, got {max_queued_requests!r}", "max_queued_requests")
    return max_queued_requests


@mypyc_attr(native_class=False)  # compiled native, a frozen dataclass would not unpickle
@dataclass(frozen=True)
class AdmissionConfig:
    """How a deployment admits requests: one value shared by ``DeploymentConfig`` (both runtimes),
    ``LocalDisaggEngine`` and the simulator's ``SimConfig``, so they queue alike.

    ``policy`` by name (``fair``, ``fcfs``, ``priority``); ``tenants`` the configured ones (others
    get weight 1 and no limits); backpressure holds requests in the fair queues while an entry
    instance has a step's worth of prompt tokens waiting ahead of them (``waiting_unit`` ``tokens``)
    or ``max_waiting`` requests waiting (``requests``; ``max_waiting`` None: dispatch every request
    at once under either) or, with ``tpot_slo_s``, while decoding is slower than it; ``quantum`` the
    tokens a weight-1 tenant sends per round under ``fair``; ``max_queued_requests`` bounds the whole
    queue (None: only the tenants' bounds and the server's in-flight bound apply);
    ``max_queue_delay_s`` bounds the predicted wait in it (None: unbounded; typically the TTFT SLO).
    """

    policy: str = DEFAULT_ADMISSION_POLICY
    tenants: tuple[TenantSpec, ...] = ()
    max_waiting: int | None = DEFAULT_MAX_WAITING
    tpot_slo_s: float | None = None
    quantum: int = DEFAULT_QUANTUM_TOKENS
    max_queued_requests: int | None = None
    waiting_unit: str = DEFAULT_WAITING_UNIT
    max_queue_delay_s: float | None = None

    def __post_init__(self) -> None:
        check_admission_policy(self.policy)
        object.__setattr__(self, "tenants", tuple(self.tenants))
        names = [t.name if isinstance(t, TenantSpec) else t for t in self.tenants]
        if not all(isinstance(t, TenantSpec) for t in self.tenants) or len(set(names)) != len(names):
            raise InvalidConfigError(f"tenants must be TenantSpecs with distinct names, got {names!r:.200}", "tenants")
        if isinstance(self.quantum, bool) or not isinstance(self.quantum, int) or self.quantum < 1:
            raise InvalidConfigError(f"admission quantum must be an integer >= 1, got {self.quantum!r}", "quantum")
        self.backpressure  # validates max_waiting and tpot_slo_s
        _check_bound(self.max_queued_requests)
        _check_delay(self.max_queue_delay_s)

    @property
    def backpressure(self) -> Backpressure:
        return Backpressure(self.max_waiting, self.tpot_slo_s, self.waiting_unit)

    def queue(self) -> AdmissionQueue[Any]:
        """A fresh, empty admission queue with these settings (one per driver, or per run)."""
        return AdmissionQueue(self.policy, {t.name: t for t in self.tenants}, max_queued_requests=self.max_queued_requests,
                              backpressure=self.backpressure, quantum=self.quantum, max_queue_delay_s=self.max_queue_delay_s)


@dataclass
class TenantCounters:
    """One tenant's admission figures (``AdmissionQueue.counters``)."""

    num_queued: int = 0  # in the queue now
    num_admitted: int = 0  # pushed (accepted into the queue)
    num_dispatched: int = 0
    num_rejected_full: int = 0  # 429: its queue or the whole queue at its bound
    num_rejected_rate: int = 0  # 429: its tokens per minute spent
    num_expired: int = 0  # waited past its timeout
    wait_s_total: float = 0.0  # of the dispatched requests
    drain: DrainRate = field(default_factory=DrainRate, repr=False)

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in (
            "num_queued", "num_admitted", "num_dispatched", "num_rejected_full", "num_rejected_rate", "num_expired", "wait_s_total")}


class AdmissionQueue(Generic[T]):
    """Requests between arrival and dispatch, per tenant, released by a policy under backpressure.

    Args:
        policy: ``fair`` (default), ``fcfs`` or ``priority`` (``fair_queue.ADMISSION_POLICIES``).
        tenants: the configured tenants by name; others get ``TenantSpec(name)`` (weight 1, no limits).
        max_queued_requests: bound of the whole queue (None: unbounded).
        max_queue_delay_s: bound of a request's predicted wait in the queue (None: unbounded).
        backpressure: when an entry instance takes a request (``NO_BACKPRESSURE``: always).
        quantum: tokens a weight-1 tenant may send per round under ``fair``.
    """

    def __init__(
        self,
        policy: str = DEFAULT_ADMISSION_POLICY,
        tenants: Mapping[str, TenantSpec] | None = None,
        *,
        max_queued_requests: int | None = None,
        backpressure: Backpressure = Backpressure(),
        quantum: int = DEFAULT_QUANTUM_TOKENS,
        max_queue_delay_s: float | None = None,
    ) -> None:
        self.policy_name = check_admission_policy(policy)
        self.tenants: dict[str, TenantSpec] = dict(tenants or {})
        self._unconfigured: dict[str, TenantSpec] = {}
        for name, spec in self.tenants.items():
            if not isinstance(spec, TenantSpec) or spec.name != name:
                raise InvalidConfigError(f"tenants must map each name to its TenantSpec, got {name!r}: {spec!r:.80}", "tenants")
        self.max_queued_requests = _check_bound(max_queued_requests)
        self.max_queue_delay_s = _check_delay(max_queue_delay_s)
        self.backlog = BacklogRate()
        self.backpressure = backpressure
        # (a function of the tenants, not a bound method: the policy holding this queue would make a
        # cycle, and a simulation's queue would then wait for the cyclic collector)
        self.policy = ADMISSION_POLICIES[policy](functools.partial(tenant_weight, self.tenants), quantum)
        self.counters: dict[str, TenantCounters] = {}
        self.drain = DrainRate()
        self._buckets: dict[str, TokenBucket] = {}
        self._items: dict[str, AdmissionItem] = {}
        self._deadlines: list[tuple[float, int, AdmissionItem]] = []  # heap of the items with a timeout
        self._order = itertools.count()
        self._groups = GroupArrivals()

    # ---- tenants -------------------------------------------------------------------------------
    def spec(self, tenant: str) -> TenantSpec:
        spec = self.tenants.get(tenant)
        if spec is None:  # an unconfigured tenant: the defaults, made once (it is frozen)
            spec = self._unconfigured.get(tenant)
            if spec is None:
                spec = self._unconfigured[tenant] = TenantSpec(tenant)
        return spec

    def tier_of(self, request_class: RequestClass) -> str:
        """A configured tenant's requests run at its tier (a request's ``default`` tier means "my
        tenant's"), or at a lower one the request asks for: a tenant may demote its own work to
        ``batch``, never promote it. Other tenants' requests run at the request's tier."""
        spec = self.tenants.get(request_class.tenant)
        if spec is None:
            return request_class.tier
        if request_class.tier == DEFAULT_TIER:
            return spec.tier
        return max(spec.tier, request_class.tier, key=tier_rank)

    def counters_of(self, tenant: str) -> TenantCounters:
        c = self.counters.get(tenant)
        if c is None:
            c = self.counters[tenant] = TenantCounters()
        return c

    # ---- arrival -------------------------------------------------------------------------------
    def push(self, item: AdmissionItem, now: float, waiting_ahead: int = 0) -> None:
        """Queue ``item`` at ``now``, or raise ``QueueFullError`` (with ``retry_after_s``).

        ``waiting_ahead``: requests dispatched already that wait in the entry instances' scheduler
        queues (they start before it); with ``max_queue_delay_s`` they count in its predicted wait."""
        if item.request_id in self._items:
            raise InvalidConfigError(f"request {item.request_id!r} is already queued for admission", "request_id")
        check_timeout(item.timeout_s)
        tenant = item.tenant
        spec, c = self.spec(tenant), self.counters_of(tenant)
        if spec.max_queued_requests is not None and c.num_queued >= spec.max_queued_requests:
            c.num_rejected_full += 1
            raise QueueFullError(
                f"tenant {tenant!r} has {c.num_queued} requests queued, its limit", None, c.drain.retry_after_s(now))
        if self.max_queued_requests is not None and len(self._items) >= self.max_queued_requests:
            c.num_rejected_full += 1
            raise QueueFullError(
                f"the admission queue holds {len(self._items)} requests, its limit", None, self.drain.retry_after_s(now), shared=True)
        if self.max_queue_delay_s is not None and not item.request_class.continues:
            wait = self.backlog.wait_s(len(self._items) + waiting_ahead)
            if wait is not None and wait > self.max_queue_delay_s:
                c.num_rejected_full += 1
                raise QueueFullError(
                    f"the admission queue holds {len(self._items)} requests ({waiting_ahead} more wait in the entry instances), "
                    f"a predicted wait of {wait:.2f} s, over its "
                    f"limit of {self.max_queue_delay_s:g} s", None,
                    min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, wait - self.max_queue_delay_s,
                                               QUEUE_BOUND_RETRY_SHARE * self.max_queue_delay_s)), shared=True)
        bucket = self._bucket(spec, now)
        if bucket is not None:
            wait = bucket.wait_s(item.cost, now)
            if wait > 0:
                c.num_rejected_rate += 1
                raise QueueFullError(
                    f"tenant {tenant!r} is over its {spec.tokens_per_minute} tokens per minute (this request: {item.cost})",
                    None, max(MIN_RETRY_AFTER_S, wait))
            bucket.take(item.cost)
        item.tier = self.tier_of(item.request_class)
        item.tier_rank = tier_rank(item.tier)
        item.order = next(self._order)
        group = item.request_class.group
        item.group_arrival, item.group_order = (item.arrival, item.order) if group is None else self._groups.first(group, item.arrival, item.order)
        item.enqueued_at = now
        item.deadline = now + item.timeout_s if item.timeout_s is not None else math.inf
        self.policy.now = now
        self.policy.push(item)
        self._items[item.request_id] = item
        if item.timeout_s is not None:
            heapq.heappush(self._deadlines, (item.deadline, item.order, item))
        c.num_queued += 1
        c.num_admitted += 1

    def _bucket(self, spec: TenantSpec, now: float) -> TokenBucket | None:
        if spec.tokens_per_minute is None:
            return None
        bucket = self._buckets.get(spec.name)
        if bucket is None:
            bucket = self._buckets[spec.name] = TokenBucket(spec.tokens_per_minute, now)
        return bucket

    # ---- leaving without dispatch ---------------------------------------------------------------
    def remove(self, request_id: str) -> AdmissionItem | None:
        """Take a queued request out (aborted); None if it is not queued."""
        item = self._items.pop(request_id, None)
        if item is not None:
            self.policy.remove(item)
            self.counters_of(item.tenant).num_queued -= 1
        return item

    def expire(self, now: float) -> list[AdmissionItem]:
        """Remove and return the items whose deadline passed (counted as expired) and those that waited
        ``max_queue_delay_s`` (``shed``, counted as refused)."""
        expired: list[AdmissionItem] = []
        if self.max_queue_delay_s is not None:
            for item in self._items.values():  # in push order: the longest waiting first
                if item.request_class.continues:  # its program's work is done already: not shed for load
                    continue
                if item.enqueued_at + self.max_queue_delay_s > now:
                    break
                expired.append(item)
            for item in expired:
                self.remove(item.request_id)
                item.shed, item.wait_s = True, now - item.enqueued_at
                self.counters_of(item.tenant).num_rejected_full += 1
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)[2]
            if self._items.get(item.request_id) is not item:  # dispatched or removed meanwhile
                continue
            expired.append(item)
            self.remove(item.request_id)
            self.counters_of(item.tenant).num_expired += 1
            item.wait_s = now - item.enqueued_at
        return expired

    # ---- dispatch ------------------------------------------------------------------------------
    def dispatch(
        self,
        now: float,
        instances: Sequence[T],
        load: Callable[[T], EntryLoad],
        place: Callable[[AdmissionItem, list[T]], T],
    ) -> list[tuple[AdmissionItem, T]]:
        """Release items in policy order while some instance accepts the next one.

        ``load`` is read once per instance (a snapshot; each item dispatched here counts as one
        more waiting there), ``place(item, accepting)`` returns the instance the item goes to, one
        of ``accepting`` (the driver's ``pick_entry`` among them). Stops at the first item no
        instance accepts: the policy's order is kept (a later item of a lower tier never overtakes).
        """
        if not self._items or not instances:
            return []
        loads = {id(inst): load(inst) for inst in instances}
        out: list[tuple[AdmissionItem, T]] = []
        self.policy.now = now
        while (item := self.policy.peek()) is not None:
            accepting = [inst for inst in instances if self.backpressure.accepts(loads[id(inst)], item.tier, item.rank, item.prompt_tokens)]
            if not accepting:
                break
            self.policy.pop()
            queued_since = next(iter(self._items.values())).enqueued_at  # the longest waiting (push order), maybe this one
            del self._items[item.request_id]
            chosen = place(item, accepting)
            loads[id(chosen)] = loads[id(chosen)].with_dispatched(item)
            if loads[id(chosen)].shares_decode:  # the decode instances' room is every prefill instance's
                loads = {key: other.with_decode_room_taken(item.prompt_tokens) for key, other in loads.items()}
            item.wait_s = now - item.enqueued_at
            c = self.counters_of(item.tenant)
            c.num_queued -= 1
            c.num_dispatched += 1
            c.wait_s_total += item.wait_s
            c.drain.record(now)
            self.drain.record(now)
            self.backlog.record(now, queued_since)
            out.append((item, chosen))
        return out

    # ---- state -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def request_ids(self) -> list[str]:
        """The queued requests' ids, in push order."""
        return list(self._items)

    def next_deadline(self) -> float:
        """The earliest deadline of a queued request (inf: none has a timeout)."""
        heap = self._deadlines
        while heap and self._items.get(heap[0][2].request_id) is not heap[0][2]:
            heapq.heappop(heap)  # dispatched or removed since it was pushed
        deadline = heap[0][0] if heap else math.inf
        if self.max_queue_delay_s is not None and self._items:
            oldest = next((i for i in self._items.values() if not i.request_class.continues), None)  # the first ``expire`` sheds
            if oldest is not None:
                deadline = min(deadline, oldest.enqueued_at + self.max_queue_delay_s)
        return deadline

    def stats(self) -> dict[str, Any]:
        """Per-tenant counters and the queue's length, for ``stats()`` and /metrics."""
        return {"policy": self.policy_name, "num_queued": len(self._items),
                "tenants": {t: c.as_dict() for t, c in sorted(self.counters.items())}}


AT_ONCE = AdmissionConfig(max_waiting=None)  # every request dispatched on arrival (no backpressure)


def expired_error(item: AdmissionItem, now: float) -> RequestTimeoutError | QueueFullError:
    """The error a driver fails an expired item with (its ``RequestOutput.error_kind``: ``item.expired_kind``)."""
    if item.shed:
        return QueueFullError(
            f"request {item.request_id} waited {now - item.enqueued_at:.3f} s in the admission queue, its limit "
            f"(max_queue_delay): the server is overloaded", None, DEFAULT_RETRY_AFTER_S)
    return RequestTimeoutError(
        f"request {item.request_id} waited {now - item.enqueued_at:.3f} s in the admission queue, longer than its "
        f"timeout of {item.timeout_s} s", "timeout")


def check_timeout(value: object) -> float | None:
    """``value`` as a timeout in seconds (None: none), else an ``InvalidConfigError`` naming ``timeout``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise InvalidConfigError(f"timeout must be null or a positive number of seconds, got {value!r:.80}", "timeout")
    return float(value)


__all__ = [
    "AT_ONCE", "TIMED_OUT", "AdmissionConfig", "AdmissionItem", "AdmissionQueue", "BacklogRate", "Backpressure", "DEFAULT_MAX_WAITING", "DrainRate", "EntryLoad", "NO_BACKPRESSURE", "TOKENS", "REQUESTS", "WAITING_UNITS", "entry_load",
    "SHED", "TenantCounters", "TokenBucket", "check_timeout", "expired_error", "measured_tpot_s",
]
