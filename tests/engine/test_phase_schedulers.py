"""PrefillScheduler and DecodeScheduler on their own (a fake runner: every sampled token is 7)."""

from __future__ import annotations

from distserve.config import SamplingParams, SchedulerConfig
from distserve.decode.scheduler import DecodeScheduler
from distserve.engine.block_manager import BlockManager
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.prefill.scheduler import PrefillScheduler

BS = 4
SP = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)


def sampled(plan: StepPlan) -> list[SampledToken]:
    return [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample]


def seq(seq_id: str, n: int) -> Sequence:
    return Sequence(seq_id, list(range(100, 100 + n)), SP)


def test_prefill_holds_finished_prompts_until_released_and_applies_backpressure() -> None:
    bm = BlockManager(5, BS, enable_prefix_caching=False)
    sched = PrefillScheduler(SchedulerConfig(), bm, 256)
    a, b, c = seq("a", 8), seq("b", 8), seq("c", 8)  # two blocks each: two fit in five
    seqs = {s.seq_id: s for s in (a, b, c)}
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert [ch.seq_id for ch in plan.chunks] == ["a", "b"]  # c does not fit: it waits, nobody is preempted
    updated = sched.update_from_output(plan, sampled(plan), seqs, 1.0)
    assert updated == [a, b] and a.output_token_ids == [7] and a.first_token_time == 1.0
    assert set(sched.awaiting_migration) == {"a", "b"} and not sched.running and sched.num_waiting == 1
    assert sched.schedule().is_empty  # the pool is full of prompts awaiting migration: backpressure
    released = sched.release("a")
    assert released is a and a.status is SequenceStatus.FINISHED and a.finish_reason == "migrated"
    plan = sched.schedule()
    assert [ch.seq_id for ch in plan.chunks] == ["c"]


def test_prefill_requeue_prefills_again_keeping_the_first_token() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    sched = PrefillScheduler(SchedulerConfig(), bm, 256)
    a = seq("a", 6)
    sched.add(a)
    plan = sched.schedule()
    sched.update_from_output(plan, sampled(plan), {"a": a}, 0.0)
    assert sched.requeue("a") is a and bm.usage == 0.0 and sched.waiting == [a]
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.token_ids == [*range(100, 106), 7] and chunk.start_pos == 0  # prompt + its first token
    assert sched.requeue("nobody") is None


def test_decode_reserves_completes_and_cancels() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    sched = DecodeScheduler(SchedulerConfig(max_num_seqs=2), bm, 256)
    a, b, c = seq("a", 7), seq("b", 7), seq("c", 7)
    for s in (a, b, c):
        s.token_ids.append(7)  # the first token, sampled on the prefill side
    ra, rb = sched.reserve(a), sched.reserve(b)
    assert ra is not None and rb is not None and ra.num_reused_blocks == 0 and ra.num_blocks_to_fill == 2
    assert sched.reserve(c) is None  # max_num_seqs reached (running + migrating)
    assert sched.schedule().is_empty  # reserved, not arrived: nothing to decode
    assert sched.cancel("b") is b and sched.complete("a") is a
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.seq_id == "a" and chunk.is_decode and chunk.start_pos == 7
    sched.update_from_output(plan, sampled(plan), {"a": a}, 0.0)
    assert a.output_token_ids == [7, 7] and sched.num_running == 1
    sched.finish(a, "abort")
    assert bm.usage == 0.0 and not sched.has_unfinished()


def test_decode_finish_of_a_migrating_request_frees_its_reservation() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    sched = DecodeScheduler(SchedulerConfig(), bm, 256)
    a = seq("a", 7)
    a.token_ids.append(7)
    assert sched.reserve(a) is not None and bm.usage > 0
    sched.finish(a, "abort")
    assert bm.usage == 0.0 and a.status is SequenceStatus.FINISHED and not sched.migrating
    assert sched.schedule().finished_seq_ids == ["a"]
