"""In-flight prefix sharing, the rule on its own: the block manager knows which full blocks live
sequences are filling; the scheduler holds a prompt whose next prefix blocks are among them until
they are committed, admits others past it, and lets it go when the holder does."""

from __future__ import annotations

from distserve.config import SamplingParams, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.instance_core import InstanceCore, num_prefill_tokens
from distserve.engine.scheduler import Scheduler
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.sequence import Sequence

BS = 4
PREFIX = list(range(10, 10 + 4 * BS))  # 4 full blocks shared by every sibling
SP = SamplingParams(max_tokens=3, ignore_eos=True)


def sibling(i: int, suffix_len: int = 3) -> Sequence:
    return Sequence(f"s{i}", PREFIX + [100 + 10 * i + j for j in range(suffix_len)], SP)


def stranger(sid: str, n: int = 6) -> Sequence:
    return Sequence(sid, [200 + j for j in range(n)], SP)


def fake_run(plan: StepPlan) -> list[SampledToken]:
    return [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample]


def make(num_blocks: int = 64, **cfg: object) -> tuple[Scheduler, dict[str, Sequence]]:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, BS), 1024), {}  # type: ignore[arg-type]


def add(sched: Scheduler, seqs: dict[str, Sequence], *new: Sequence) -> None:
    for s in new:
        seqs[s.seq_id] = s
        sched.add(s)


def step(sched: Scheduler, seqs: dict[str, Sequence]) -> StepPlan:
    plan = sched.schedule()
    sched.update_from_output(plan, fake_run(plan), seqs, 0.0)
    return plan


def chunks(plan: StepPlan) -> list[tuple[str, int]]:
    return [(c.seq_id, c.num_tokens) for c in plan.chunks]


# ---- the block manager ------------------------------------------------------------------------
def test_blocks_are_in_flight_from_allocation_until_commit() -> None:
    bm = BlockManager(32, BS)
    holder, waiter = sibling(0), sibling(1)
    assert bm.num_blocks_in_flight(waiter) == 0  # nothing is being computed yet
    assert bm.allocate(holder)
    assert bm.num_blocks_in_flight(waiter) == 4 and bm.num_cached_prefix_tokens(waiter) == 0
    assert bm.num_blocks_in_flight(holder) == 0  # a sequence never waits for itself
    assert bm.num_blocks_in_flight(stranger("x")) == 0
    holder.num_computed_tokens = 2 * BS  # a chunk of two blocks completed
    bm.commit(holder)
    assert bm.num_cached_prefix_tokens(waiter) == 2 * BS and bm.num_blocks_in_flight(waiter) == 2
    holder.num_computed_tokens = holder.num_tokens
    bm.commit(holder)
    assert bm.num_cached_prefix_tokens(waiter) == 4 * BS and bm.num_blocks_in_flight(waiter) == 0


def test_freeing_the_holder_releases_its_uncommitted_blocks() -> None:
    bm = BlockManager(32, BS)
    holder, waiter = sibling(0), sibling(1)
    bm.allocate(holder)
    holder.num_computed_tokens = BS
    bm.commit(holder)
    bm.free(holder)  # preempted, aborted or failed before the rest was computed
    assert bm.num_blocks_in_flight(waiter) == 0 and bm.num_cached_prefix_tokens(waiter) == BS
    assert bm.allocate(waiter)  # the waiter computes the rest itself, and now holds it
    assert bm.num_blocks_in_flight(holder) == 3


def test_no_blocks_in_flight_without_prefix_caching() -> None:
    bm = BlockManager(32, BS, enable_prefix_caching=False)
    bm.allocate(sibling(0))
    assert bm.num_blocks_in_flight(sibling(1)) == 0


# ---- the scheduler ----------------------------------------------------------------------------
def test_siblings_wait_for_the_holder_and_others_are_admitted_past_them() -> None:
    sched, seqs = make()
    add(sched, seqs, *(sibling(i) for i in range(6)), stranger("x"))
    p1 = step(sched, seqs)
    assert chunks(p1) == [("s0", 19), ("x", 6)]  # the siblings are held, the stranger is not
    p2 = step(sched, seqs)
    assert chunks(p2) == [("s0", 1), ("x", 1)] + [(f"s{i}", 3) for i in range(1, 6)]
    assert all(seqs[f"s{i}"].num_cached_tokens == len(PREFIX) for i in range(1, 6))
    assert sched.num_prefix_cache_hit_tokens == 5 * len(PREFIX)
    assert num_prefill_tokens(p1) + num_prefill_tokens(p2) == len(PREFIX) + 6 * 3 + 6


def test_a_short_shared_header_is_not_worth_waiting_for() -> None:
    sched, seqs = make()
    header = PREFIX[:BS]  # one block shared with a long prompt: less than half of what each computes
    a = Sequence("a", header + list(range(300, 310)), SP)
    b = Sequence("b", header + list(range(400, 406)), SP)
    c = Sequence("c", PREFIX[: 2 * BS] + list(range(500, 508)), SP)  # 4 of its 16 tokens computed by a: still not half
    add(sched, seqs, a, b, c)
    assert [cid for cid, _ in chunks(step(sched, seqs))] == ["a", "b", "c"]


def test_sharing_off_computes_the_prefix_once_per_sibling() -> None:
    sched, seqs = make(enable_inflight_prefix_sharing=False)
    add(sched, seqs, *(sibling(i) for i in range(6)))
    p1 = step(sched, seqs)
    assert chunks(p1) == [(f"s{i}", 19) for i in range(6)] and sched.num_prefix_cache_hit_tokens == 0


