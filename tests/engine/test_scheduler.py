"""Scheduler on CPU with a fake runner: budgets, chunking, policies, preemption, no deadlock."""

import pytest

from distserve.cluster.classes import MAX_REMEMBERED_GROUPS, GroupArrivals, RequestClass
from distserve.config import SamplingParams, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.scheduler import Scheduler
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.errors import InvalidConfigError


def make(
    num_blocks: int = 64, block_size: int = 4, max_model_len: int = 1024, **cfg: object
) -> tuple[Scheduler, dict[str, Sequence]]:
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**cfg), bm, max_model_len, eos_token_ids=(0,)), {}  # type: ignore[arg-type]


def add(sched: Scheduler, seqs: dict[str, Sequence], sid: str, n: int, max_tokens: int = 4, **kw: object) -> Sequence:
    base = 1 + 100 * len(seqs)  # distinct prompts: no accidental prefix hits
    seq = Sequence(sid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens), **kw)  # type: ignore[arg-type]
    seqs[sid] = seq
    sched.add(seq)
    return seq


def fake_run(plan: StepPlan) -> list[SampledToken]:
    """Sample token 7 for every chunk that samples."""
    return [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample]


def run_to_completion(sched: Scheduler, seqs: dict[str, Sequence], max_steps: int = 500) -> list[StepPlan]:
    plans = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return plans
        plan = sched.schedule()
        plans.append(plan)
        sched.update_from_output(plan, fake_run(plan), seqs, now=float(len(plans)))
    raise AssertionError("scheduler did not finish: deadlock or livelock")


def test_token_budget_and_decodes_first() -> None:
    sched, seqs = make(max_num_batched_tokens=20)
    add(sched, seqs, "a", 10)
    add(sched, seqs, "b", 8)
    add(sched, seqs, "c", 8)  # does not fit in the first step's budget
    p1 = sched.schedule()
    assert [c.seq_id for c in p1.chunks] == ["a", "b"] and p1.num_batched_tokens == 18
    sched.update_from_output(p1, fake_run(p1), seqs, 1.0)
    p2 = sched.schedule()
    # decodes of a and b first, then c's prefill
    assert [(c.seq_id, c.num_tokens) for c in p2.chunks] == [("a", 1), ("b", 1), ("c", 8)]
    assert p2.chunks[0].start_pos == 10 and p2.chunks[0].token_ids == [7]


def test_max_num_seqs() -> None:
    sched, seqs = make(max_num_seqs=2)
    for i in range(4):
        add(sched, seqs, f"s{i}", 4)
    plan = sched.schedule()
    assert len(plan.chunks) == 2 and sched.num_waiting == 2


def test_chunked_prefill_splits_long_prompt() -> None:
    sched, seqs = make(max_num_batched_tokens=8, enable_chunked_prefill=True)
    add(sched, seqs, "long", 20)
    p = sched.schedule()
    assert p.chunks[0].num_tokens == 8 and not p.chunks[0].sample
    sched.update_from_output(p, fake_run(p), seqs, 1.0)
    p = sched.schedule()
    assert p.chunks[0].start_pos == 8 and p.chunks[0].num_tokens == 8 and not p.chunks[0].sample
    sched.update_from_output(p, fake_run(p), seqs, 2.0)
    p = sched.schedule()
    assert p.chunks[0].num_tokens == 4 and p.chunks[0].sample
    sched.update_from_output(p, fake_run(p), seqs, 3.0)
    assert seqs["long"].num_output_tokens == 1


def test_prompt_larger_than_budget_runs_alone_without_chunking() -> None:
    sched, seqs = make(max_num_batched_tokens=8)
    add(sched, seqs, "big", 20)
    add(sched, seqs, "small", 4)
    p = sched.schedule()
    assert [c.seq_id for c in p.chunks] == ["big"] and p.chunks[0].num_tokens == 20
    run_to_completion(sched, seqs)


def test_priority_policy_admits_lowest_value_first() -> None:
    sched, seqs = make(max_num_seqs=1, policy="priority")
    add(sched, seqs, "low", 4, priority=5, arrival_time=0.0)
    add(sched, seqs, "high", 4, priority=0, arrival_time=1.0)
    assert sched.schedule().chunks[0].seq_id == "high"


