"""Two drivers of the cluster core on one workload: ``LocalDisaggEngine`` (a fake runner samples a
fixed token instead of running the model) and the simulator's ``Simulation`` (every step takes
``STEP_S``; KV moves in no time, as the engine's synchronous copy does), each recording the plans
its instances launch and the migrations it completes (``Trace``). ``test_equivalence.py`` explains
why the two must then agree; ``test_classes.py`` checks scheduling classes on both.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from distserve.cluster.admission import AdmissionConfig
from distserve.cluster.classes import DEFAULT_CLASS, RequestClass
from distserve.cluster.counters import ClusterCounters
from distserve.cluster.routing import DEFAULT_ROUTER
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.weights import LoadedModel
from distserve.placement import InstanceSpec, Placement
from distserve.runtime.local_disagg import LocalDisaggEngine, StepRunner
from simulator.hardware import get_hardware
from simulator.latency import BatchShape, LatencyModel
from simulator.models import ModelSpec
from simulator.simulation import SAMPLED_TOKEN, SimConfig, Simulation
from simulator.workload import Request

STEP_S = 1.0  # every simulated step; integral, so event times are exact
BLOCK_SIZE = 4

Step = tuple[tuple[str, int], ...]  # (request id, tokens computed) per chunk of one plan


class FakeRunner:
    """A ``StepRunner`` without a model: every sampling chunk gets ``SAMPLED_TOKEN``, as in the simulator."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache = torch.zeros((1, 2, num_blocks, block_size, 1, 1))  # [layers, 2, blocks, block_size, heads, dim]
        self.num_plans = 0

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        self.num_plans += 1
        return [SampledToken(c.seq_id, SAMPLED_TOKEN) for c in plan.chunks if c.sample]


def fake_runner(loaded: LoadedModel, num_blocks: int, cache: CacheConfig, eos: tuple[int, ...]) -> StepRunner:
    return FakeRunner(num_blocks, cache.block_size)


class ConstantStepTime(LatencyModel):
    """Every step with tokens takes ``STEP_S``; migrations take no time."""

    def __init__(self, model: ModelSpec) -> None:
        self.model = model
        self.hardware = get_hardware("a100-80g")

    def step_time(self, shape: BatchShape, tp: int = 1, pp: int = 1) -> float:
        return STEP_S if shape.prefill_tokens or shape.num_decode else 0.0

    def supports(self, tp: int, pp: int) -> bool:
        return True

    def migration_time(self, num_bytes: int, same_node: bool = True, num_links: int = 1) -> float:
        return 0.0


@dataclass
class Trace:
    """What a driver did: per instance the plans it launched, and the migrations in completion order."""

    steps: dict[str, list[Step]] = field(default_factory=lambda: defaultdict(list))
    migrations: list[tuple[str, str, str]] = field(default_factory=list)
    max_awaiting_migration: int = 0  # engine only: the most finished prefills that waited for room after a round
    counters: ClusterCounters | None = None  # simulator only: its migration counters
    records: list[Any] = field(default_factory=list)  # simulator only: its request records

    def on_plan(self, instance_id: str, plan: StepPlan) -> None:
        if plan.chunks:
            self.steps[instance_id].append(tuple((c.seq_id, len(c.token_ids)) for c in plan.chunks))

    def on_migration(self, seq_id: str, src: str, dst: str) -> None:
        self.migrations.append((seq_id, src, dst))


@dataclass(frozen=True)
class Arrival:
    round: int  # added before this engine round; arrives at round * STEP_S in the simulator
    prompt: tuple[int, ...]
    output_len: int
    request_class: RequestClass = DEFAULT_CLASS
    priority: int = 0


@dataclass(frozen=True)
class Setup:
    num_prefill: int
    num_decode: int
    num_blocks: int
    prefill: SchedulerConfig
    decode: SchedulerConfig


