"""Plans that yield between layers (``engine.preemptible``): a sparse tenant's prompt runs while a
backlogged tenant's prefill plan is suspended, the in-process decode steps yield and resume, nothing
is computed twice, and every token is the same as without preemption (the tiny model, greedy)."""

from __future__ import annotations

import pytest
import torch

from distserve.cluster.admission import AdmissionConfig
from distserve.cluster.classes import RequestClass
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.instance_core import InstanceCore
from distserve.engine.model_runner import ModelRunner
from distserve.engine.preemptible import PreemptibleSteps
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import StepPlan
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.local_disagg import LocalDisaggEngine

SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HEAVY, LIGHT = RequestClass(tenant="heavy"), RequestClass(tenant="light")
CACHE = CacheConfig(num_blocks=1024, block_size=4)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def heavy_prompt(i: int) -> list[int]:
    return [(7 * k + 13 * i) % 250 + 1 for k in range(200)]


def test_a_plan_run_a_layer_at_a_time_computes_what_execute_does(tiny: LoadedModel) -> None:
    def runner() -> ModelRunner:
        return ModelRunner(tiny.config, tiny.state_dict, 64, 4)

    def plan_of(core: InstanceCore) -> StepPlan:
        launched = core.launch()
        assert launched is not None
        return launched.plan

    cores = [InstanceCore("prefill", SchedulerConfig(), 64, 4, 512) for _ in range(2)]
    for core in cores:
        core.add(Sequence("a", heavy_prompt(0)[:37], SP))
        core.add(Sequence("b", heavy_prompt(1)[:21], SP))
    whole, layered = runner(), runner()
    expected = whole.execute(plan_of(cores[0]))
    p = layered.begin(plan_of(cores[1]))
    yields = 0
    while (sampled := layered.run(p, lambda: True)) is None:
        yields += 1
    assert yields == tiny.config.num_layers - 1  # asked after every layer but the last
    assert [(s.seq_id, s.token_id) for s in sampled] == [(s.seq_id, s.token_id) for s in expected]
    assert torch.equal(layered.kv_cache, whole.kv_cache)


def run_flood(tiny: LoadedModel, preempt: bool, yield_always: bool = True) -> tuple[LocalDisaggEngine, list[str], dict[str, list[int]]]:
    """Four heavy prompts, then a light one, arriving while h2's plan is suspended (else once h2's
    plan has run); the order of first tokens and every request's tokens."""
    e = LocalDisaggEngine(tiny, cache_config=CACHE, admission=AdmissionConfig("fair"),
                          prefill_scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=200, layer_preemption=preempt))
    e.set_should_yield((lambda: True) if yield_always else None)
    launched: list[str] = []
    e.on_plan = lambda instance_id, plan: launched.extend(c.seq_id for c in plan.chunks if instance_id.startswith("prefill"))
    for i in range(4):
        e.add_request(heavy_prompt(i), SP, request_id=f"h{i}", request_class=HEAVY)
    first: list[str] = []
    tokens: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        if "h2" in launched and "l0" not in tokens:
            e.add_request(list(range(200, 220)), SP, request_id="l0", request_class=LIGHT)
            tokens["l0"] = []
        for out in e.step():
            if out.request_id not in first:
                first.append(out.request_id)
            tokens[out.request_id] = list(out.token_ids)
    return e, first, tokens


def test_a_sparse_tenants_prompt_overtakes_a_suspended_backlogged_one(tiny: LoadedModel) -> None:
    e, first, tokens = run_flood(tiny, preempt=True)
    _, first_whole, tokens_whole = run_flood(tiny, preempt=False)
    assert first_whole.index("l0") > first_whole.index("h2")  # without preemption h2 had run whole
    assert first.index("l0") < first.index("h2"), first
    assert tokens == tokens_whole
    stats = e.prefill[0].stats()
    assert stats["layer_preemptions_total"] == 1 and stats["layer_yields_total"] >= 1
    # Nothing was computed twice: 4 heavy prompts and the light one, once each.
    assert stats["prefill_tokens_computed_total"] == 4 * 200 + 20
    assert e.stats()["prefill"]["prefill-0"]["num_free_blocks"] == CACHE.num_blocks
    # The decode instance (same thread) yielded too, any rank, and resumed: the same tokens.
    decode = e.decode[0].stats()
    assert decode["layer_yields_total"] > 0 and decode["layer_preemptions_total"] == 0


def test_without_a_yield_signal_plans_run_whole(tiny: LoadedModel) -> None:
    e, first, _ = run_flood(tiny, preempt=True, yield_always=False)
    stats = e.prefill[0].stats()
    assert stats["layer_yields_total"] == 0 and stats["layer_preemptions_total"] == 0
    assert first.index("l0") > first.index("h2")


def test_rank_zero_plans_never_yield(tiny: LoadedModel) -> None:
    """Under fcfs every request has rank 0: nothing could preempt, so no plan stops."""
    e = LocalDisaggEngine(tiny, cache_config=CACHE, admission=AdmissionConfig("fcfs"),
                          prefill_scheduler_config=SchedulerConfig(max_num_batched_tokens=200))
    e.set_should_yield(lambda: True)
    for i in range(3):
        e.add_request(heavy_prompt(i), SP, request_id=f"h{i}", request_class=HEAVY)
    while e.has_unfinished_requests():
        e.step()
    assert e.prefill[0].stats()["layer_yields_total"] == 0