def test_chunked_holder_keeps_siblings_waiting_until_every_shared_block_is_committed() -> None:
    sched, seqs = make(max_num_batched_tokens=12, enable_chunked_prefill=True)
    add(sched, seqs, sibling(0), sibling(1))
    assert chunks(step(sched, seqs)) == [("s0", 12)]  # blocks 0-2 committed
    # s0's last chunk fills block 3: s1 would compute it too with the budget left (5 tokens); it waits.
    assert chunks(step(sched, seqs)) == [("s0", 7)]
    p3 = step(sched, seqs)
    assert chunks(p3) == [("s0", 1), ("s1", 3)] and seqs["s1"].num_cached_tokens == len(PREFIX)


def test_aborting_the_holder_lets_the_waiter_compute() -> None:
    sched, seqs = make(max_num_batched_tokens=12, enable_chunked_prefill=True)
    add(sched, seqs, sibling(0), sibling(1))
    step(sched, seqs)  # s0 committed 3 of the 4 shared blocks
    plan = sched.schedule()
    assert chunks(plan) == [("s0", 7)]  # s1 waits for block 3
    sched.finish(seqs["s0"], "abort")  # while that step runs
    sched.update_from_output(plan, fake_run(plan), seqs, 0.0)
    p = step(sched, seqs)
    assert chunks(p) == [("s1", 7)] and seqs["s1"].num_cached_tokens == 3 * BS
    for _ in range(10):
        step(sched, seqs)
    assert seqs["s1"].finish_reason == "length"


def test_preempting_the_holder_releases_the_waiter_and_everything_finishes() -> None:
    # 7 blocks: x (2) + s0 (5) fill the cache; x's first decode needs an eighth, so the newest
    # running sequence, s0, is preempted in the middle of its chunked prefill, while s1 waits for it.
    sched, seqs = make(num_blocks=7, max_num_batched_tokens=12, enable_chunked_prefill=True)
    add(sched, seqs, stranger("x", 8), sibling(0), sibling(1))
    assert chunks(step(sched, seqs)) == [("x", 8), ("s0", 4)]
    assert sched.block_manager.num_blocks_in_flight(seqs["s1"]) == 3
    p2 = step(sched, seqs)
    assert p2.preempted_seq_ids == ["s0"] and chunks(p2) == [("x", 1)]
    assert sched.block_manager.num_blocks_in_flight(seqs["s1"]) == 0  # no longer held by s0
    for _ in range(100):
        if not sched.has_unfinished():
            break
        step(sched, seqs)
    assert not sched.has_unfinished(), "a held sequence starved or deadlocked"
    assert all(s.finish_reason == "length" for s in seqs.values())


def test_a_requeued_holder_computes_on_and_holds_again() -> None:
    sched, seqs = make(max_num_batched_tokens=8, enable_chunked_prefill=True)
    add(sched, seqs, sibling(0), sibling(1))
    step(sched, seqs)
    sched._preempt(seqs["s0"])  # back to the queue, ahead of s1 (older)
    assert sched.block_manager.num_blocks_in_flight(seqs["s1"]) == 0
    plan = sched.schedule()
    assert chunks(plan) == [("s0", 8)] and seqs["s0"].num_cached_tokens == 2 * BS
    assert sched.block_manager.num_blocks_in_flight(seqs["s1"]) == 2


def test_instance_core_counts_prefill_and_hit_tokens_across_a_reset() -> None:
    core = InstanceCore("colocated", SchedulerConfig(), 64, BS, 1024)
    for i in range(3):
        core.add(sibling(i))
    while core.has_work():
        core.step(fake_run, lambda: 0.0)
    assert core.num_prefill_tokens_computed == len(PREFIX) + 3 * 3
    assert core.num_prefix_cache_hit_tokens == 2 * len(PREFIX)
    core.reset()
    core.add(sibling(5))
    while core.has_work():
        core.step(fake_run, lambda: 0.0)
    assert core.num_prefill_tokens_computed == 2 * len(PREFIX) + 4 * 3  # the cache went with the reset
    stats = core.stats()
    assert (stats["prefill_tokens_computed_total"], stats["prefix_cache_hit_tokens_total"]) == (2 * 16 + 12, 2 * 16)


def test_decodes_and_recomputed_sampled_tokens_are_not_prefill_tokens() -> None:
    sched, seqs = make()
    add(sched, seqs, stranger("x", 6))
    p1, p2 = step(sched, seqs), step(sched, seqs)
    assert (num_prefill_tokens(p1), num_prefill_tokens(p2)) == (6, 0)
    sched._preempt(seqs["x"])
    # Recompute: 8 tokens, the first block from the cache; of the 4 computed the newest sampled one is a decode.
    assert num_prefill_tokens(step(sched, seqs)) == 3


def test_a_held_latency_request_is_not_overtaken_by_throughput_work() -> None:
    """Held for a prefix its sibling computes, a latency request keeps its place: throughput requests
    behind it wait too (a request of its own class is still admitted past it)."""
    from distserve.cluster.classes import RequestClass

    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm, max_model_len=64)
    latency, throughput = RequestClass("latency"), RequestClass("throughput")
    shared = list(range(100, 108))  # two full blocks
    sched.add(Sequence("lat-0", shared + [1], SP, request_class=latency))
    sched.add(Sequence("lat-1", shared + [2], SP, request_class=latency))  # held: its prefix is lat-0's
    sched.add(Sequence("lat-2", [7, 8, 9], SP, request_class=latency))  # same class: admitted past it
    sched.add(Sequence("thr-0", [4, 5, 6], SP, request_class=throughput))  # lower class: waits
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == ["lat-0", "lat-2"]
