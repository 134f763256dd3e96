"""A sequence's block hashes are computed once and stay right: admission, commit, routing, preemption, re-runs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq

import pytest

from distserve.config import SamplingParams, SchedulerConfig
from distserve.decode.scheduler import DecodeScheduler
from distserve.engine import block_manager as bm_module
from distserve.engine.block_manager import BlockManager, prefix_block_hashes, seq_block_hashes
from distserve.engine.instance_core import InstanceCore
from distserve.engine.scheduler import Scheduler
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence

BS = 4
SP = SamplingParams(max_tokens=9, ignore_eos=True)


@pytest.fixture
def hash_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[int | None, tuple[int, ...]]]:
    """Every ``hash_block`` call, by its arguments: a count above 1 is a block hashed again."""
    calls: Counter[tuple[int | None, tuple[int, ...]]] = Counter()
    real = bm_module.hash_block

    def spy(prefix_hash: int | None, token_ids: Seq[int]) -> int:
        calls[(prefix_hash, tuple(token_ids))] += 1
        return real(prefix_hash, token_ids)

    monkeypatch.setattr(bm_module, "hash_block", spy)
    return calls


def seq(seq_id: str, tokens: list[int], sampling: SamplingParams = SP) -> Sequence:
    return Sequence(seq_id, list(tokens), sampling)


def step(sched: Scheduler, seqs: dict[str, Sequence], t: int) -> StepPlan:
    plan = sched.schedule()
    sched.update_from_output(plan, [SampledToken(c.seq_id, 1000 + t) for c in plan.chunks if c.sample], seqs, float(t))
    return plan


def assert_hashes_right(s: Sequence) -> None:
    assert s.prefix_hashes == prefix_block_hashes(s.token_ids, BS)[: len(s.prefix_hashes)]


@pytest.mark.interpreted  # counts ``hash_block`` calls through the module attribute
def test_admission_hashes_each_block_once_even_while_the_prompt_waits(hash_calls: Counter) -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    sched = Scheduler(SchedulerConfig(), bm, 1024)
    seqs = {"a": seq("a", list(range(100, 116)))}  # holds 5 of the 6 blocks once it decodes
    sched.add(seqs["a"])
    step(sched, seqs, 0)
    hash_calls.clear()
    seqs["b"] = b = seq("b", list(range(200, 218)))  # 18 tokens: 4 full blocks, 5 blocks to hold
    sched.add(b)
    for t in range(1, 4):  # b is asked can_allocate every step and does not fit
        plan = step(sched, seqs, t)
        assert [c.seq_id for c in plan.chunks] == ["a"]
    assert hash_calls.total() == (b.num_tokens - 1) // BS  # the blocks a prefix hit could cover, once each
    assert max(hash_calls.values()) == 1

    sched.finish(seqs.pop("a"), "abort")
    plan = step(sched, seqs, 4)  # can_allocate, num_cached_prefix_tokens, allocate
    assert [(c.seq_id, c.num_tokens) for c in plan.chunks] == [("b", 18)]
    assert hash_calls.total() == len(b.block_hashes) == 4  # the prefill's commit reused admission's hashes
    step(sched, seqs, 5)
    step(sched, seqs, 6)  # 20 tokens computed: block 4 is full and committed
    assert hash_calls.total() == len(b.block_hashes) == 5
    assert max(hash_calls.values()) == 1
    assert_hashes_right(b)


@pytest.mark.interpreted  # counts ``hash_block`` calls through the module attribute
def test_decode_reservation_and_routing_reuse_the_same_hashes(hash_calls: Counter) -> None:
    decode = DecodeScheduler(SchedulerConfig(), BlockManager(num_blocks=16, block_size=BS), 1024)
    s = seq("a", list(range(13)))  # prompt + first token
    expected = prefix_block_hashes(s.token_ids, BS)
    hash_calls.clear()
    routed = seq_block_hashes(s, BS)  # what prefix-affinity routing reads
    assert routed == expected and hash_calls.total() == 3
    assert decode.reserve(s) is not None  # can_reserve + allocate
    decode.complete(s.seq_id)  # commit
    assert hash_calls.total() == 3 and s.block_hashes == routed


@pytest.mark.interpreted  # counts ``hash_block`` calls through the module attribute
def test_preempted_sequence_hits_its_own_blocks_and_hashes_nothing_twice(hash_calls: Counter) -> None:
    bm = BlockManager(num_blocks=7, block_size=BS)
    sched = Scheduler(SchedulerConfig(), bm, 1024)
    seqs = {sid: seq(sid, [base + i for i in range(8)]) for sid, base in (("a", 100), ("b", 200))}
    for s in seqs.values():
        sched.add(s)
    t = 0
    while not sched.num_preemptions:
        step(sched, seqs, t)
        t += 1
    b = seqs["b"]
    assert b.num_preemptions == 1 and b.num_tokens == 13  # 12 tokens of KV, 4 of them generated
    fresh = seq("fresh", b.token_ids)
    assert bm.num_cached_prefix_tokens(fresh) == 12  # its blocks, outputs included, wait in the free queue
    assert_hashes_right(b)
    hash_calls.clear()
    while sched.has_work():
        step(sched, seqs, t)
        t += 1
    assert b.num_cached_tokens == 12  # re-admission reused all three committed blocks
    # After the preemption only blocks filled since were hashed, once each: a's fourth and b's fourth.
    assert hash_calls.total() == 2 and max(hash_calls.values()) == 1
    for s in seqs.values():
        assert_hashes_right(s)


@pytest.mark.interpreted  # counts ``hash_block`` calls through the module attribute
def test_a_rerun_after_a_crash_and_a_copy_keep_correct_hashes(hash_calls: Counter) -> None:
    core = InstanceCore("colocated", SchedulerConfig(), 32, BS, 1024)
    s = seq("a", list(range(10)))
    core.add(s)
    for t in range(3):  # prefill, then decodes: 13 tokens, blocks 0..2 committed
        core.step(lambda plan, t=t: [SampledToken(c.seq_id, 500 + t) for c in plan.chunks if c.sample], lambda: 0.0)
    assert s.num_tokens == 13 and len(s.block_hashes) == 3
    num_hashed = hash_calls.total()

    # The engine's crash recovery: a fresh core, the request re-run with its tokens so far.
    core.reset()
    s.block_table, s.block_hashes, s.num_computed_tokens = [], [], 0
    core.add(s)
    core.step(lambda plan: [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample], lambda: 0.0)
    assert hash_calls.total() == num_hashed  # the re-run's admission and commit hashed nothing again
    assert s.num_cached_tokens == 0 and s.num_tokens == 14 and s.block_hashes == prefix_block_hashes(s.token_ids, BS)

    # A detached copy (a migration, a re-run elsewhere) carries the hashes; a request sharing the prefix hits.
    copy = s.detached_copy()
    assert copy.prefix_hashes == s.prefix_hashes and copy.prefix_hashes is not s.prefix_hashes
    other = seq("b", s.token_ids[:12] + [9, 9])
    core.add(other)
    core.step(lambda plan: [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample], lambda: 0.0)
    assert other.num_cached_tokens == 12
    assert_hashes_right(other)


def test_hashes_for_another_block_size_are_recomputed() -> None:
    s = seq("a", list(range(17)))
    assert seq_block_hashes(s, 4) == prefix_block_hashes(s.token_ids, 4)
    assert seq_block_hashes(s, 8) == prefix_block_hashes(s.token_ids, 8)
    assert seq_block_hashes(s, 8, 1) == prefix_block_hashes(s.token_ids, 8)[:1]
    s.token_ids.extend(range(7))  # 24 tokens: a third block of 8
    assert seq_block_hashes(s, 8) == prefix_block_hashes(s.token_ids, 8) and len(s.prefix_hashes) == 3
