"""The "vllm-2023" step policy: a step that admits prompts runs only prompts, whole; decodes pause for it and resume after.

Checked on the scheduler with a fake runner, on the real tiny engine (greedy outputs identical to the
default "mixed" policy) and in the simulator (the paused decodes cost TPOT on a chat load).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from distserve.cli import main
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.scheduler import Scheduler
from distserve.engine.sequence import Sequence
from distserve.engine.step_budget import SLOBudget
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.weights import load_model
from distserve.errors import InvalidConfigError
from distserve.placement import InstanceSpec, Placement
from simulator import DISTSERVE_A100_PROFILE
from simulator.latency import FittedLatencyModel
from simulator.simulation import SimConfig, simulate
from simulator.workload import generate_requests

VLLM_2023 = SchedulerConfig(step_policy="vllm-2023")


def run(config: SchedulerConfig, arrivals: dict[int, list[tuple[str, int, int]]], num_blocks: int = 256) -> list[tuple[StepPlan, set[str]]]:
    """Drive a scheduler with a fake runner; ``arrivals``: step -> (id, prompt_len, max_tokens) added
    before that step. Returns each plan with the ids that were decoding (prompt done) when it was made."""
    sched = Scheduler(config, BlockManager(num_blocks, 4), 4096, eos_token_ids=(0,))
    seqs: dict[str, Sequence] = {}
    out: list[tuple[StepPlan, set[str]]] = []
    for step in range(400):
        for sid, n, max_tokens in arrivals.get(step, []):
            seqs[sid] = seq = Sequence(sid, [1 + 100 * len(seqs) + i for i in range(n)], SamplingParams(max_tokens=max_tokens))
            sched.add(seq)
        if not sched.has_unfinished() and step > max(arrivals):
            return out
        decoding = {s.seq_id for s in sched.running if s.num_output_tokens > 0}
        plan = sched.schedule()
        out.append((plan, decoding))
        sched.update_from_output(plan, [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample], seqs, float(step))
    raise AssertionError("did not finish")


ARRIVALS = {0: [("a", 12, 6), ("b", 9, 6)], 3: [("c", 20, 5)], 4: [("d", 7, 4), ("e", 30, 3)], 9: [("f", 15, 4)]}


def test_admitting_steps_run_prompts_only_and_decodes_resume() -> None:
    steps = run(VLLM_2023, ARRIVALS)
    decoded: dict[str, int] = {}
    for plan, decoding in steps:
        ids = {c.seq_id for c in plan.chunks}
        prompts = ids - decoding
        assert not (prompts and ids & decoding), f"a step mixed prompts {prompts} with decodes {ids & decoding}"
        if prompts:
            assert all(c.start_pos == 0 and c.sample for c in plan.chunks), "prompts run whole"
        for c in plan.chunks:
            decoded[c.seq_id] = decoded.get(c.seq_id, 0) + (c.seq_id in decoding)
    # Every request produced its tokens: the decodes paused by prompt steps resumed.
    assert decoded == {"a": 5, "b": 5, "c": 4, "d": 3, "e": 2, "f": 3}
    # At step 3 "a" and "b" were decoding and "c" arrived: that step is c's prompt alone.
    plan3, decoding3 = steps[3]
    assert decoding3 == {"a", "b"} and [c.seq_id for c in plan3.chunks] == ["c"]


def test_the_default_policy_mixes_prompts_into_decode_steps() -> None:
    steps = run(SchedulerConfig(), ARRIVALS)
    plan3, decoding3 = steps[3]
    assert {c.seq_id for c in plan3.chunks} == {"a", "b", "c"} and decoding3 == {"a", "b"}


def test_prompt_steps_keep_the_token_and_sequence_caps() -> None:
    config = SchedulerConfig(step_policy="vllm-2023", max_num_batched_tokens=32, max_num_seqs=3)
    steps = run(config, {0: [(f"s{i}", 10, 2) for i in range(5)]})
    first = steps[0][0]
    assert [c.seq_id for c in first.chunks] == ["s0", "s1", "s2"] and first.num_batched_tokens == 30
    # s3 and s4 wait for room (the running cap), then get a prompt step of their own.
    assert any({c.seq_id for c in p.chunks} == {"s3", "s4"} for p, _ in steps)


def test_bad_policies_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidConfigError, match="step_policy must be one of mixed, vllm-2023") as exc:
        SchedulerConfig(step_policy="vllm-2024")
    assert exc.value.param == "step_policy"
    with pytest.raises(InvalidConfigError, match="runs prompts whole"):
        SchedulerConfig(step_policy="vllm-2023", enable_chunked_prefill=True)
    with pytest.raises(InvalidConfigError, match="runs prompts whole"):
        SchedulerConfig(step_policy="vllm-2023", step_budget="slo", tpot_slo_s=0.1)


PROMPTS = ["Hello, my name is", "The capital of France is Paris and the capital of Italy is", "a",
           "Once upon a time, in a land far, far away, there lived a dragon who loved " * 3, "1 2 3 4 5 6"]


def test_real_engine_greedy_outputs_identical_under_both_policies() -> None:
    tiny = load_model("tiny")
    greedy = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)
    outputs, mixed_steps = {}, {}
    for policy in ("mixed", "vllm-2023"):
        engine = LLMEngine(tiny, cache_config=CacheConfig(num_blocks=512, block_size=4),
                           scheduler_config=SchedulerConfig(step_policy=policy))
        plans: list[StepPlan] = []
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]  # type: ignore[method-assign]
        pending, done = list(PROMPTS), {}
        while pending or engine.has_unfinished_requests():
            if pending:  # one arrival per step: each joins while the earlier ones decode
                engine.add_request(pending[0], greedy, request_id=pending.pop(0))
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outputs[policy] = [done[p] for p in PROMPTS]
        assert all(len(t) == 24 for t in outputs[policy])
        # A prompt chunk has no output token yet; a decode has some.
        mixed_steps[policy] = sum(len({c.num_output_tokens > 0 for c in plan.chunks}) == 2 for plan in plans)
    assert outputs["vllm-2023"] == outputs["mixed"]
    assert mixed_steps["mixed"] >= 3 and mixed_steps["vllm-2023"] == 0


def test_simulated_chat_load_has_higher_tpot_under_vllm_2023() -> None:
    latency = FittedLatencyModel.from_profile(DISTSERVE_A100_PROFILE, model="facebook/opt-13b")
    requests = generate_requests("chatbot", rate=8.0, num_requests=200, seed=1, max_total_len=2048)
    placement = Placement(colocated=(InstanceSpec(1, 1),))
    tpot = {}
    for policy in ("mixed", "vllm-2023"):
        result = simulate(placement, latency, requests, SimConfig(scheduler=SchedulerConfig(step_policy=policy)))
        tpot[policy] = result.summary()["tpot_p90_s"]
    # Measured: p90 TPOT 48 ms vs 40 ms (OPT-13B TP1, 8 req/s): each arrival's prompt step stalls every decode.
    assert tpot["vllm-2023"] > 1.1 * tpot["mixed"], tpot


def test_simulate_and_plan_take_the_colocated_policy(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--model", "facebook/opt-13b", "--hardware", "a100-80g", "--colocated", "1", "--rate", "8",
            "--num-requests", "120", "--ttft", "0.25", "--tpot", "0.1", "--seed", "1"]
    tpot = {}
    for policy in ("mixed", "vllm-2023"):
        assert main([*base, "--colocated-policy", policy, "--json"]) == 0
        tpot[policy] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["result"]["tpot_p90_s"]
    assert tpot["vllm-2023"] > tpot["mixed"]
    assert main([*base, "--colocated-policy", "vllm-2023", "--step-budget", "slo"]) == 2
    assert "step_policy 'vllm-2023' runs prompts whole" in capsys.readouterr().err
    plan = ["plan", "--workers", "1", "--model", "facebook/opt-13b", "--nodes", "1", "--gpus-per-node", "1", "--workload", "humaneval",
            "--ttft", "1", "--tpot", "0.2", "--num-requests", "40", "--json"]
    for policy, label in (("vllm-2023", "(vllm-2023)"), ("mixed", "(slo budget)")):
        assert main([*plan, "--colocated-policy", policy]) == 0
        labels = [c["configuration"] for c in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["candidates"]
                  if c["kind"] == "colocated"]
        # The named baseline is the only colocated policy weighed; the default also weighs the "slo" budget.
        assert labels and any(label in x for x in labels)
        assert policy == "mixed" or all(label in x for x in labels)


def test_slo_budget_survives_long_steady_stretches() -> None:
    """The "slo" budget's online fit stays finite through ~100k steps of one batch shape (it overflowed
    to NaN weights, and a crash, in the steady tails of ``distserve plan`` runs on sharegpt-multiturn)."""
    budget = SLOBudget(SchedulerConfig(step_budget="slo", tpot_slo_s=0.1, max_num_batched_tokens=2048))
    for decodes, prefill in [(0, 512), (4, 0), (8, 256), (12, 0), (2, 1024), (16, 64), (6, 0), (10, 300)]:
        budget.observe(decodes, decodes * 500, prefill, 0.010 + 0.002 * decodes + 0.0001 * prefill)
    for _ in range(100_000):
        budget.observe(1, 800, 0, 0.012)
    assert np.all(np.isfinite(budget.weights)) and 1 <= budget.tokens(1, 800) <= 2048
    budget.observe(10, 5000, 400, 0.010 + 0.002 * 10 + 0.0001 * 400)
    assert np.all(np.isfinite(budget.weights))