def test_fcfs_policy_admits_by_arrival() -> None:
    sched, seqs = make(max_num_seqs=1)
    add(sched, seqs, "late", 4, arrival_time=2.0)
    add(sched, seqs, "early", 4, arrival_time=1.0)
    assert sched.schedule().chunks[0].seq_id == "early"


def test_preemption_by_recompute_then_everything_finishes() -> None:
    # 6 blocks of 4 tokens: three 7-token prompts (2 blocks each) fill the cache; decoding needs more.
    sched, seqs = make(num_blocks=6, block_size=4)
    for i in range(3):
        add(sched, seqs, f"s{i}", 7, max_tokens=6, arrival_time=float(i))
    plans = run_to_completion(sched, seqs)
    preempted = [sid for p in plans for sid in p.preempted_seq_ids]
    assert preempted, "the cache is too small for all three: someone must be preempted"
    assert preempted[0] == "s2"  # FCFS: the latest arrival goes first
    for s in seqs.values():
        assert s.status is SequenceStatus.FINISHED and s.finish_reason == "length"
        assert s.num_output_tokens == 6
    assert sched.block_manager.num_free_blocks == 6
    # A preempted sequence is recomputed from its prompt *and* its generated tokens.
    s2_prefills = [c for p in plans for c in p.chunks if c.seq_id == "s2" and c.num_tokens > 1]
    assert len(s2_prefills) >= 2 and s2_prefills[1].start_pos + s2_prefills[1].num_tokens > 7


def test_eos_and_stop_tokens_finish() -> None:
    sched, seqs = make()
    seq = add(sched, seqs, "a", 4, max_tokens=10)
    plan = sched.schedule()
    sched.update_from_output(plan, [SampledToken("a", 0)], seqs, 1.0)  # eos
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "stop"
    assert sched.block_manager.num_free_blocks == 64


def test_finished_ids_reported_once() -> None:
    sched, seqs = make()
    seq = add(sched, seqs, "a", 4, max_tokens=1)
    plan = sched.schedule()
    sched.update_from_output(plan, fake_run(plan), seqs, 1.0)
    assert seq.is_finished
    assert sched.schedule().finished_seq_ids == ["a"]
    assert sched.schedule().finished_seq_ids == []


def test_one_token_chunks_are_batched_with_decodes() -> None:
    # A budget remainder of 1 gives a newly admitted prompt a 1-token chunk: it must sit with the decodes.
    sched, seqs = make(max_num_batched_tokens=5, enable_chunked_prefill=True)
    add(sched, seqs, "a", 4)
    add(sched, seqs, "b", 6)
    plan = sched.schedule()
    assert [(c.seq_id, c.num_tokens) for c in plan.chunks] == [("b", 1), ("a", 4)]


def test_pipeline_depth_skips_in_flight_sequences_until_their_update() -> None:
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), bm, 1024, eos_token_ids=(0,), pipeline_depth=2)
    seqs: dict[str, Sequence] = {}
    for sid in "abcd":
        add(sched, seqs, sid, 4)
    p1 = sched.schedule()
    p2 = sched.schedule()  # p1 is still in flight: the next micro-batch takes other sequences
    assert [c.seq_id for c in p1.chunks] == ["a", "b"] and [c.seq_id for c in p2.chunks] == ["c", "d"]
    assert sched.schedule().is_empty  # everything is in flight
    sched.update_from_output(p1, fake_run(p1), seqs, 1.0)
    p3 = sched.schedule()
    assert [(c.seq_id, c.num_tokens) for c in p3.chunks] == [("a", 1), ("b", 1)]
    assert not sched.in_flight - {"a", "b", "c", "d"}


def test_running_sequences_split_into_micro_batches_of_max_num_seqs() -> None:
    """Four running decodes with pp=2 and max_num_seqs=2: two micro-batches of two, not one of four."""
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), bm, 1024, eos_token_ids=(0,), pipeline_depth=2)
    seqs: dict[str, Sequence] = {}
    for sid in "abcd":
        add(sched, seqs, sid, 4, max_tokens=8)
    for plan in (sched.schedule(), sched.schedule()):  # the prompts, two per plan
        sched.update_from_output(plan, fake_run(plan), seqs, 1.0)
    p1, p2 = sched.schedule(), sched.schedule()
    assert [c.seq_id for c in p1.chunks] == ["a", "b"] and [c.seq_id for c in p2.chunks] == ["c", "d"]
    assert all(c.num_tokens == 1 for c in p1.chunks + p2.chunks)


