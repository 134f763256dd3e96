"""The simulator runs the production policy code: same workload, same plans, same migrations.

One workload goes through two drivers of the cluster core: ``LocalDisaggEngine`` (the in-process
runtime; a fake runner samples a fixed token instead of running the model) and the simulator's
``Simulation`` (every step takes ``STEP_S``; KV moves in no time, as the engine's synchronous copy
does). Both build their instances on ``InstanceCore`` and route with ``cluster.routing`` and
``cluster.migration_queue``; the test asserts that every instance launches the same sequence of
plans — per step, which requests and how many tokens each — and that the same requests migrate
between the same instances in the same order.

What is compared, and why it can be: the engine runs in rounds (every prefill instance with work
steps, finished prefills migrate, every decode instance with work steps; requests of round ``k``
are added before it), the simulator in time. With a constant step time, arrivals at ``k·STEP_S``
and instant migrations every simulated event falls on that grid, and prefill step ``k`` of the
engine is the simulated step over ``[k, k+1]·STEP_S``, decode step ``k`` the one over
``[k+1, k+2]·STEP_S``. Both then follow the Ray runtime's rule (``runtime/controller.py``): a
migration completes when the decode side has the KV, and the request decodes in that instance's
next step. For the simulator that needs its rule for events at one instant (every step that ends
then is applied, then finished prefills migrate, then arrivals are routed, then idle instances
launch): a decode step ending at the instant a migration completes is followed by a step that
decodes the migrated request, as the runtime's next step would, having collected the transfer
first. Times themselves are not compared (the engine's are wall-clock), nor plans without tokens
(the engine sends one to drop finished requests' sampler state; the simulator keeps none).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from distserve.config import SchedulerConfig
from distserve.engine.weights import LoadedModel, load_model
from drivers_util import CLASS_SETUP, Arrival, Setup, class_workload, run_engine, run_simulator


def workload() -> list[Arrival]:
    """Two prompt families sharing long prefixes (affinity keeps each on one prefill instance), a few
    strangers, a one-token request that never migrates, bursts and gaps."""
    sys_a = tuple(range(10, 34))  # 6 blocks
    sys_b = tuple(range(40, 60))  # 5 blocks
    return [
        Arrival(0, sys_a + (100, 101, 102), 6),
        Arrival(0, sys_b + (103, 104), 4),
        Arrival(0, tuple(range(180, 193)), 9),
        Arrival(1, sys_a + (105, 106, 107, 108, 109), 5),
        Arrival(1, sys_b + (110,), 1),
        Arrival(2, sys_a + (111,), 7),
        Arrival(2, sys_b + (112, 113, 114, 115, 116, 117), 3),
        Arrival(2, tuple(range(150, 181)), 8),
        Arrival(3, sys_a + (118, 119), 2),
        Arrival(5, sys_b + (120, 121, 122), 6),
        Arrival(5, tuple(range(70, 75)), 10),
        Arrival(5, sys_a + (123,), 4),
        Arrival(6, sys_a + (124, 125, 126, 127, 128, 129, 130), 5),
        Arrival(9, sys_b + (131,), 3),
        Arrival(9, tuple(range(210, 251)), 6),
    ]


SETUPS = {
    "1P1D": Setup(1, 1, 64, SchedulerConfig(max_num_batched_tokens=48), SchedulerConfig(max_num_seqs=4)),
    "2P1D": Setup(2, 1, 64, SchedulerConfig(max_num_batched_tokens=40), SchedulerConfig(max_num_seqs=8)),
    "1P2D": Setup(1, 2, 40, SchedulerConfig(max_num_batched_tokens=64), SchedulerConfig(max_num_seqs=3)),
    "2P2D-tight": Setup(2, 2, 14, SchedulerConfig(max_num_batched_tokens=32), SchedulerConfig(max_num_seqs=4)),
}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.mark.parametrize("name", list(SETUPS))
def test_simulator_and_local_engine_make_the_same_plans_and_migrations(tiny: LoadedModel, name: str) -> None:
    setup, arrivals = SETUPS[name], workload()
    engine_trace, engine = run_engine(tiny, setup, arrivals)
    sim_trace = run_simulator(engine, setup, arrivals)

    # The workload exercises what the drivers could disagree on.
    assert len(engine_trace.migrations) == sum(a.output_len > 1 for a in arrivals)
    decode_batches = [len(step) for inst, steps in engine_trace.steps.items() if inst.startswith("decode") for step in steps]
    assert max(decode_batches) >= 3
    prefill_tokens = sum(n for inst, steps in engine_trace.steps.items() if inst.startswith("prefill") for step in steps for _, n in step)
    assert prefill_tokens < sum(len(a.prompt) for a in arrivals)  # shared prefixes were served from the cache
    used = {src for _, src, _ in engine_trace.migrations} | {dst for _, _, dst in engine_trace.migrations}
    assert len(used) == setup.num_prefill + setup.num_decode
    if name == "2P2D-tight":  # decode memory is short: requests wait for room, running ones are preempted
        assert engine_trace.max_awaiting_migration > 0
        assert all(inst.core.scheduler.num_preemptions > 0 for inst in engine.decode)

    assert dict(sim_trace.steps) == dict(engine_trace.steps)
    assert sim_trace.migrations == engine_trace.migrations
    # ... and count them alike: the same migrations, the same prefix blocks the decode side already held.
    assert sim_trace.counters is not None
    for name in ("num_migrations", "num_blocks_migrated", "num_blocks_skipped"):
        assert getattr(sim_trace.counters, name) == getattr(engine.counters, name), name


def test_prefix_affinity_keeps_a_family_on_one_prefill_instance(tiny: LoadedModel) -> None:
    """2P1D: each family's requests go to the instance that saw its prefix (while within the load bound)."""
    arrivals = workload()
    trace, _ = run_engine(tiny, SETUPS["2P1D"], arrivals)
    entry = {seq: src for seq, src, _ in trace.migrations}
    families: dict[int, set[str]] = defaultdict(set)
    for i, a in enumerate(arrivals):
        if str(i) in entry and a.prompt[0] in (10, 40):
            families[a.prompt[0]].add(entry[str(i)])
    assert families[10] != families[40]
    assert all(len(instances) == 1 for instances in families.values())


