"""``SimConfig``: the knobs of a simulated deployment (scheduler limits, memory, runtime constants,
routing and admission), with the defaults of ``distserve serve``."""

from __future__ import annotations

from dataclasses import dataclass, field

from distserve.cluster.admission import AdmissionQueue, Backpressure
from distserve.cluster.fair_queue import DEFAULT_ADMISSION_POLICY, DEFAULT_QUANTUM_TOKENS, check_admission_policy
from distserve.cluster.routing import DEFAULT_ROUTER, check_router
from distserve.cluster.tenants import TenantSpec
from distserve.config import SchedulerConfig
from distserve.errors import InvalidConfigError


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulated runtime; the defaults are those of ``distserve serve``."""

    block_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # colocated instances
    prefill_scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    decode_scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_blocks: int | None = None  # KV blocks per instance; None: what fits in memory (latency model)
    mem_utilization: float = 0.9
    step_overhead_s: float = 0.0  # extra fixed cost per step (e.g. the runtime's controller round trip)
    max_model_len: int | None = None  # default: the model's context length
    # Phase-isolated search (DistServe's per-phase goodput): prefill instances take no time, so
    # the decode phase is measured alone.
    instant_prefill: bool = False
    # How many times longer a step takes while another instance on the same node computes (1:
    # independent devices). distserve.measure.profiler.measure_concurrent_slowdown measures it (~2 for two
    # one-thread workers on a VM whose two vCPUs share a core). pp > 1 instances are left out.
    concurrent_slowdown: float = 1.0
    # A deployment's runtime constants, measured on it (validate_simulator's solo-request calibration):
    # how many times the latency model's step time a step takes in the serving process (steps with
    # prompt tokens: ``prefill_time_scale``, default the same), and the fixed cost of a KV
    # migration on top of the link time (the controller's reserve round trip, the decode instance
    # noticing the arrival).
    step_time_scale: float = 1.0
    prefill_time_scale: float | None = None
    migration_overhead_s: float = 0.0
    # The runtime's prefix cache (``CacheConfig.enable_prefix_caching``) and, with it, prefix
    # affinity in entry routing; it matters only for requests that carry ``prompt_token_ids``.
    enable_prefix_caching: bool = False
    router: str = DEFAULT_ROUTER  # the entry rule, by name (``distserve.cluster.routing.ROUTERS``), as ``serve --router``
    # Admission (``distserve.cluster.admission``): the policy by name, the configured tenants
    # (others get weight 1), the bound of the whole queue, and backpressure — an entry instance
    # takes requests while fewer than ``max_waiting`` wait in it (None: at once, as before
    # admission existed) and, with ``backpressure_tpot_slo_s``, while decoding is within it.
    admission_policy: str = DEFAULT_ADMISSION_POLICY
    admission_quantum: int = DEFAULT_QUANTUM_TOKENS  # tokens per round of a weight-1 tenant under ``fair``
    tenants: tuple[TenantSpec, ...] = ()
    max_queued_requests: int | None = None
    # None until the Ray runtime and the threaded client hold requests too: the simulator predicts what `serve` runs.
    max_waiting: int | None = None
    backpressure_tpot_slo_s: float | None = None

    def __post_init__(self) -> None:
        check_router(self.router)
        check_admission_policy(self.admission_policy)
        self.backpressure  # validates max_waiting and backpressure_tpot_slo_s
        if len({t.name for t in self.tenants}) != len(self.tenants):
            raise InvalidConfigError(f"tenants must have distinct names, got {[t.name for t in self.tenants]}", "tenants")
        if self.block_size < 1:
            raise InvalidConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0 < self.mem_utilization <= 1:
            raise InvalidConfigError(f"mem_utilization must be in (0, 1], got {self.mem_utilization}")
        if self.step_overhead_s < 0:
            raise InvalidConfigError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")
        if not self.step_time_scale > 0:
            raise InvalidConfigError(f"step_time_scale must be > 0, got {self.step_time_scale}")
        if self.prefill_time_scale is not None and not self.prefill_time_scale > 0:
            raise InvalidConfigError(f"prefill_time_scale must be > 0, got {self.prefill_time_scale}")
        if self.migration_overhead_s < 0:
            raise InvalidConfigError(f"migration_overhead_s must be >= 0, got {self.migration_overhead_s}")
        if self.concurrent_slowdown < 1:
            raise InvalidConfigError(f"concurrent_slowdown must be >= 1, got {self.concurrent_slowdown}")

    @property
    def backpressure(self) -> Backpressure:
        return Backpressure(self.max_waiting, self.backpressure_tpot_slo_s)

    def admission_queue(self) -> AdmissionQueue:
        """A fresh admission queue with these settings (one per run)."""
        return AdmissionQueue(self.admission_policy, {t.name: t for t in self.tenants},
                              max_queued_requests=self.max_queued_requests, backpressure=self.backpressure,
                              quantum=self.admission_quantum)

    @property
    def prefill_scale(self) -> float:
        """The step-time scale of steps with prompt tokens."""
        return self.step_time_scale if self.prefill_time_scale is None else self.prefill_time_scale
