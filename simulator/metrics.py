"""Per-request latencies, SLO attainment and their summaries: what a simulation (or a real run) reports.

A request meets its SLO when its TTFT <= ``ttft_s`` and its TPOT (mean time per output token after
the first) <= ``tpot_s``. Attainment is the fraction of requests that do. ``joint`` attainment
counts requests meeting both (DistServe's definition); ``ttft``/``tpot`` attainment each alone.
Requests may carry an SLO class with its own targets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from distserve.config import SLO
from distserve.errors import InvalidConfigError

ATTAINMENT_MODES = ("joint", "separate")


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline (seconds on the workload's clock)."""

    req_id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    slo_class: str | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float:
        return math.inf if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if self.finish_s is None or self.first_token_s is None:
            return math.inf
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        return math.inf if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(frozen=True)
class SLOSpec:
    """The default SLO (with the attainment target) and optional per-class SLOs."""

    default: SLO
    classes: Mapping[str, SLO] = field(default_factory=dict)
    mode: str = "joint"

    def __post_init__(self) -> None:
        if self.mode not in ATTAINMENT_MODES:
            raise InvalidConfigError(f"attainment mode must be one of {ATTAINMENT_MODES}, got {self.mode!r}")

    def for_class(self, name: str | None) -> SLO:
        if name is None:
            return self.default
        slo = self.classes.get(name)
        if slo is None:
            raise InvalidConfigError(f"request SLO class {name!r} is not defined; known classes: {sorted(self.classes)}")
        return slo


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def attainment(records: Sequence[RequestRecord], slo: SLOSpec) -> dict[str, float]:
    """Fractions of requests meeting TTFT, TPOT and both."""
    if not records:
        raise InvalidConfigError("no requests to score")
    ok_ttft = ok_tpot = ok_both = 0
    for r in records:
        target = slo.for_class(r.slo_class)
        a = r.ttft_s <= target.ttft_s
        b = r.tpot_s <= target.tpot_s
        ok_ttft += a
        ok_tpot += b
        ok_both += a and b
    n = len(records)
    return {"ttft": ok_ttft / n, "tpot": ok_tpot / n, "joint": ok_both / n}


def meets(att: Mapping[str, float], slo: SLOSpec) -> bool:
    """Whether an attainment dict reaches the target under the spec's mode."""
    target = slo.default.attainment - 1e-12
    if slo.mode == "joint":
        return att["joint"] >= target
    return att["ttft"] >= target and att["tpot"] >= target


def latency_summary(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Mean/P50/P90/P99 of TTFT, TPOT and E2E in seconds."""
    out: dict[str, float] = {}
    for name in ("ttft", "tpot", "e2e"):
        values = np.array([getattr(r, f"{name}_s") for r in records], dtype=np.float64)
        values = values[np.isfinite(values)]
        out[f"{name}_mean_s"] = float(values.mean()) if values.size else math.nan
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = _percentile(values, q)
    return out


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
    stopped_early: bool = False  # ``Simulation.run``'s ``stop_when`` ended it: some records are open

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
            "instances": self.instances,
        }
        if slo is not None:
            att = attainment(self.records, slo)
            out["attainment"] = att
            out["meets_slo"] = meets(att, slo)
        return out