def test_the_least_loaded_router_is_the_same_in_both_and_ignores_prefixes(tiny: LoadedModel) -> None:
    """The router is chosen by name in both drivers: least-loaded splits a family that prefix
    affinity keeps together, and the simulator still makes the engine's plans and migrations."""
    setup, arrivals = SETUPS["2P1D"], workload()
    engine_trace, engine = run_engine(tiny, setup, arrivals, router="least-loaded")
    sim_trace = run_simulator(engine, setup, arrivals, router="least-loaded")
    assert dict(sim_trace.steps) == dict(engine_trace.steps)
    assert sim_trace.migrations == engine_trace.migrations
    entry = {seq: src for seq, src, _ in engine_trace.migrations}
    family = {entry[str(i)] for i, a in enumerate(arrivals) if str(i) in entry and a.prompt[0] == 40}
    assert len(family) == 2


def test_with_scheduling_classes_the_simulator_makes_the_same_plans_and_migrations(tiny: LoadedModel) -> None:
    """Latency, throughput and task-group requests (``drivers_util.class_workload``): the class
    rules (policy keys, the decode cap, class- and group-aware routing) are the same code in both."""
    setup, arrivals = CLASS_SETUP, class_workload()
    engine_trace, engine = run_engine(tiny, setup, arrivals)
    sim_trace = run_simulator(engine, setup, arrivals)
    assert len(engine_trace.migrations) == len(arrivals)
    assert dict(sim_trace.steps) == dict(engine_trace.steps)
    assert sim_trace.migrations == engine_trace.migrations
