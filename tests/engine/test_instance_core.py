"""InstanceCore on its own, with a fake executor: steps, pipelines, deferred frees, token deltas, phases."""

from __future__ import annotations

import itertools

import pytest

from distserve.config import SamplingParams, SchedulerConfig
from distserve.engine.instance_core import InstanceCore
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence

TOKEN = 7
SP = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)


def fake_execute(plan: StepPlan) -> list[SampledToken]:
    return [SampledToken(c.seq_id, TOKEN) for c in plan.chunks if c.sample]


def core(phase: str = "colocated", pipeline_depth: int = 1, config: SchedulerConfig | None = None) -> InstanceCore:
    return InstanceCore(phase, config or SchedulerConfig(), 64, 4, 256, pipeline_depth=pipeline_depth)


def seq(seq_id: str, n: int = 6, sampling: SamplingParams = SP) -> Sequence:
    return Sequence(seq_id, list(range(10, 10 + n)), sampling)


def test_steps_run_requests_to_the_end_and_free_everything() -> None:
    c = core()
    clock = itertools.count(1.0, 0.5).__next__
    c.add(seq("a"))
    c.add(seq("b", 9))
    finished = []
    while c.has_work():
        for s in c.step(fake_execute, clock):
            if s.is_finished:
                finished.append((s.seq_id, s.output_token_ids, s.finish_reason))
    assert sorted(finished) == [("a", [TOKEN] * 3, "length"), ("b", [TOKEN] * 3, "length")]
    assert c.num_steps == 3 and c.last_step_s == 0.5
    assert c.block_manager.usage == 0.0 and not c.seqs and not c.in_flight
    assert c.step(fake_execute, clock) == []  # nothing to do: no plan is launched


def test_step_interval_is_the_time_between_steps_while_requests_run() -> None:
    """What TPOT backpressure reads: the time a running request waits between its tokens, the driver's gaps
    between steps included (another instance's step in a round, a controller's round trip)."""
    c = core()
    times = iter([10.0, 10.5, 11.5, 11.75, 13.0, 13.25, 20.0, 20.25])  # (start, end) of each step's execute
    c.add(seq("a", sampling=SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)))
    c.step(fake_execute, times.__next__)  # the prompt: nothing ran before it
    assert (c.last_step_s, c.step_interval_s) == (0.5, 0.5)
    c.step(fake_execute, times.__next__)  # 0.25 s of compute, 1.25 s after the previous step ended
    assert (c.last_step_s, c.step_interval_s) == (0.25, 1.25)
    c.step(fake_execute, times.__next__)
    assert c.step_interval_s == 1.5
    c.step(fake_execute, times.__next__)  # the last token: nothing runs after it
    assert c.step_interval_s == 7.0 and not c.seqs
    c.add(seq("b"))
    c.step_ended(0.25, 30.0)  # a step after idling: its own time, not the idle gap
    assert c.step_interval_s == 0.25


def test_token_interval_spans_pp_steps_of_a_pipelined_instance() -> None:
    """pp = 2: a request advances once per two steps (one per micro-batch), so its time per token is the
    time since the step two steps ago ended — read from one step, micro-batches of unequal size made
    the reading alternate between short and long (and TPOT backpressure flicker open)."""
    c = core(pipeline_depth=2)
    c.add(seq("a", 64))
    c.step(fake_execute, iter([0.9, 1.0]).__next__)  # the prompt; nothing ran before: the step's own time, pp of them
    assert c.token_interval_s == pytest.approx(0.2)
    c.step_ended(0.1, 1.1)  # one interval seen: pp of it
    assert c.token_interval_s == pytest.approx(0.2)
    c.step_ended(0.6, 1.7)
    assert (c.step_interval_s, c.token_interval_s) == (pytest.approx(0.6), pytest.approx(0.7))  # 1.7 - 1.0
    c.step_ended(0.1, 1.8)
    assert (c.step_interval_s, c.token_interval_s) == (pytest.approx(0.1), pytest.approx(0.7))  # 1.8 - 1.1, not 2 x 0.1
    flat = core()
    flat.add(seq("b", 64))
    flat.step(fake_execute, iter([0.9, 1.0]).__next__)
    flat.step_ended(0.2, 1.5)
    assert flat.token_interval_s == flat.step_interval_s == pytest.approx(0.5)  # pp = 1: one interval


def test_a_free_waits_for_the_plan_that_computes_the_request() -> None:
    """pp = 2: an abort (and a re-add of the same id) issued while a plan computes the request run
    when that plan is applied, in call order; the aborted request gets no token from it."""
    c = core(pipeline_depth=2)
    c.add(seq("a"))
    first = c.launch()
    assert first is not None and first.computes("a") and not first.computes("b")
    c.abort("a")
    again = seq("a")
    c.add(again)  # a re-run of the id: queued behind the abort
    assert c.seqs["a"] is not again and c.has_work()
    updated = c.apply_oldest(fake_execute(first.plan), 1.0)
    assert updated == []  # aborted before its token was applied
    assert c.seqs["a"] is again and c.scheduler.waiting == [again]
    assert c.block_manager.usage == 0.0  # the first attempt's blocks are free; the re-run holds none yet