def test_a_failed_plan_while_suspended_leaves_no_stale_state(tiny: LoadedModel) -> None:
    """A core reset (the driver's recovery after a failed step) drops the suspended plan."""
    core = InstanceCore("prefill", SchedulerConfig(max_num_batched_tokens=200), 256, 4, 512)
    runner = ModelRunner(tiny.config, tiny.state_dict, 256, 4)
    steps = PreemptibleSteps(core, runner.begin, runner.run, lambda: 0.0)
    seq = Sequence("h", heavy_prompt(0), SP)
    seq.admission_rank = 1
    core.add(seq)
    assert steps.step(lambda: True) == [] and steps.suspended
    core.reset()
    assert steps.step(lambda: True) == [] and not steps.suspended  # nothing left to run
    core.add(Sequence("h", heavy_prompt(0), SP))
    (done,) = steps.step(lambda: True)  # rank 0: runs whole
    assert done.seq_id == "h" and len(done.output_token_ids) == 1


def test_a_backlogged_prompt_leaves_kv_for_lower_ranks() -> None:
    """Prompts awaiting migration hold the prefill instance's KV; a backlogged rank's prompt waits
    rather than take the blocks a sparse tenant's prompt arriving later needs."""
    from distserve.engine.step_plan import SampledToken

    def execute(plan: StepPlan) -> list[SampledToken]:
        return [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample]

    core = InstanceCore("prefill", SchedulerConfig(max_num_batched_tokens=256), 64, 4, 512)  # reserve unit: 64 // 32 = 2 blocks

    def add(seq_id: str, n: int, rank: int) -> None:
        seq = Sequence(seq_id, heavy_prompt(0)[:n], SP)
        seq.admission_rank = rank
        core.add(seq)

    clock = iter(range(1000)).__next__
    add("a", 200, 3)  # an empty cache takes any prompt: 50 of 64 blocks, held awaiting migration
    assert [s.seq_id for s in core.step(execute, clock)] == ["a"]
    add("b", 36, 3)  # 9 blocks would leave 5 < 3 units: it waits
    assert core.step(execute, clock) == [] and core.scheduler.num_waiting == 1
    add("c", 36, 2)  # 5 >= 2 units: a sparse tenant's prompt still fits
    assert [s.seq_id for s in core.step(execute, clock)] == ["c"]
    core.release("a")  # migrated: its blocks are free, and the backlogged prompt goes
    assert [s.seq_id for s in core.step(execute, clock)] == ["b"]


@pytest.mark.parametrize("chunked", [False, True])
def test_backlog_steps_are_short_while_a_lower_rank_was_admitted_lately(chunked: bool) -> None:
    """A batch backlog's prompts fill whole steps until a higher tier (an interactive tenant's) has been
    admitted lately; then its steps take the prompt tokens that fit ``backlog_step_s`` at the measured
    cost (here 1 ms a token: 100 tokens in 0.1 s), so the layer a chat arriving mid-step waits for is
    short. Without a cap, or next to a chat of the same tier, the same prompts share one step."""
    from distserve.engine.step_plan import SampledToken

    def run(cap_s: float | None, chat_rank: int = 0) -> list[list[tuple[str, int]]]:
        steps: list[list[tuple[str, int]]] = []
        now = [0.0]

        def execute(plan: StepPlan) -> list[SampledToken]:
            steps.append([(c.seq_id, len(c.token_ids)) for c in plan.chunks])
            now[0] += 0.001 * sum(len(c.token_ids) for c in plan.chunks)
            return [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample]

        config = SchedulerConfig(max_num_batched_tokens=256, backlog_step_s=cap_s, enable_chunked_prefill=chunked)
        core = InstanceCore("prefill", config, 256, 4, 512)

        def add(seq_id: str, n: int, rank: int) -> None:
            seq = Sequence(seq_id, heavy_prompt(int(seq_id[1:]))[:n], SP)
            seq.admission_rank = rank
            core.add(seq)

        add("b0", 60, 8)  # batch tier, backlogged (``fair_queue``: rank = LEVELS × tier + level)
        add("b1", 60, 8)
        core.step(execute, lambda: now[0])  # no lower rank seen yet: both in one step
        add("c9", 20, chat_rank)
        core.step(execute, lambda: now[0])  # the chat's step
        for i in range(2, 6):
            add(f"b{i}", 60, 8)
        while core.scheduler.has_work():
            core.step(execute, lambda: now[0])
        return steps

    assert run(None)[0] == [("b0", 60), ("b1", 60)]
    assert run(None)[2] == run(0.1, chat_rank=7)[2] == [(f"b{i}", 60) for i in range(2, 6)]  # same tier: whole steps
    capped = run(0.1)
    assert capped[0] == [("b0", 60), ("b1", 60)] and capped[1] == [("c9", 20)]
    if chunked:  # the next prompt is chunked to the cap's room
        assert capped[2] == [("b2", 60), ("b3", 40)] and capped[3] == [("b3", 20), ("b4", 60), ("b5", 20)]
    else:  # whole prompts: as many as fit, one alone if longer
        assert capped[2:5] == [[("b2", 60)], [("b3", 60)], [("b4", 60)]]
    assert all(sum(n for _, n in step) <= 100 for step in capped[2:])


def test_backlog_step_s_is_range_checked() -> None:
    from distserve.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="backlog_step_s"):
        SchedulerConfig(backlog_step_s=0)
