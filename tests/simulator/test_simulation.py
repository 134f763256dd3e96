"""The event-driven simulation over our real schedulers: queueing theory, KV limits, migration, PP, goodput."""

from __future__ import annotations

import math

import pytest

from distserve.config import SchedulerConfig
from distserve.errors import InvalidConfigError
from distserve.placement import InstanceSpec, Placement
from distserve.slo import SLO, SLOSpec, attainment
from simulator.goodput import find_goodput
from simulator.latency import FittedLatencyModel
from simulator.profiles import TpCoefficients
from simulator.simulation import SimConfig, simulate, with_rate
from simulator.workload import Request, generate_requests

MODEL = "facebook/opt-13b"
DISTSERVE_PROFILE = {
    "prefill": (18.10254647486372, 0.1019122572698738, 7.122264314252114e-06),
    "decode_small": (19.934702624895458, 0.0006269356524350583, 0.03850697740828398),
    "decode_large": (7.1661889468253595, 0.0005798000403396046, 0.15831096191764046),
}


def constant_model(prefill_ms: float, decode_ms: float, tps: tuple[int, ...] = (1,)) -> FittedLatencyModel:
    """DistServe's form with only constant terms: every prefill step takes D, every decode step d."""
    coeffs = TpCoefficients(
        prefill=(prefill_ms, 0.0, 0.0), decode_small=(decode_ms, 0.0, 0.0), decode_large=(decode_ms, 0.0, 0.0), decode_threshold=95
    )
    return FittedLatencyModel(MODEL, {tp: coeffs for tp in tps}, hardware="a100-80g")


def opt13b_model() -> FittedLatencyModel:
    c = TpCoefficients(
        DISTSERVE_PROFILE["prefill"], DISTSERVE_PROFILE["decode_small"], DISTSERVE_PROFILE["decode_large"], 95
    )
    return FittedLatencyModel(MODEL, {1: c}, hardware="a100-80g")


def fixed_requests(n: int, rate: float, prompt: int, output: int, seed: int = 0) -> list[Request]:
    return generate_requests(f"fixed:{prompt}:{output}", rate, n, seed=seed)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_single_prefill_instance_matches_md1(rho: float) -> None:
    """One prompt at a time, Poisson arrivals, constant service D: mean TTFT = D + R·D²/(2(1−R·D))."""
    d = 0.1
    rate = rho / d
    config = SimConfig(prefill_scheduler=SchedulerConfig(max_num_seqs=1))
    placement = Placement.disaggregated(1, 1)
    ttfts = []
    for seed in range(3):
        res = simulate(placement, constant_model(d * 1e3, 5.0), fixed_requests(8000, rate, 128, 2, seed), config)
        ttfts += [r.ttft_s for r in res.records]
    expected = d + rate * d * d / (2 * (1 - rate * d))
    measured = sum(ttfts) / len(ttfts)
    assert measured == pytest.approx(expected, rel=0.05), (measured, expected)


def test_every_request_completes_with_exact_lengths_and_prefill_kv_freed() -> None:
    reqs = generate_requests("chatbot", 4.0, 300, seed=1, max_total_len=2048)
    res = simulate(Placement.disaggregated(2, 1), opt13b_model(), reqs)
    assert res.num_requests == 300
    by_id = {r.req_id: r for r in reqs}
    for rec in res.records:
        assert rec.num_output_tokens == by_id[rec.req_id].output_len
        assert 0 < rec.ttft_s < math.inf and rec.tpot_s < math.inf
        assert rec.finish_s is not None and rec.finish_s >= rec.first_token_s  # type: ignore[operator]
    migrated = sum(1 for r in reqs if r.output_len > 1)
    assert res.num_migrations == migrated
    assert res.migration_bytes > 0


def test_ttft_excludes_decode_interference_when_disaggregated() -> None:
    """Long decodes slow a colocated engine's prefills; on 1P1D prefill steps run alone."""
    reqs = fixed_requests(200, 3.0, 512, 200)
    model = opt13b_model()
    colo = simulate(Placement.colocated_instances(1), model, reqs).summary()
    disagg = simulate(Placement.disaggregated(1, 1), model, reqs).summary()
    assert disagg["ttft_p90_s"] < colo["ttft_p90_s"]


def test_small_kv_forces_preemption_and_all_finish() -> None:
    reqs = fixed_requests(60, 50.0, 64, 100)
    config = SimConfig(num_blocks=40, block_size=16)
    res = simulate(Placement.colocated_instances(1), opt13b_model(), reqs, config)
    assert all(r.num_output_tokens == 100 for r in res.records)
    assert res.instances["colocated0"]["num_preemptions"] > 0


