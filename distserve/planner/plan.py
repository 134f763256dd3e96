"""What a placement search is asked and what it answers: the cluster, the request, each simulated
candidate, and the deployable plans (``PlanOption``) of a ``PlanResult``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from distserve.errors import InvalidConfigError
from distserve.placement import Placement
from distserve.planner.classes import ClassComparison, check_class_slos
from simulator.hardware import HardwareSpec
from simulator.latency import LatencyModel
from distserve.slo import SLO, SLOSpec
from simulator.simulation import SimConfig
from simulator.workload import Request

AFFINITIES = ("high", "low", "auto")


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` × ``gpus_per_node`` devices of one type; bandwidth overrides in bytes/s."""

    num_nodes: int
    gpus_per_node: int
    gpu: HardwareSpec

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise InvalidConfigError(f"--nodes and --gpus-per-node must be >= 1, got {self.num_nodes} and {self.gpus_per_node}")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @classmethod
    def of(cls, num_nodes: int, gpus_per_node: int, gpu: HardwareSpec,
           intra_node_bandwidth: float | None = None, inter_node_bandwidth: float | None = None) -> "Cluster":
        changes = {k: v for k, v in (("intra_node_bandwidth", intra_node_bandwidth), ("inter_node_bandwidth", inter_node_bandwidth)) if v is not None}
        for key, value in changes.items():
            if not value > 0:
                raise InvalidConfigError(f"{key} must be > 0, got {value}")
        return cls(num_nodes, gpus_per_node, replace(gpu, **changes) if changes else gpu)


@dataclass(frozen=True)
class PlanRequest:
    """Everything the search needs. ``unit_requests`` arrive at 1 request/s (they are rescaled)."""

    latency: LatencyModel
    cluster: Cluster
    unit_requests: tuple[Request, ...]
    slo: SLOSpec
    rate: float | None = None  # target traffic; None: the most goodput within the GPU budget
    gpu_budget: int | None = None  # GPUs the plan may use (default: the whole cluster)
    affinity: str = "auto"
    sim_config: SimConfig = field(default_factory=SimConfig)
    rel_tol: float = 0.05
    max_workers: int = 1
    # Stop a candidate's search once it certainly falls short of the best so far (exact: the same
    # plan); False searches every candidate in full (bench_planner's reference).
    stop_losers: bool = True
    # End each simulated probe once its SLO verdict is certain (exact: the same outcome; False runs
    # every probe to its last request, bench_planner's reference).
    stop_probes: bool = True
    # One SLO per scheduling-class objective of the workload (``planner.classes``): with two or more
    # objectives, the best disaggregated plan is also weighed split into class pools (and with larger batch caps).
    class_slos: Mapping[str, SLO] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.class_slos:
            check_class_slos(self.unit_requests, self.class_slos)
        if self.affinity not in AFFINITIES:
            raise InvalidConfigError(f"--affinity must be one of {AFFINITIES}, got {self.affinity!r}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise InvalidConfigError(f"--rate must be a positive number, got {self.rate}")
        if not self.unit_requests:
            raise InvalidConfigError("the workload has no requests")
        if self.gpu_budget is not None and not 1 <= self.gpu_budget <= self.cluster.num_gpus:
            raise InvalidConfigError(f"--gpus must be in [1, {self.cluster.num_gpus}] (the cluster's GPUs), got {self.gpu_budget}")
        if self.rate is not None and self.gpu_budget is not None:
            raise InvalidConfigError("give either --rate (size the plan for it) or --gpus (best goodput within a budget), not both")


@dataclass
class Candidate:
    """One simulated configuration and its goodput."""

    kind: str  # "prefill" | "decode" | "unit" | "colocated"
    placement: Placement
    num_gpus: int
    bound_rate: float  # steady-state throughput upper bound, requests/s
    goodput: float = 0.0  # requests/s meeting the SLO (of this phase alone for prefill/decode), <= bound_rate
    binding: str | None = None
    probes: list[tuple[float, dict[str, float], bool]] = field(default_factory=list)
    skipped: str | None = None  # why it was not simulated (its unloaded latency misses the SLO, or its bound cannot beat the winner)
    # Set when the search stopped because it could no longer beat its chain's winner: the most it may
    # still find (the goodput is at most this, at most the winner's per GPU on as many GPUs); ``goodput`` stays 0.
    goodput_below: float | None = None
    num_probes_stopped: int = 0  # probes ended as soon as they could no longer pass
    step_budget: str = "static"  # colocated: the scheduler's step budget policy it was simulated with (or its step policy, "vllm-2023")

    @property
    def per_gpu(self) -> float:
        return self.goodput / self.num_gpus

    def label(self) -> str:
        p = self.placement
        parts = []
        for name, specs in (("P", p.prefill), ("D", p.decode), ("C", p.colocated)):
            if specs:
                parts.append(f"{len(specs)}{name} tp{specs[0].tp}pp{specs[0].pp}")
        return " + ".join(parts) + {"slo": " (slo budget)", "vllm-2023": " (vllm-2023)"}.get(self.step_budget, "")


@dataclass
class PlanOption:
    """A deployable plan: the placement, its size and predicted figures."""

    name: str  # "disaggregated (high affinity)" | "disaggregated (low affinity)" | "colocated"
    placement: Placement
    num_gpus: int
    rate: float  # requests/s the plan is predicted to serve within SLO
    predicted: dict[str, Any] = field(default_factory=dict)

    @property
    def per_gpu(self) -> float:
        return self.rate / self.num_gpus if self.num_gpus else 0.0


@dataclass
class PlanResult:
    best: PlanOption | None
    options: list[PlanOption]
    candidates: list[Candidate]
    num_simulated: int
    feasible: bool
    closest: str | None = None  # for impossible SLOs: the closest candidate and the binding SLO
    notes: list[str] = field(default_factory=list)  # e.g. a target rate the cluster cannot serve
    classes: ClassComparison | None = None  # per-class goodput of the shared plan and its class-pool splits

    @property
    def colocated(self) -> PlanOption | None:
        return next((o for o in self.options if o.name == "colocated"), None)