def test_pipeline_depth_bounds_the_plans_in_flight() -> None:
    c = core(pipeline_depth=2, config=SchedulerConfig(max_num_seqs=1))  # one sequence per micro-batch
    for i in range(3):
        c.add(seq(f"s{i}", 4))
    a, b = c.launch(), c.launch()
    assert a is not None and b is not None and c.launch() is None
    assert [p.plan_seq for p in c.in_flight] == [0, 1] and c.max_plans_in_flight == 2 and c.num_overlapped_launches == 1
    assert not set(ch.seq_id for ch in a.plan.chunks) & set(ch.seq_id for ch in b.plan.chunks)
    c.apply_oldest(fake_execute(a.plan), 1.0)
    assert [p.plan_seq for p in c.in_flight] == [1]


def test_deltas_report_each_token_once() -> None:
    c = core()
    clock = itertools.count(1.0).__next__
    c.add(seq("a"))
    got: list[int] = []
    while c.has_work():
        for s in c.step(fake_execute, clock):
            d = c.delta(s)
            got += d.new_token_ids
            last = d
    assert got == [TOKEN] * 3 and last.finished and last.finish_reason == "length"


def test_prefill_holds_the_kv_until_released_and_decode_reserves_once() -> None:
    p, d = core("prefill"), core("decode")
    clock = itertools.count(1.0).__next__
    s = seq("a", 8)
    p.add(s)
    (out,) = p.step(fake_execute, clock)
    assert out is s and p.delta(s).awaiting_migration and p.prefill.num_awaiting_migration == 1
    held = p.kv_source("a")
    assert held == s.block_table and p.block_manager.usage > 0
    moved = s.detached_copy()
    reservation = d.reserve(moved)
    assert reservation is not None and d.reserve(moved.detached_copy()) is None  # the id is held here already
    assert d.complete("a") is moved
    p.release("a")
    assert p.block_manager.usage == 0.0 and not p.seqs
    while d.has_work():
        d.step(fake_execute, clock)
    assert moved.output_token_ids == [TOKEN] * 3 and d.block_manager.usage == 0.0


def test_a_failed_migration_requeues_and_cancels() -> None:
    p, d = core("prefill"), core("decode")
    clock = itertools.count(1.0).__next__
    s = seq("a", 8)
    p.add(s)
    p.step(fake_execute, clock)
    assert d.reserve(s.detached_copy()) is not None
    d.cancel("a")
    p.requeue("a")
    assert d.block_manager.usage == 0.0 and not d.seqs
    assert p.scheduler.waiting == [s] and p.prefill.num_awaiting_migration == 0


def test_unknown_phase_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown phase"):
        core("sideways")


def test_stats_count_preemptions_prefix_lookups_and_steps_across_a_reset() -> None:
    """What /metrics exports per instance: preemptions, prefix-cache lookups (tokens queried and hit),
    tokens per step and step seconds as cumulative histograms; a reset (after a failed step) keeps them."""
    c = InstanceCore("colocated", SchedulerConfig(), 6, 4, 256)  # 6 blocks of 4: three 7-token prompts must preempt
    clock = itertools.count(1.0, 0.5).__next__
    for i in range(3):
        c.add(seq(f"s{i}", 7, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)))
    num_tokens: list[int] = []  # per executed plan

    def execute(plan: StepPlan) -> list[SampledToken]:
        num_tokens.append(sum(ch.num_tokens for ch in plan.chunks))
        return fake_execute(plan)

    while c.has_work():
        c.step(execute, clock)
    stats = c.stats()
    assert stats["num_preemptions_total"] >= 1
    # Every admission looked its whole sequence up: the three prompts, then each recompute (prompt + tokens so far).
    assert stats["prefix_cache_query_tokens_total"] > 3 * 7
    assert stats["prefix_cache_hit_tokens_total"] <= stats["prefix_cache_query_tokens_total"]
    tokens, seconds = stats["iteration_tokens"], stats["step_seconds_histogram"]
    assert sum(tokens["counts"]) == sum(seconds["counts"]) == c.num_steps
    assert tokens["sum"] == sum(num_tokens) and len(num_tokens) == c.num_steps
    assert seconds["sum"] == pytest.approx(0.5 * c.num_steps) and seconds["counts"][seconds["bounds"].index(0.5)] == c.num_steps
    assert stats["cache_config"] == {"block_size": 4, "num_gpu_blocks": 6, "enable_prefix_caching": True}
    before = {k: stats[k] for k in ("num_preemptions_total", "prefix_cache_query_tokens_total", "prefix_cache_hit_tokens_total")}
    c.reset()
    after = c.stats()
    assert {k: after[k] for k in before} == before
    assert after["iteration_tokens"] == tokens