def test_request_larger_than_instance_kv_is_a_clear_error() -> None:
    with pytest.raises(InvalidConfigError, match="does not fit"):
        simulate(Placement.colocated_instances(1), opt13b_model(), fixed_requests(3, 1.0, 1000, 10), SimConfig(num_blocks=8))


def test_pipeline_keeps_micro_batches_in_flight() -> None:
    """PP=2 halves stage time (DistServe's form divides by pp): saturated throughput nearly doubles."""
    coeffs = TpCoefficients((20.0, 0.0, 0.0), (10.0, 0.0, 0.0), (10.0, 0.0, 0.0), 95)
    model = FittedLatencyModel(MODEL, {1: coeffs}, hardware="a100-80g", pp_stage_overhead_s=0.0)
    reqs = fixed_requests(400, 1000.0, 32, 50)  # everything arrives at once
    config = SimConfig(scheduler=SchedulerConfig(max_num_seqs=16))
    t1 = simulate(Placement(colocated=(InstanceSpec(1, 1),)), model, reqs, config).duration_s
    t2 = simulate(Placement(colocated=(InstanceSpec(1, 2),)), model, reqs, config).duration_s
    assert t2 < 0.6 * t1, (t1, t2)


def test_pipelined_prefill_instance_keeps_its_stages_busy() -> None:
    """A prefill instance of pp stages under a backlog: admission keeps pp micro-batches' worth of prompts
    waiting there (``backpressure.step_capacity``), so every launch at a free stage 0 finds a full one;
    with one step's worth only, the next micro-batch waited for a plan to end and PP=2 gained ~1.3x."""
    c = TpCoefficients(DISTSERVE_PROFILE["prefill"], DISTSERVE_PROFILE["decode_small"], DISTSERVE_PROFILE["decode_large"], 95)
    model = FittedLatencyModel(MODEL, {1: c}, hardware="a100-80g", pp_stage_overhead_s=0.0)
    reqs = fixed_requests(120, 1000.0, 500, 1)  # every prompt queued at once; it ends at its first token

    def last_first_token(pp: int) -> float:
        records = simulate(Placement.disaggregated(1, 1, 1, pp), model, reqs).records
        return max(r.first_token_s for r in records if r.first_token_s is not None)

    t1, t2 = last_first_token(1), last_first_token(2)
    assert t2 < 0.6 * t1, (t1, t2)


def test_shared_compute_is_processor_sharing() -> None:
    """Two colocated instances on one node, each step 2x slower while both compute: a prefill of D
    started at 0 and one started at D/2 both take 1.5 D (alone D/2, shared D, alone D/2)."""
    d = 0.2
    placement = Placement.colocated_instances(2)
    reqs = [Request(0, 0.0, 64, 1), Request(1, d / 2, 64, 1)]
    config = SimConfig(concurrent_slowdown=2.0)
    alone = simulate(placement, constant_model(d * 1e3, 5.0), reqs)
    shared = simulate(placement, constant_model(d * 1e3, 5.0), reqs, config)
    assert [r.ttft_s for r in alone.records] == pytest.approx([d, d])
    assert [r.ttft_s for r in shared.records] == pytest.approx([1.5 * d, 1.5 * d])
    assert all(i["utilization"] > 0 for i in shared.instances.values())
    # Instances on different nodes do not share.
    apart = Placement(colocated=(InstanceSpec(1, 1, node=0), InstanceSpec(1, 1, node=1)))
    assert [r.ttft_s for r in simulate(apart, constant_model(d * 1e3, 5.0), reqs, config).records] == pytest.approx([d, d])
    # 1P1D: a prefill running next to a busy decode instance is slowed, and every request finishes.
    many = fixed_requests(40, 20.0, 64, 16)
    base = simulate(Placement.disaggregated(1, 1), constant_model(d * 1e3, 50.0), many)
    slow = simulate(Placement.disaggregated(1, 1), constant_model(d * 1e3, 50.0), many, config)
    assert all(r.num_output_tokens == 16 for r in slow.records)
    assert slow.duration_s > base.duration_s
    # Pipelined instances are left out of the sharing.
    pp2 = Placement(colocated=(InstanceSpec(1, 2), InstanceSpec(1, 2)))
    assert [r.ttft_s for r in simulate(pp2, constant_model(d * 1e3, 5.0), reqs, config).records] == pytest.approx(
        [r.ttft_s for r in simulate(pp2, constant_model(d * 1e3, 5.0), reqs).records])
    with pytest.raises(InvalidConfigError, match="concurrent_slowdown"):
        SimConfig(concurrent_slowdown=0.5)


