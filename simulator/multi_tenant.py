"""Workloads of several tenants: the "one flooding tenant + N light tenants" generator (issue 17's
benchmark), by name (``flood[:N[:FACTOR]]``) for ``distserve simulate --workload``.

The flooding tenant sends ``factor`` times the request rate of each light tenant, with long prompts
(``summarization`` lengths); the light tenants chat (``chatbot`` lengths). Under FCFS admission the
light tenants queue behind the flood; under fair queueing each tenant gets its weight's share of
the tokens, so the light tenants' requests wait only behind their own.
"""

from __future__ import annotations

from dataclasses import replace

from distserve.errors import InvalidConfigError
from simulator.lengths import check_int
from simulator.workload import Request, generate_requests

FLOOD_TENANT = "flood"
DEFAULT_NUM_LIGHT = 3
DEFAULT_FLOOD_FACTOR = 10


def light_tenant(i: int) -> str:
    return f"light-{i}"


def is_flood_spec(spec: str) -> bool:
    return spec == "flood" or spec.startswith("flood:")


def parse_flood_spec(spec: str) -> tuple[int, float]:
    """(light tenants, flood factor) of ``flood``, ``flood:N`` or ``flood:N:FACTOR``."""
    parts = spec.split(":")
    try:
        if parts[0] != "flood" or len(parts) > 3:
            raise ValueError
        num_light = int(parts[1]) if len(parts) > 1 else DEFAULT_NUM_LIGHT
        factor = float(parts[2]) if len(parts) > 2 else float(DEFAULT_FLOOD_FACTOR)
    except ValueError:
        raise InvalidConfigError(f"bad flood workload {spec!r}: expected flood[:<light tenants>[:<flood factor>]], e.g. flood:3:10",
                                 "workload") from None
    if num_light < 1 or not factor > 0:
        raise InvalidConfigError(f"bad flood workload {spec!r}: need at least one light tenant and a factor > 0", "workload")
    return num_light, factor


def flood_workload(
    rate: float,
    num_requests: int,
    *,
    num_light: int = DEFAULT_NUM_LIGHT,
    factor: float = DEFAULT_FLOOD_FACTOR,
    seed: int = 0,
    max_total_len: int | None = None,
    arrival: str = "poisson",
    cv: float = 1.0,
    flood_lengths: str = "summarization",
    light_lengths: str = "chatbot",
) -> list[Request]:
    """``num_requests`` requests arriving at ``rate`` in all: tenant ``flood`` at ``factor`` times the
    rate of each of ``num_light`` tenants ``light-0``…; ``req_id`` 0.. in arrival order."""
    check_int("num_light", num_light, 1)
    check_int("num_requests", num_requests, num_light + 1, "(one per tenant)")
    unit = rate / (factor + num_light)  # one light tenant's rate
    tenants = [(FLOOD_TENANT, factor * unit, flood_lengths)] + [(light_tenant(i), unit, light_lengths) for i in range(num_light)]
    merged: list[Request] = []
    for k, (tenant, tenant_rate, lengths) in enumerate(tenants):
        n = max(1, round(num_requests * tenant_rate / rate))
        reqs = generate_requests(lengths, tenant_rate, n, arrival=arrival, cv=cv, seed=seed * 7919 + k, max_total_len=max_total_len)
        merged.extend(replace(r, tenant=tenant) for r in reqs)
    merged.sort(key=lambda r: (r.arrival_s, r.tenant))
    return [replace(r, req_id=i) for i, r in enumerate(merged)]


__all__ = ["DEFAULT_FLOOD_FACTOR", "DEFAULT_NUM_LIGHT", "FLOOD_TENANT", "flood_workload", "is_flood_spec", "light_tenant", "parse_flood_spec"]
