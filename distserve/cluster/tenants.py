"""Tenants: who a request is for, how much of the cluster they are owed, and their limits.

A ``TenantSpec`` is what an operator configures per tenant (``serve --api-keys FILE``: key →
tenant): a ``weight`` (its share under fair queueing, by tokens), a priority ``tier``
(``interactive`` > ``default`` > ``batch``: batch work is dispatched only while no interactive or
default work waits) and limits — requests queued in the admission queue, semantic-variable
sessions, and tokens (prompt + max output) admitted per minute. Without keys every request belongs
to the one ``ANONYMOUS`` tenant, today's behaviour.

A request carries its tenant and tier in its ``RequestClass`` (``distserve.cluster.classes``), so
they reach every driver (the in-process engines, the Ray controller, the simulator) the way the
objective and task group do. Pure policy, no engine imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from distserve.errors import DistServeError

INTERACTIVE, DEFAULT_TIER, BATCH = "interactive", "default", "batch"
TIERS = (INTERACTIVE, DEFAULT_TIER, BATCH)
_TIER_RANKS = {INTERACTIVE: 0, DEFAULT_TIER: 1, BATCH: 2}
ANONYMOUS = "anonymous"  # the tenant of every request when no API keys are configured
MAX_TENANT_CHARS = 64  # tenant names label Prometheus series and route state: keep them small


class InvalidTenantError(DistServeError):
    """A tenant or tier is malformed (``param`` names the field)."""


def tier_rank(tier: str) -> int:
    """0 for interactive, 1 default, 2 batch: lower is dispatched first."""
    return _TIER_RANKS[tier]


def check_tier(value: object, param: str = "tier") -> str:
    if value not in _TIER_RANKS:
        raise InvalidTenantError(f"{param} must be one of {', '.join(TIERS)}, got {value!r:.80}", param)
    return value  # type: ignore[return-value]


def check_tenant_name(value: object, param: str = "tenant") -> str:
    if not (isinstance(value, str) and 0 < len(value) <= MAX_TENANT_CHARS and value.isprintable()):
        raise InvalidTenantError(
            f"{param} must be a non-empty printable string of at most {MAX_TENANT_CHARS} characters, got {value!r:.80}", param
        )
    return value


@mypyc_attr(native_class=False)  # compiled native, a frozen dataclass would not unpickle
@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant's share and limits (None: unlimited)."""

    name: str = ANONYMOUS
    weight: float = 1.0  # share of the cluster's tokens under fair queueing, relative to other tenants
    tier: str = DEFAULT_TIER
    max_queued_requests: int | None = None  # in the admission queue; beyond it 429 with Retry-After
    max_sessions: int | None = None  # semantic-variable sessions open at once
    tokens_per_minute: int | None = None  # prompt + max output tokens admitted per minute

    def __post_init__(self) -> None:
        check_tenant_name(self.name, "name")
        check_tier(self.tier)
        if not (isinstance(self.weight, (int, float)) and not isinstance(self.weight, bool) and 0 < self.weight < float("inf")):
            raise InvalidTenantError(f"weight must be a positive number, got {self.weight!r:.80}", "weight")
        for field_name in ("max_queued_requests", "max_sessions", "tokens_per_minute"):
            value = getattr(self, field_name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise InvalidTenantError(f"{field_name} must be null or an integer >= 1, got {value!r:.80}", field_name)


ANONYMOUS_TENANT = TenantSpec()


def tenant_weight(tenants: Mapping[str, TenantSpec], tenant: str) -> float:
    """``tenant``'s fair-queueing weight: its spec's in ``tenants``, 1 for a tenant not configured."""
    spec = tenants.get(tenant)
    return spec.weight if spec is not None else 1.0

__all__ = [
    "ANONYMOUS", "ANONYMOUS_TENANT", "BATCH", "DEFAULT_TIER", "INTERACTIVE", "InvalidTenantError", "MAX_TENANT_CHARS",
    "TIERS", "TenantSpec", "check_tenant_name", "check_tier", "tenant_weight", "tier_rank",
]