def test_deployment_constants_scale_steps_and_delay_migrations() -> None:
    """step_time_scale multiplies the latency model's step time (not the fixed overhead);
    migration_overhead_s delays each KV migration, i.e. the second token, by that much."""
    reqs = [Request(0, 0.0, 64, 4)]
    model = constant_model(100.0, 10.0)
    base = simulate(Placement.disaggregated(1, 1), model, reqs, SimConfig(step_overhead_s=0.005)).records[0]
    cfg = SimConfig(step_overhead_s=0.005, step_time_scale=1.5, migration_overhead_s=0.07)
    slow = simulate(Placement.disaggregated(1, 1), model, reqs, cfg).records[0]
    assert base.ttft_s == pytest.approx(0.105) and slow.ttft_s == pytest.approx(0.155)
    # 3 decode steps after the first token: the first waits for the migration.
    assert (slow.finish_s - slow.first_token_s) - (base.finish_s - base.first_token_s) == pytest.approx(0.07 + 3 * 0.005)
    # A separate scale for steps with prompt tokens: the prefill only.
    split = simulate(Placement.disaggregated(1, 1), model, reqs,
                     SimConfig(step_overhead_s=0.005, step_time_scale=1.5, prefill_time_scale=2.0)).records[0]
    assert split.ttft_s == pytest.approx(0.205)
    assert split.finish_s - split.first_token_s == pytest.approx(slow.finish_s - slow.first_token_s - 0.07)
    for bad in ({"step_time_scale": 0.0}, {"migration_overhead_s": -1.0}, {"prefill_time_scale": -1.0}):
        with pytest.raises(InvalidConfigError, match=next(iter(bad))):
            SimConfig(**bad)


def test_seq_overhead_costs_each_sequence_of_a_step_on_every_path() -> None:
    """seq_overhead_s adds its time once per sequence in a step: a lone request's prefill and decode steps pay it once,
    two arriving together pay it twice per step; the same with fast-forward (lazy decodes) on and off; 0 leaves every
    record as it was."""
    model = constant_model(100.0, 10.0)
    one, two = [Request(0, 0.0, 64, 4)], [Request(0, 0.0, 64, 4), Request(1, 0.0, 64, 4)]
    for ff in (True, False):
        base = simulate(Placement.colocated_instances(1), model, one, SimConfig(fast_forward=ff)).records[0]
        solo = simulate(Placement.colocated_instances(1), model, one, SimConfig(seq_overhead_s=0.002, fast_forward=ff)).records[0]
        assert solo.ttft_s == pytest.approx(base.ttft_s + 0.002)
        assert solo.finish_s - solo.first_token_s == pytest.approx(base.finish_s - base.first_token_s + 3 * 0.002)
        pair = simulate(Placement.colocated_instances(1), model, two, SimConfig(seq_overhead_s=0.002, fast_forward=ff)).records
        pair0 = simulate(Placement.colocated_instances(1), model, two, SimConfig(fast_forward=ff)).records
        for r, r0 in zip(pair, pair0):
            assert r.ttft_s == pytest.approx(r0.ttft_s + 2 * 0.002)
            assert r.finish_s - r.first_token_s == pytest.approx(r0.finish_s - r0.first_token_s + 3 * 2 * 0.002)
    many = fixed_requests(30, 20.0, 64, 16)
    zero = simulate(Placement.disaggregated(1, 1), opt13b_model(), many, SimConfig(seq_overhead_s=0.0)).records
    assert [(r.first_token_s, r.finish_s) for r in zero] == [(r.first_token_s, r.finish_s) for r in simulate(
        Placement.disaggregated(1, 1), opt13b_model(), many).records]
    with pytest.raises(InvalidConfigError, match="seq_overhead_s"):
        SimConfig(seq_overhead_s=-1e-3)


def test_a_run_at_a_rate_is_the_rescaled_workloads_run() -> None:
    """``Simulation.run(unit, rate=r)`` (the planner's probes: no copy of the workload) gives every record of
    ``run(with_rate(unit, r))``; a rate that is not a positive number is refused naming it."""
    from simulator.simulation import Simulation

    unit = generate_requests("chatbot", 1.0, 120, seed=3)
    for placement in (Placement.colocated_instances(1), Placement.disaggregated(1, 1)):
        scaled = Simulation(placement, opt13b_model()).run(unit, rate=4.5).records
        copied = Simulation(placement, opt13b_model()).run(with_rate(unit, 4.5)).records
        assert scaled == copied
    for bad in (0, -1.0, math.inf, math.nan, True, "2"):
        with pytest.raises(InvalidConfigError, match="rate must be a finite number > 0") as exc:
            Simulation(Placement.colocated_instances(1), opt13b_model()).run(unit, rate=bad)  # type: ignore[arg-type]
        assert exc.value.param == "rate"


