"""Layer preemption in the simulator (``simulator.layer_preemption``): a sparse tenant's prompt that
arrives while a backlogged tenant's prefill plan computes gets its first token before that plan
ends, nothing is computed twice, ``layer_preemption=False`` (and ``fcfs``, whose plans never yield)
gives the results of plans run whole, fast-forward changes nothing, and shared compute moves the
yield with the node's speed. Also the regression test of a stale prefix grouping that made the
simulator compute finished requests (``PrefixGrouping.invalidate``)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from distserve.cluster.admission import AdmissionConfig
from distserve.cluster.tenants import TenantSpec
from distserve.config import SamplingParams, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.prefix_grouping import PrefixGrouping
from distserve.engine.sequence import Sequence
from distserve.placement import Placement
from simulator.latency import FittedLatencyModel
from simulator.metrics import SimResult
from simulator.profiles import TpCoefficients
from simulator.simulation import SimConfig, Simulation
from simulator.workload import Request, generate_requests

PROFILE = "experiments/results/validate_simulator_profile.json"  # SmolLM2-135M on this CPU: 30 layers
FLOOD, LIGHT = "flood", "light"
NUM_FLOOD, FLOOD_PROMPT, LIGHT_PROMPT = 24, 512, 64


def smollm() -> FittedLatencyModel:
    return FittedLatencyModel.from_profile(PROFILE)


def config(policy: str = "fair", layer_preemption: bool = True, **kw: object) -> SimConfig:
    tenants = (TenantSpec(FLOOD), TenantSpec(LIGHT))
    return SimConfig(admission=AdmissionConfig(policy, tenants), prefill_scheduler=SchedulerConfig(layer_preemption=layer_preemption),
                     **kw)  # type: ignore[arg-type]


def flood() -> list[Request]:
    """A backlog of long prompts from one tenant, all at once."""
    return [Request(i, 0.001 * i, FLOOD_PROMPT, 4, tenant=FLOOD) for i in range(NUM_FLOOD)]


def run(requests: list[Request], cfg: SimConfig) -> tuple[SimResult, Simulation]:
    sim = Simulation(Placement.disaggregated(1, 1), smollm(), cfg)
    return sim.run(requests), sim


def records(res: SimResult) -> list[tuple[object, ...]]:
    return [tuple(getattr(r, f.name) for f in fields(r)) for r in res.records]


def plan_in_flight() -> tuple[float, set[int], float]:
    """(an instant in the middle of a flood plan of rank > 0, the flood requests that plan prefills,
    when it ends) in a run of the flood alone: the third plan's (the first ones take the flood's
    rank-0 prompt and its first backlog)."""
    res, _ = run(flood(), config())
    ends = sorted({r.first_token_s for r in res.records if r.first_token_s is not None})
    assert len(ends) >= 4
    start, end = ends[2], ends[3]
    return (start + end) / 2, {r.req_id for r in res.records if r.first_token_s == end}, end


def with_light(arrival_s: float) -> list[Request]:
    return flood() + [Request(NUM_FLOOD, arrival_s, LIGHT_PROMPT, 4, tenant=LIGHT)]


def test_a_sparse_prompt_arriving_mid_plan_gets_its_first_token_before_the_plan_ends() -> None:
    arrival, plan_ids, end_alone = plan_in_flight()
    requests = with_light(arrival)
    off, _ = run(requests, config(layer_preemption=False))
    on, sim = run(requests, config())
    light_off, light_on = off.records[-1], on.records[-1]
    # Plans run whole: the light prompt waits for the flood plan in flight.
    assert light_off.first_token_s > end_alone
    # Layer by layer: the plan yields at the next layer boundary, the light prompt runs, the plan resumes.
    plan_end_on = {on.records[i].first_token_s for i in plan_ids}
    assert len(plan_end_on) == 1  # still one plan: it resumed, not re-planned
    assert light_on.first_token_s < min(plan_end_on)
    layer_s = end_alone / 30  # generous: a layer of the plan is far below its whole time
    assert light_on.ttft_s < light_off.ttft_s - layer_s
    prefill = on.instances["prefill0"]
    assert prefill["layer_yields_total"] >= 1 and prefill["layer_preemptions_total"] >= 1
    # Nothing is computed twice: the prompts' tokens, once each, with or without preemption.
    total = sum(r.prompt_len for r in requests)
    assert on.num_prefill_tokens_computed == off.num_prefill_tokens_computed == total
    assert all(r.completed for r in on.records)
    assert sim.instances[0].layered is not None and not sim.instances[0].core.in_flight


def test_off_and_fcfs_run_plans_whole() -> None:
    """``layer_preemption=False``: no layer-by-layer driver, today's results. Under ``fcfs`` every
    plan has rank 0 and never yields: the same results as off, record for record."""
    arrival, _, _ = plan_in_flight()
    requests = with_light(arrival)
    off, sim_off = run(requests, config("fcfs", layer_preemption=False))
    on, _ = run(requests, config("fcfs"))
    assert all(i.layered is None for i in sim_off.instances)
    assert "layer_yields_total" not in off.instances["prefill0"]
    assert records(on) == records(off)
    assert on.duration_s == off.duration_s
    assert on.instances["prefill0"]["layer_yields_total"] == 0


def test_fast_forward_and_shared_compute() -> None:
    arrival, plan_ids, _ = plan_in_flight()
    requests = with_light(arrival) + [Request(NUM_FLOOD + 1 + i, arrival + 0.5 * i, LIGHT_PROMPT, 40, tenant=LIGHT) for i in range(1, 6)]
    fast, sim = run(requests, config())
    slow, _ = run(requests, config(fast_forward=False))
    assert records(fast) == records(slow) and fast.instances == slow.instances
    assert sim.num_fast_forward_steps > 0
    # Two instances sharing a node's compute: each step slower, the plan still yields to the light prompt.
    shared, _ = run(requests, config(concurrent_slowdown=2.0))
    light = shared.records[NUM_FLOOD]
    assert light.first_token_s < min(shared.records[i].first_token_s for i in plan_ids)
    assert shared.instances["prefill0"]["layer_preemptions_total"] >= 1
    assert shared.num_prefill_tokens_computed == fast.num_prefill_tokens_computed


def opt13b() -> FittedLatencyModel:
    """DistServe's fitted OPT-13B step times on one A100 (as ``test_simulation``)."""
    c = TpCoefficients((18.10254647486372, 0.1019122572698738, 7.122264314252114e-06),
                       (19.934702624895458, 0.0006269356524350583, 0.03850697740828398),
                       (7.1661889468253595, 0.0005798000403396046, 0.15831096191764046), 95)
    return FittedLatencyModel("facebook/opt-13b", {1: c}, hardware="a100-80g")


