"""The admission queue is one piece of the cluster core: ``LocalDisaggEngine`` and the simulator
run it alike. Two tenants (one floods), tiers and priorities, under each policy with backpressure:
both drivers make the same plans and migrations (``test_equivalence.py`` says why they can), and
the policies differ where they should."""

from __future__ import annotations

import pytest

from distserve.cluster.classes import RequestClass
from distserve.cluster.tenants import TenantSpec
from distserve.config import SchedulerConfig
from distserve.engine.weights import LoadedModel, load_model
from distserve.cluster.admission import AdmissionConfig as Admission
from drivers_util import Arrival, Setup, Trace, run_engine, run_simulator

HEAVY, LIGHT = RequestClass(tenant="heavy"), RequestClass(tenant="light")
BULK = RequestClass("throughput", tenant="bulk")
TENANTS = (TenantSpec("heavy"), TenantSpec("light", weight=2.0), TenantSpec("bulk", tier="batch"))
SETUP = Setup(2, 1, 96, SchedulerConfig(max_num_batched_tokens=24), SchedulerConfig(max_num_seqs=6))


def workload() -> list[Arrival]:
    """The heavy tenant sends a burst of long prompts, the light one short prompts a round later,
    a batch tenant some throughput work; distinct prompts (no prefix affinity)."""
    def prompt(start: int, n: int) -> tuple[int, ...]:
        return tuple(range(start, start + n))

    heavy = [Arrival(0, prompt(10 + 20 * i, 18), 4, HEAVY) for i in range(8)]
    light = [Arrival(1, prompt(200 + 10 * i, 5), 6, LIGHT, priority=1 - i) for i in range(3)]
    bulk = [Arrival(1, prompt(228 + 9 * i, 8), 3, BULK) for i in range(2)]
    return heavy + light + bulk + [Arrival(4, prompt(248, 6), 5, LIGHT)]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def first_prefills(steps: dict[str, list[tuple[tuple[str, int], ...]]]) -> list[str]:
    """Requests in the order their prefill starts (prefill instances' plans, by round)."""
    order: list[str] = []
    rounds = max(len(v) for k, v in steps.items() if k.startswith("prefill"))
    for k in range(rounds):
        for inst in sorted(i for i in steps if i.startswith("prefill")):
            if k < len(steps[inst]):
                order.extend(sid for sid, _ in steps[inst][k] if sid not in order)
    return order


@pytest.mark.parametrize("policy", ["fcfs", "fair", "priority"])
def test_both_drivers_admit_alike(tiny: LoadedModel, policy: str) -> None:
    admission = Admission(policy, TENANTS, quantum=16)  # tiny requests (11-22 tokens): a small quantum
    arrivals = workload()
    engine_trace, engine = run_engine(tiny, SETUP, arrivals, admission=admission)
    sim_trace = run_simulator(engine, SETUP, arrivals, admission=admission)
    assert dict(sim_trace.steps) == dict(engine_trace.steps)
    assert sim_trace.migrations == engine_trace.migrations
    order = first_prefills(engine_trace.steps)
    pos = {sid: k for k, sid in enumerate(order)}
    # Requests 0-5 (heavy) fill both prefill queues (backpressure: 3 each) before the light ones
    # (8, 9, 10 with priorities 1, 0, -1) and the batch ones (11, 12) arrive.
    if policy == "fcfs":
        assert pos["8"] < pos["9"] < pos["10"] and pos["10"] > pos["7"]  # arrival order: behind the heavy burst
        assert pos["11"] < pos["13"]
    else:
        assert pos["10"] < min(pos["8"], pos["9"], pos["6"])  # priority within the light tenant, ahead of the heavy backlog
        assert min(pos["11"], pos["12"]) > max(pos[str(i)] for i in range(11))  # the batch tier goes last
    assert engine.admission.counters["light"].num_dispatched == 4
    assert engine.admission.counters["bulk"].num_dispatched == 2


def test_decode_room_holds_prompts_in_the_admission_queue_on_both_drivers(tiny: LoadedModel) -> None:
    """Under the TPOT rule a prefill instance takes a prompt only while the decode instance's free KV holds
    what the prefill side already has: prefilled requests no longer wait for a decode slot after their
    first token (that wait is their TPOT's); they wait in the admission queue. Both drivers (each reads
    the decode instance's free KV at its own moment: the engine before a round, the simulator when
    dispatch runs, so their plans are not compared here)."""
    setup = Setup(1, 1, 32, SchedulerConfig(max_num_batched_tokens=64), SchedulerConfig(max_num_seqs=16))
    arrivals = [Arrival(0, tuple(range(10 + 12 * i, 22 + 12 * i)), 30) for i in range(16)]  # 16 x (12 + 30) tokens: 11 blocks each
    held = Admission("fcfs", tpot_slo_s=1e9)  # a TPOT nothing exceeds: only the decode room binds
    free, engine = run_engine(tiny, setup, arrivals, admission=Admission("fcfs"))
    engine_trace, _ = run_engine(tiny, setup, arrivals, admission=held)
    assert free.max_awaiting_migration == 8  # without the rule: prefilled prompts pile up behind the full decode instance
    assert engine_trace.max_awaiting_migration == 1  # with it, only while decoding requests grow into the room they left
    assert len(engine_trace.steps["decode-0"]) <= len(free.steps["decode-0"]) + 1  # in about as many decode steps

    def worst_tpot(trace: Trace) -> float:
        return max((r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) for r in trace.records)

    sim_free, sim_held = run_simulator(engine, setup, arrivals), run_simulator(engine, setup, arrivals, admission=held)
    assert worst_tpot(sim_held) < 0.8 * worst_tpot(sim_free)
    assert max(r.admission_wait_s for r in sim_held.records) > max(r.admission_wait_s for r in sim_free.records)