def test_padded_prompt_batches_cost_copies_of_the_longest_prompt() -> None:
    """``prefill_padding`` (vLLM before 0.4 computed a step's prompts as a [prompts x longest] tensor): two prompts of
    100 and 1000 tokens in one step cost as two of 1000 (tokens and their square); a prompt alone, or a step whose
    prompts are all as long, costs what it did; on a prefill instance and a colocated one alike."""
    a, b, c = DISTSERVE_PROFILE["prefill"]
    model = opt13b_model()
    pair = [Request(0, 0.0, 100, 2), Request(1, 0.0, 1000, 2)]
    for placement in (Placement.colocated_instances(1), Placement.disaggregated(1, 1)):
        plain = simulate(placement, model, pair).records
        padded = simulate(placement, model, pair, SimConfig(prefill_padding=True)).records
        assert plain[0].ttft_s == pytest.approx((a + b * 1100 + c * (100**2 + 1000**2)) / 1e3)
        assert [r.ttft_s for r in padded] == pytest.approx([(a + b * 2000 + c * 2 * 1000**2) / 1e3] * 2)
        for same in ([Request(0, 0.0, 500, 2)], [Request(0, 0.0, 500, 2), Request(1, 0.0, 500, 2)]):
            assert [r.ttft_s for r in simulate(placement, model, same, SimConfig(prefill_padding=True)).records] == \
                [r.ttft_s for r in simulate(placement, model, same).records]


def test_slo_classes_and_attainment_modes() -> None:
    reqs = [
        Request(i, 0.05 * i, 64, 8, slo_class="tight" if i % 2 else None) for i in range(100)
    ]
    res = simulate(Placement.disaggregated(1, 1), opt13b_model(), reqs)
    spec = SLOSpec(SLO(10.0, 1.0), classes={"tight": SLO(1e-4, 1.0)})
    att = attainment(res.records, spec)
    assert att["joint"] == pytest.approx(0.5)  # only the default class can meet its TTFT
    with pytest.raises(InvalidConfigError, match="not defined"):
        attainment(res.records, SLOSpec(SLO(1.0, 1.0)))


def test_goodput_bisection_is_reproducible_and_bracketed() -> None:
    unit = generate_requests("chatbot", 1.0, 400, seed=3, max_total_len=2048)
    slo = SLOSpec(SLO(0.25, 0.1, 0.9))
    g1 = find_goodput(Placement.disaggregated(1, 1), opt13b_model(), unit, slo, rel_tol=0.05)
    g2 = find_goodput(Placement.disaggregated(1, 1), opt13b_model(), unit, slo, rel_tol=0.05)
    assert g1.rate == g2.rate > 0
    passing = [p.rate for p in g1.probes if p.meets]
    failing = [p.rate for p in g1.probes if not p.meets]
    assert max(passing) == g1.rate and min(failing) > g1.rate
    assert g1.binding in ("ttft", "tpot", "both")
    res = simulate(Placement.disaggregated(1, 1), opt13b_model(), with_rate(unit, g1.rate * 1.5))
    assert attainment(res.records, slo)["joint"] < 0.9 + 0.05


def test_bad_inputs_name_the_problem() -> None:
    with pytest.raises(InvalidConfigError, match="no requests"):
        simulate(Placement.colocated_instances(1), opt13b_model(), [])
    with pytest.raises(InvalidConfigError, match="tp=2"):
        simulate(Placement.disaggregated(1, 1, prefill_tp=2), opt13b_model(), fixed_requests(2, 1.0, 8, 2))
    with pytest.raises(InvalidConfigError, match="context"):
        simulate(Placement.colocated_instances(1), opt13b_model(), fixed_requests(2, 1.0, 2040, 100))


def test_the_slo_step_budget_multiplies_colocated_goodput_with_long_prompts_and_a_tight_tpot() -> None:
    """Whole 1024-token prompts next to the decodes stretch every step past a 30 ms TPOT; chunking
    them to the SLO keeps the decodes in it (the same scheduler code the engines run)."""
    from simulator.latency import get_latency_model

    lat = get_latency_model("facebook/opt-13b", "a100-80g")
    reqs = generate_requests("fixed:1024:64", 1.0, 100, seed=0)
    slo = SLOSpec(SLO(1.0, 0.03, 0.9))
    placement = Placement(colocated=(InstanceSpec(1, 1),))
    static = find_goodput(placement, lat, reqs, slo, SimConfig()).rate
    budgeted = find_goodput(placement, lat, reqs, slo, SimConfig(scheduler=SchedulerConfig(step_budget="slo", tpot_slo_s=0.03))).rate
    assert budgeted > 2 * static > 0