def test_in_flight_sequences_are_never_preempted() -> None:
    bm = BlockManager(3, 4)
    sched = Scheduler(SchedulerConfig(), bm, 1024, eos_token_ids=(0,), pipeline_depth=2)
    seqs: dict[str, Sequence] = {}
    add(sched, seqs, "a", 4, max_tokens=8)
    add(sched, seqs, "b", 4, max_tokens=8)
    p1 = sched.schedule()  # a and b take 2 of 3 blocks
    sched.update_from_output(p1, fake_run(p1), seqs, 1.0)
    p2 = sched.schedule()  # a's decode needs a new block (the last one); b's cannot get one
    assert [c.seq_id for c in p2.chunks] == ["a"] and p2.preempted_seq_ids == ["b"]
    p3 = sched.schedule()  # a is in flight and holds blocks: b is readmitted only if blocks allow
    assert "a" not in p3.preempted_seq_ids and all(c.seq_id != "a" for c in p3.chunks)


def test_a_crash_suspect_runs_a_step_alone_then_joins_the_batch() -> None:
    sched, seqs = make()
    add(sched, seqs, "a", 4)
    add(sched, seqs, "suspect", 4, isolate=True)
    add(sched, seqs, "b", 4)
    assert sched.num_waiting == 3 and sched.has_work()
    solo = sched.schedule()
    assert [c.seq_id for c in solo.chunks] == ["suspect"]
    sched.update_from_output(solo, fake_run(solo), seqs, 1.0)
    assert not seqs["suspect"].isolate  # cleared by its step alone
    both = sched.schedule()
    assert {c.seq_id for c in both.chunks} == {"a", "b", "suspect"}
    run_to_completion(sched, seqs)


def test_a_sampling_error_finishes_only_that_sequence() -> None:
    sched, seqs = make()
    add(sched, seqs, "a", 4)
    add(sched, seqs, "bad", 4)
    plan = sched.schedule()
    sampled = [SampledToken("a", 7), SampledToken("bad", -1, error="sampling failed: boom")]
    updated = sched.update_from_output(plan, sampled, seqs, 1.0)
    assert {s.seq_id for s in updated} == {"a", "bad"}
    assert seqs["bad"].finish_reason == "error" and seqs["bad"].error == "sampling failed: boom"
    assert seqs["bad"].token_ids == seqs["bad"].prompt_token_ids  # the failed token is not appended
    assert seqs["a"].status is SequenceStatus.RUNNING and seqs["a"].num_output_tokens == 1


# ---- scheduling classes (distserve.cluster.classes) ---------------------------------------------
LATENCY, THROUGHPUT = RequestClass("latency"), RequestClass("throughput")


def waiting_ids(sched: Scheduler) -> list[str]:
    return [s.seq_id for s in sched.waiting]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_latency_requests_are_admitted_first_whatever_the_policy(policy: str) -> None:
    sched, seqs = make(max_num_seqs=1, policy=policy)
    add(sched, seqs, "thr", 4, arrival_time=0.0, priority=-5, request_class=THROUGHPUT)
    add(sched, seqs, "dflt", 4, arrival_time=1.0, priority=-5)
    add(sched, seqs, "lat", 4, arrival_time=2.0, priority=5, request_class=LATENCY)
    add(sched, seqs, "lat2", 4, arrival_time=3.0, priority=0, request_class=LATENCY)
    first = ["lat2", "lat"] if policy == "priority" else ["lat", "lat2"]  # the policy orders within the class
    assert waiting_ids(sched) == [*first, "dflt", "thr"]  # then default requests, then throughput work
    assert sched.schedule().chunks[0].seq_id == first[0]


