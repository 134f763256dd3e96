"""Scheduling classes: what a request's caller says about how it is to be served, and the policies
every driver (the in-process engines, the Ray controller, the simulator) applies to it.

A ``RequestClass`` is an **objective** and an optional **task group**. The dataflow layer deduces
both per call (``CallNode.objective``, ``CallNode.task_group``); a plain API request is ``default``.
It also names the request's **tenant** and priority **tier** (``distserve.cluster.tenants``), which
admission (fair queueing across tenants, tiers) reads.

* ``latency``: someone waits on this output. It is admitted (prefill) before default and
  throughput requests whatever the policy (``class_rank``; default requests in turn go before
  throughput ones), and decoded, given a choice, on a
  decode instance without throughput work whose batch is kept small: other requests go elsewhere
  while it holds ``SchedulerConfig.latency_max_num_seqs`` or more (``decode_preference``).
* ``throughput``: only the completion matters (a step of a larger job). It is kept off decode
  instances holding latency work when there is a choice, and its SLO checks completion alone
  (``distserve.slo.slo_for_objective``).
* ``default``: as before classes existed.
* a task group (e.g. the producers of one consumer's inputs) is finished when its last member is:
  its members are kept adjacent in the waiting order, keyed by the group's first arrival
  (``GroupArrivals``), and go to one prefill/decode pair (``distserve.cluster.routing``).

Pure policy, no engine imports: the scheduler, routing and the simulator import it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from distserve.cluster.tenants import ANONYMOUS, DEFAULT_TIER, InvalidTenantError, check_tenant_name, check_tier, tier_rank
from distserve.errors import DistServeError

DEFAULT, LATENCY, THROUGHPUT = "default", "latency", "throughput"
OBJECTIVES = (DEFAULT, LATENCY, THROUGHPUT)
MAX_GROUP_CHARS = 256  # a group id is remembered per instance: keep it small
MAX_REMEMBERED_GROUPS = 1024  # task groups remembered per scheduler and per route state (LRU)


class InvalidRequestClassError(DistServeError):
    """A request's scheduling class is malformed (``param`` names the field: objective, group)."""


@mypyc_attr(native_class=False)  # compiled native, a frozen dataclass would not unpickle
@dataclass(frozen=True, slots=True)
class RequestClass:
    """How a request is to be served: its ``objective``, the task ``group`` it belongs to (None:
    none), and whose it is: its ``tenant`` and priority ``tier`` (``distserve.cluster.tenants``).

    ``continues``: the request continues work the server has done already — a dataflow call that reads a
    variable another call generated. Refusing it for load would throw that work away and fail its program
    (under a 10x burst, two thirds of the programs whose first call had run), so the admission queue's load
    bounds pass it: the predicted wait (``max_queue_delay_s``) neither refuses nor sheds it. Its hard bounds
    (queue length, a tenant's limits, a timeout) still apply. Set by the server, never by a client."""

    objective: str = DEFAULT
    group: str | None = None
    tenant: str = ANONYMOUS
    tier: str = DEFAULT_TIER
    continues: bool = False

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise InvalidRequestClassError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}", "objective")
        if self.group is not None and not (isinstance(self.group, str) and 0 < len(self.group) <= MAX_GROUP_CHARS):
            raise InvalidRequestClassError(
                f"group must be null or a non-empty string of at most {MAX_GROUP_CHARS} characters, got {self.group!r:.80}", "group"
            )
        try:
            check_tenant_name(self.tenant)
            check_tier(self.tier)
        except InvalidTenantError as exc:
            raise InvalidRequestClassError(str(exc), exc.param) from None

    @property
    def rank(self) -> int:
        return class_rank(self.objective)

    @property
    def tier_rank(self) -> int:
        return tier_rank(self.tier)


DEFAULT_CLASS = RequestClass()


def check_request_class(value: object) -> RequestClass:
    """``value`` as a ``RequestClass`` (None: the default class); anything else is an
    ``InvalidRequestClassError`` naming ``request_class``."""
    if value is None:
        return DEFAULT_CLASS
    if not isinstance(value, RequestClass):
        raise InvalidRequestClassError(f"request_class must be a RequestClass or None, got {type(value).__name__}", "request_class")
    return value


_RANKS = {LATENCY: 0, DEFAULT: 1, THROUGHPUT: 2}


def class_rank(objective: str) -> int:
    """The first element of every scheduling policy's key: latency requests (0) go first, then
    default ones (1, plain API requests: someone may be waiting), then throughput work (2, only its
    completion matters), so a job's backlog never queues interactive requests behind it."""
    return _RANKS[objective]


def decode_preference(objective: str, num_latency: int, num_throughput: int, num_assigned: int, latency_cap: int) -> int:
    """How well a decode instance holding ``num_assigned`` requests, ``num_latency`` of the latency
    and ``num_throughput`` of the throughput class, suits a request of ``objective`` (0 best).

    The two classes are not mixed when there is a choice, and an instance holding latency work is
    kept to ``latency_cap`` requests (its small batch is what keeps their TPOT low) while another
    has room: latency requests join such an instance below the cap (0), else go where there is no
    throughput work (1), else anywhere (2); throughput requests go where there is no latency work
    (0), else anywhere (1); default ones anywhere but to latency instances at the cap (1).
    """
    latency_full = num_latency > 0 and num_assigned >= latency_cap
    if objective == LATENCY:
        if num_throughput:
            return 2
        return 0 if num_latency and not latency_full else 1
    if objective == THROUGHPUT:
        return 1 if num_latency else 0
    return 1 if latency_full else 0


class GroupArrivals:
    """The (arrival time, admission order) of each task group's first member, for the last
    ``max_groups`` groups seen (LRU): a group's members are ordered by it, so they stay adjacent.

    A group forgotten and seen again starts anew at its next member: at worst it is split, never lost.
    """

    def __init__(self, max_groups: int = MAX_REMEMBERED_GROUPS) -> None:
        self.max_groups = max_groups
        self._first: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def first(self, group: str, arrival: float, order: int) -> tuple[float, int]:
        """The group's key; (``arrival``, ``order``) if this member is the first one remembered."""
        first = self._first.get(group)
        if first is None:
            first = self._first[group] = (arrival, order)
            if len(self._first) > self.max_groups:
                self._first.popitem(last=False)
        else:
            self._first.move_to_end(group)
        return first

    def __len__(self) -> int:
        return len(self._first)


__all__ = [
    "DEFAULT", "DEFAULT_CLASS", "GroupArrivals", "InvalidRequestClassError", "LATENCY", "MAX_GROUP_CHARS",
    "MAX_REMEMBERED_GROUPS", "OBJECTIVES", "RequestClass", "THROUGHPUT", "check_request_class", "class_rank",
    "decode_preference",
]
