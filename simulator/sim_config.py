"""``SimConfig``: the knobs of a simulated deployment (scheduler limits, memory, runtime constants,
routing and admission), with the defaults of ``distserve serve``."""

from __future__ import annotations

from dataclasses import dataclass, field

from distserve.cluster.admission import AdmissionConfig
from distserve.cluster.routing import DEFAULT_ROUTER, check_router
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
    # Extra cost per sequence in a step: per-request work around the model that grows with the batch (sampling,
    # detokenizing and streaming in a Python engine, as vLLM 2023's; ``experiments/align_real_traces.py`` fits it).
    seq_overhead_s: float = 0.0
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
    # A step's prompts computed as one [prompts × longest prompt] batch, padding the shorter ones, as
    # vLLM before 0.4 did (its model runner's ``_prepare_prompt`` made [num_prompts, max_prompt_len]
    # input tensors): the step costs what that many copies of its longest prompt (chunk) would.
    prefill_padding: bool = False
    # The runtime's prefix cache (``CacheConfig.enable_prefix_caching``) and, with it, prefix
    # affinity in entry routing; it matters only for requests that carry ``prompt_token_ids``.
    enable_prefix_caching: bool = False
    router: str = DEFAULT_ROUTER  # the entry rule, by name (``distserve.cluster.routing.ROUTERS``), as ``serve --router``
    # Admission (``distserve.cluster.admission``): policy, tenants, backpressure — the runtime's defaults.
    admission: AdmissionConfig = AdmissionConfig()
    # Keep decoding sequences compact and skip steady stretches of decode steps in one jump
    # (``simulator.fast_forward``): the same results, step for step; off, every step goes through
    # the scheduler one sequence at a time (to compare).
    fast_forward: bool = True
    # Under TPOT backpressure (``admission.tpot_slo_s``) on a disaggregated deployment, the prefill side
    # holds only as many requests as the decode instances' time per token leaves room for
    # (``cluster.backpressure.decode_headroom``), as the runtimes do; off (an ablation), the rule reads
    # only the latest decode step, all or nothing.
    decode_headroom: bool = True

    def __post_init__(self) -> None:
        check_router(self.router)
        if not isinstance(self.admission, AdmissionConfig):
            raise InvalidConfigError(f"admission must be an AdmissionConfig, got {type(self.admission).__name__}", "admission")
        if self.block_size < 1:
            raise InvalidConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0 < self.mem_utilization <= 1:
            raise InvalidConfigError(f"mem_utilization must be in (0, 1], got {self.mem_utilization}")
        if self.step_overhead_s < 0:
            raise InvalidConfigError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")
        if self.seq_overhead_s < 0:
            raise InvalidConfigError(f"seq_overhead_s must be >= 0, got {self.seq_overhead_s}")
        if not self.step_time_scale > 0:
            raise InvalidConfigError(f"step_time_scale must be > 0, got {self.step_time_scale}")
        if self.prefill_time_scale is not None and not self.prefill_time_scale > 0:
            raise InvalidConfigError(f"prefill_time_scale must be > 0, got {self.prefill_time_scale}")
        if self.migration_overhead_s < 0:
            raise InvalidConfigError(f"migration_overhead_s must be >= 0, got {self.migration_overhead_s}")
        if self.concurrent_slowdown < 1:
            raise InvalidConfigError(f"concurrent_slowdown must be >= 1, got {self.concurrent_slowdown}")

    @property
    def prefill_scale(self) -> float:
        """The step-time scale of steps with prompt tokens."""
        return self.step_time_scale if self.prefill_time_scale is None else self.prefill_time_scale
