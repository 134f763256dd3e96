"""What a simulation reports: each request's record (``RequestRecord``) and the run's figures (``SimResult``).

Latencies, attainment and their summaries are ``distserve.slo``'s, the same definitions the load
generator measures a real server with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distserve.cluster.tenants import ANONYMOUS
from distserve.slo import SLOSpec, TimedRequest, attainment, latency_summary, meets


@dataclass(slots=True)
class RequestRecord(TimedRequest):
    """One request's timeline (seconds on the workload's clock): it starts at its arrival, and
    finishes with its last token (the step that produces it ends the request)."""

    req_id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    slo_class: str | None = None
    objective: str = "default"  # the scheduling class's objective: it sets which targets apply (``slo.slo_for_objective``)
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    tenant: str = ANONYMOUS
    dropped: str | None = None  # "rejected" (the admission queue was full) or "expired" (waited past its timeout)
    admission_wait_s: float | None = None  # time in the admission queue before dispatch (the first part of TTFT)

    @property
    def start_s(self) -> float:
        return self.arrival_s

    @property
    def last_token_s(self) -> float | None:
        return self.finish_s

    @property
    def completed(self) -> bool:
        return self.finish_s is not None


@dataclass
class SimResult:
    """What one simulation produced."""

    records: list[RequestRecord]
    num_gpus: int
    duration_s: float  # simulated time until the last request finished
    wall_s: float  # wall-clock time the simulation took
    instances: dict[str, dict[str, float]] = field(default_factory=dict)
    num_migrations: int = 0
    migration_bytes: int = 0
    mean_migration_s: float = 0.0
    num_prefill_tokens_computed: int = 0  # prompt (and recomputed) tokens computed, decodes excluded
    num_prefix_cache_hit_tokens: int = 0  # prompt tokens admissions took from the prefix cache
    stopped_early: bool = False  # ``Simulation.run``'s ``stop_when`` ended it: some records are open
    admission: dict[str, object] = field(default_factory=dict)  # ``AdmissionQueue.stats()`` at the end

    @property
    def tenants(self) -> list[str]:
        return sorted({r.tenant for r in self.records})

    def per_tenant(self, slo: SLOSpec | None = None) -> dict[str, dict[str, object]]:
        """Each tenant's latencies (over its completed requests), attainment, admission wait and drops."""
        out: dict[str, dict[str, object]] = {}
        for tenant in self.tenants:
            records = [r for r in self.records if r.tenant == tenant]
            waits = [r.admission_wait_s for r in records if r.admission_wait_s is not None]
            done = [r for r in records if r.completed]
            row: dict[str, object] = {
                "num_requests": len(records),
                "num_completed": len(done),
                "num_rejected": sum(r.dropped == "rejected" for r in records),
                "num_expired": sum(r.dropped == "expired" for r in records),
                "output_tokens": sum(r.num_output_tokens for r in done),
                "admission_wait_mean_s": sum(waits) / len(waits) if waits else math.nan,
                **latency_summary(records),
            }
            if slo is not None:
                row["attainment"] = attainment(records, slo)
            out[tenant] = row
        return out

    @property
    def num_requests(self) -> int:
        return len(self.records)

    @property
    def requests_per_wall_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else math.inf

    def summary(self, slo: SLOSpec | None = None) -> dict[str, object]:
        """Machine-readable figures (the CLI's ``--json``)."""
        out: dict[str, object] = {
            "num_requests": self.num_requests,
            "num_gpus": self.num_gpus,
            "simulated_s": self.duration_s,
            "wall_s": self.wall_s,
            "throughput_rps": self.num_requests / self.duration_s if self.duration_s > 0 else math.nan,
            **latency_summary(self.records),
            "num_preemptions": sum(r.num_preemptions for r in self.records),
            "num_migrations": self.num_migrations,
            "migration_bytes": self.migration_bytes,
            "mean_migration_s": self.mean_migration_s,
            "prefill_tokens_computed_total": self.num_prefill_tokens_computed,
            "prefix_cache_hit_tokens_total": self.num_prefix_cache_hit_tokens,
            "instances": self.instances,
        }
        if slo is not None:
            att = attainment(self.records, slo)
            out["attainment"] = att
            out["meets_slo"] = meets(att, slo)
        if self.admission:
            out["admission"] = self.admission
        if len(self.tenants) > 1:
            out["tenants"] = self.per_tenant(slo)
        return out