class RoundClock:
    """The engine's clock in these runs: round k is at ``k × STEP_S``, the simulator's time of the
    same events (time-dependent decisions, such as the fair queue's bursts, then match)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_engine(
    tiny: LoadedModel, setup: Setup, arrivals: list[Arrival], router: str = DEFAULT_ROUTER, admission: AdmissionConfig = AdmissionConfig()
) -> tuple[Trace, LocalDisaggEngine]:
    engine = LocalDisaggEngine(
        tiny, num_prefill=setup.num_prefill, num_decode=setup.num_decode,
        cache_config=CacheConfig(num_blocks=setup.num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=True),
        prefill_scheduler_config=setup.prefill, decode_scheduler_config=setup.decode, runner_factory=fake_runner, router=router,
        admission=admission, clock=(clock := RoundClock()),
    )
    trace = Trace()
    engine.on_plan, engine.on_migration = trace.on_plan, trace.on_migration
    by_round: dict[int, list[tuple[int, Arrival]]] = defaultdict(list)
    for i, a in enumerate(arrivals):
        by_round[a.round].append((i, a))
    last = max(by_round)
    k = 0
    while k <= last or engine.has_unfinished_requests():
        clock.now = k * STEP_S
        for i, a in by_round.get(k, []):
            sampling = SamplingParams(max_tokens=a.output_len, ignore_eos=True)
            # The simulator's arrival time: the FCFS order of requests arriving together is then their admission order in both.
            engine.add_request(list(a.prompt), sampling, request_id=str(i), arrival_time=a.round * STEP_S, request_class=a.request_class,
                               priority=a.priority)
        engine.step()
        trace.max_awaiting_migration = max(trace.max_awaiting_migration, engine.stats()["num_requests_awaiting_migration"])
        k += 1
        assert k < 1000, "the engine stalled"
    return trace, engine


def run_simulator(
    engine: LocalDisaggEngine, setup: Setup, arrivals: list[Arrival], router: str = DEFAULT_ROUTER, admission: AdmissionConfig = AdmissionConfig()
) -> Trace:
    cfg = engine.model_config
    spec = ModelSpec(cfg.name, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size, cfg.vocab_size, gated_mlp=True, max_position_embeddings=engine.max_model_len)
    placement = Placement(prefill=(InstanceSpec(),) * setup.num_prefill, decode=(InstanceSpec(),) * setup.num_decode)
    config = SimConfig(
        block_size=BLOCK_SIZE, num_blocks=setup.num_blocks, max_model_len=engine.max_model_len,
        prefill_scheduler=setup.prefill, decode_scheduler=setup.decode, enable_prefix_caching=True, router=router,
        admission=admission,
    )
    sim = Simulation(placement, ConstantStepTime(spec), config)
    trace = Trace()
    sim.on_plan, sim.on_migration = trace.on_plan, trace.on_migration
    requests = [
        Request(i, a.round * STEP_S, len(a.prompt), a.output_len, prompt_token_ids=a.prompt,
                objective=a.request_class.objective, group=a.request_class.group, tenant=a.request_class.tenant,
                tier=a.request_class.tier, priority=a.priority)
        for i, a in enumerate(arrivals)
    ]
    result = sim.run(requests)
    trace.counters, trace.records = sim.counters, result.records
    assert all(r.num_output_tokens == a.output_len for r, a in zip(sorted(result.records, key=lambda r: r.req_id), arrivals))
    return trace


# ---- a workload with scheduling classes ---------------------------------------------------------
LATENCY, THROUGHPUT = RequestClass("latency"), RequestClass("throughput")
GROUP = RequestClass("throughput", "g1")  # the producers of one consumer's inputs
CLASS_SETUP = Setup(
    2, 2, 160, SchedulerConfig(max_num_batched_tokens=24),
    SchedulerConfig(max_num_seqs=12, latency_max_num_seqs=2),
)


def class_workload() -> list[Arrival]:
    """Throughput prompts that queue on the prefill instances (one fits a step's budget), latency
    requests arriving behind them, a task group whose members arrive over three rounds while other
    instances are less loaded, and a default request. Prompts share no prefix: affinity plays no part."""

    def prompt(start: int, n: int) -> tuple[int, ...]:
        return tuple(range(start, start + n))

    return [
        Arrival(0, prompt(10, 6), 14, LATENCY),
        Arrival(0, prompt(20, 20), 6, THROUGHPUT),
        Arrival(0, prompt(40, 20), 6, THROUGHPUT),
        Arrival(0, prompt(60, 18), 5, GROUP),
        Arrival(0, prompt(80, 20), 6, THROUGHPUT),
        Arrival(0, prompt(100, 20), 6, THROUGHPUT),
        Arrival(1, prompt(120, 5), 10, LATENCY),
        Arrival(1, prompt(130, 17), 4, GROUP),
        Arrival(2, prompt(150, 7), 8, LATENCY),
        Arrival(2, prompt(160, 20), 5, THROUGHPUT),
        Arrival(2, prompt(180, 19), 3, GROUP),
        Arrival(3, prompt(220, 19), 4),
        Arrival(3, prompt(210, 6), 6, LATENCY),
    ]