def test_a_task_groups_members_stay_adjacent_keyed_by_its_first_arrival() -> None:
    sched, seqs = make(max_num_seqs=1)
    group = RequestClass("throughput", "g")
    add(sched, seqs, "g0", 4, arrival_time=0.0, request_class=group)
    add(sched, seqs, "x1", 4, arrival_time=1.0, request_class=THROUGHPUT)
    add(sched, seqs, "y2", 4, arrival_time=2.0, request_class=THROUGHPUT)
    add(sched, seqs, "g3", 4, arrival_time=3.0, request_class=group)
    add(sched, seqs, "h4", 4, arrival_time=4.0, request_class=RequestClass("throughput", "h"))
    add(sched, seqs, "g5", 4, arrival_time=5.0, request_class=group)
    add(sched, seqs, "h6", 4, arrival_time=6.0, request_class=RequestClass("throughput", "h"))
    assert waiting_ids(sched) == ["g0", "g3", "g5", "x1", "y2", "h4", "h6"]
    plans = run_to_completion(sched, seqs)
    admitted = [c.seq_id for p in plans for c in p.chunks if c.num_tokens > 1]
    assert admitted == ["g0", "g3", "g5", "x1", "y2", "h4", "h6"]


def test_group_memory_is_bounded_and_a_forgotten_group_starts_anew() -> None:
    groups = GroupArrivals(max_groups=2)
    assert groups.first("a", 0.0, 0) == (0.0, 0)
    assert groups.first("b", 1.0, 1) == (1.0, 1)
    assert groups.first("a", 2.0, 2) == (0.0, 0)  # "a" is now the most recent
    assert groups.first("c", 3.0, 3) == (3.0, 3)  # evicts "b"
    assert len(groups) == 2
    assert groups.first("b", 4.0, 4) == (4.0, 4)
    sched, seqs = make()
    for i in range(MAX_REMEMBERED_GROUPS + 10):
        add(sched, seqs, f"s{i}", 2, request_class=RequestClass("throughput", f"group-{i}"))
    assert len(sched._groups) == MAX_REMEMBERED_GROUPS


def test_latency_max_num_seqs_must_be_positive() -> None:
    with pytest.raises(InvalidConfigError, match="latency_max_num_seqs"):
        SchedulerConfig(latency_max_num_seqs=0)


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 24, "enable_chunked_prefill": True},
                                 {"step_budget": "slo", "tpot_slo_s": 0.05, "min_prefill_chunk": 4}])
def test_lazy_decodes_leave_the_plan_as_it_was(cfg: dict[str, object]) -> None:
    """``schedule(num_lazy_decodes=n)`` (the simulator's fast-forward: the driver made the first n
    running sequences' slots and applies their update) plans exactly the rest of ``schedule()``'s
    plan: the same admissions, chunks, blocks and budget, less the lazy decodes' chunks."""

    def setup() -> tuple[Scheduler, dict[str, Sequence]]:
        sched, seqs = make(num_blocks=256, **cfg)
        for i in range(4):
            add(sched, seqs, f"d{i}", 5 + i, max_tokens=50)
        for step in range(3):  # they decode now; the SLO budget has seen steps with and without prompts
            plan = sched.schedule()
            sched.observe_step(plan, 0.01 + 0.001 * plan.num_batched_tokens)
            sched.update_from_output(plan, fake_run(plan), seqs, float(step))
        for i in range(3):
            add(sched, seqs, f"p{i}", 9 + 3 * i)  # waiting prompts
        return sched, seqs

    full, _ = setup()
    lazy, _ = setup()
    plan = full.schedule()
    n = 3  # the first three running sequences are lazy: their slots first, as the real loop would take them
    for seq in lazy.running[:n]:
        assert lazy.block_manager.append_slots(seq, 1) == []
    ctx = sum(len(s.token_ids) for s in lazy.running[:n])
    rest = lazy.schedule(num_lazy_decodes=n, lazy_decode_ctx=ctx)
    assert len(plan.chunks) > n + 1 and any(len(c.token_ids) > 1 for c in plan.chunks)  # decodes and admitted prompts
    assert [(c.seq_id, c.token_ids, c.start_pos, c.block_table, c.sample) for c in rest.chunks] == \
        [(c.seq_id, c.token_ids, c.start_pos, c.block_table, c.sample) for c in plan.chunks[n:]]
    assert [s.seq_id for s in lazy.running] == [s.seq_id for s in full.running]
    assert [s.seq_id for s in lazy.waiting] == [s.seq_id for s in full.waiting]
    assert [s.block_table for s in lazy.running] == [s.block_table for s in full.running]
    assert lazy.block_manager.num_free_blocks == full.block_manager.num_free_blocks