def test_an_emptied_running_list_does_not_get_a_stale_prefix_grouping_back() -> None:
    """A decode instance whose running sequences share prefixes (synthetic prompts, prefix caching)
    and are all preempted: ``invalidate`` left ``_made_for == []``, which equals the empty
    ``running``, so the old grouping — finished and preempted sequences — was offered to the next
    step, and the simulator crashed computing a finished request (KeyError in ``_step_done``)."""
    bm = BlockManager(64, 4)
    seqs = [Sequence(str(i), [1] * 8, SamplingParams(max_tokens=4)) for i in range(4)]
    for s in seqs:
        s.block_table = [0, 10 + len(s.seq_id)]  # one shared first block: a prefix group
    grouping = PrefixGrouping()
    assert grouping.selection_order(seqs, 0, 1, 1, bm) is not seqs  # grouped: more than a plan takes
    grouping.invalidate()
    assert grouping.selection_order([], 0, 1, 1, bm) == []
    requests = generate_requests("chatbot", 6.0, 250, max_total_len=2048)
    res = Simulation(Placement.disaggregated(1, 1), opt13b(), SimConfig(enable_prefix_caching=True, num_blocks=250)).run(requests)
    assert all(r.completed for r in res.records)
    assert res.instances["decode0"]["num_preemptions"] > 0  # the pressure that empties the running list


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_every_request_completes_under_a_mixed_load(policy: str) -> None:
    light = [Request(0, 0.0, 1, 1, tenant=LIGHT)]
    light = [replace(light[0], req_id=NUM_FLOOD + i, arrival_s=0.3 * i, prompt_len=LIGHT_PROMPT + i) for i in range(12)]
    res, sim = run(flood() + light, config(policy))
    assert all(r.completed for r in res.records)
    assert res.num_prefill_tokens_computed == sum(r.prompt_len for r in flood() + light)
    assert not sim.instances[0].core.in_flight and sim.instances[0].layered.part is None  # type: ignore[union-attr]
