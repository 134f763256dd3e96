"""The "slo" step budget: prompts are chunked so each step stays within the TPOT SLO next to its
decodes, from a step-time model the scheduler learns from the executor's reports."""

from __future__ import annotations

import pytest

from distserve.config import SchedulerConfig, slo_scheduler_config
from distserve.engine.block_manager import BlockManager
from distserve.engine.scheduler import Scheduler
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence
from distserve.engine.step_budget import SLOBudget, StaticBudget, make_step_budget
from distserve.config import SamplingParams
from distserve.errors import InvalidConfigError

TPOT = 0.05


def step_seconds(plan: StepPlan) -> float:
    """A made-up machine: 10 ms per step, 2 ms per decode, 0.1 ms per prefill token."""
    decodes = sum(1 for c in plan.chunks if c.num_tokens == 1)
    prefill = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1)
    return 0.010 + 0.002 * decodes + 0.0001 * prefill


def test_the_budget_follows_the_learned_step_time() -> None:
    budget = SLOBudget(SchedulerConfig(step_budget="slo", tpot_slo_s=TPOT, max_num_batched_tokens=4096))
    assert budget.tokens(10, 1000) == 4096  # nothing learned yet
    for decodes, prefill in [(0, 512), (4, 0), (8, 256), (12, 0), (2, 1024), (16, 64), (6, 0), (10, 300)]:
        budget.observe(decodes, decodes * 100, prefill, 0.010 + 0.002 * decodes + 0.0001 * prefill)
    # (0.9 * 50 ms - 10 ms - 10 decodes * 2 ms) / 0.1 ms per token = 150 prefill tokens, plus the 10 decodes.
    assert budget.tokens(10, 1000) == pytest.approx(160, abs=2)
    assert budget.tokens(40, 4000) == 40 + 32  # the decodes alone miss the SLO: prompts still advance by min_prefill_chunk
    assert budget.tokens(0, 0) == 4096  # nothing decoding: whole prompts, for the fastest first token


def test_slo_scheduling_keeps_steps_within_the_tpot_slo() -> None:
    config = slo_scheduler_config(TPOT, SchedulerConfig(max_num_batched_tokens=4096))
    sched = Scheduler(config, BlockManager(2048, 16), 4096)
    seqs: dict[str, Sequence] = {}
    steps: list[float] = []
    for i in range(60):
        if i % 4 == 0:  # a 600-token prompt every 4 steps, next to the decodes
            sid = f"r{i}"
            seqs[sid] = Sequence(sid, list(range(1 + i, 601 + i)), SamplingParams(max_tokens=40, ignore_eos=True))
            sched.add(seqs[sid])
        plan = sched.schedule()
        seconds = step_seconds(plan)
        sched.observe_step(plan, seconds)
        sched.update_from_output(plan, [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample], seqs, float(i))
        steps.append(seconds)
    learned = steps[12:]
    assert max(learned) <= TPOT, learned  # whole 600-token prompts would take 70 ms steps
    assert any(len(c.token_ids) > 1 for c in plan.chunks) or sched.has_unfinished()


def test_budget_policies_are_chosen_by_name() -> None:
    assert isinstance(make_step_budget(SchedulerConfig()), StaticBudget)
    assert isinstance(make_step_budget(slo_scheduler_config(0.1)), SLOBudget)
    assert slo_scheduler_config(None) == SchedulerConfig() == slo_scheduler_config(float("inf"))
    with pytest.raises(InvalidConfigError, match="tpot_slo_s"):
        SchedulerConfig(step_budget="slo")
    with pytest.raises(InvalidConfigError, match="unknown step_budget"):
        make_step_budget(SchedulerConfig(step_budget="fastest"))


def test_the_step_time_model_is_the_exponentially_weighted_least_squares_fit() -> None:
    """The recursive update (plain floats, every step of a simulation) is the closed-form fit: weights
    (λⁿ/c·I + Σ λⁿ⁻ⁱ xᵢxᵢᵀ)⁻¹ Σ λⁿ⁻ⁱ xᵢyᵢ over the steps seen, with c the prior's covariance."""
    import numpy as np

    budget = SLOBudget(SchedulerConfig(step_budget="slo", tpot_slo_s=TPOT))
    rng = np.random.default_rng(0)
    xs, ys = [], []
    for _ in range(40):
        decodes, ctx, prefill = int(rng.integers(0, 64)), int(rng.integers(0, 20000)), int(rng.integers(0, 2048)) * int(rng.random() < 0.5)
        seconds = 0.008 + 0.0015 * decodes + 0.0004 * ctx / 1000 + 0.00009 * prefill + float(rng.normal()) * 1e-4
        budget.observe(decodes, ctx, prefill, seconds)
        xs.append([1.0, decodes, ctx / 1000, prefill])
        ys.append(seconds)
    lam, n = budget.FORGETTING, len(xs)
    x, y = np.array(xs), np.array(ys)  # [n, 4], [n]
    w = lam ** (n - 1 - np.arange(n))  # [n]: the newest step weighs 1
    info = lam**n / budget.INITIAL_COVARIANCE * np.eye(4) + (x * w[:, None]).T @ x
    # (to 1e-3: while P is still at the prior's size, the first steps do not forget — the windup guard)
    assert np.allclose(budget.weights, np.linalg.solve(info, (x * w[:, None]).T @ y), rtol=1e-3, atol=1e-9)


def test_a_covariance_that_lost_positive_definiteness_starts_afresh() -> None:
    """Rounding can leave P not positive definite (xᵀPx ≤ -λ): the update then starts from the prior."""
    config = SchedulerConfig(step_budget="slo", tpot_slo_s=TPOT)
    broken, fresh = SLOBudget(config), SLOBudget(config)
    broken._p = [-1.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, -1.0, 0.0, -1.0]  # (its upper triangle: -I)
    for budget in (broken, fresh):
        budget.observe(3, 4000, 10, 0.02)
    assert broken.weights == fresh.weights and broken._p == fresh._p
