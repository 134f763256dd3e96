"""Prefix groups stay together when a step cannot take every running sequence (``group_by_prefix``):
micro-batches of a pipeline hold whole groups, classes keep their order, nothing changes when
everything fits, preemption still takes the policy order's tail, and the simulator (which runs the
same scheduler) does the same."""

from __future__ import annotations

from distserve.config import SamplingParams, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.prefix_grouping import PrefixGrouping, group_by_prefix
from distserve.engine.scheduler import Scheduler
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.placement import Placement
from simulator.latency import FittedLatencyModel
from simulator.profiles import TpCoefficients
from simulator.simulation import SimConfig, Simulation
from simulator.workload import Request

BS = 4
PREFIXES = {"A": [1000 + i for i in range(2 * BS)], "B": [2000 + i for i in range(2 * BS)]}  # 2 full blocks each


def sampled(plan: StepPlan) -> list[SampledToken]:
    return [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample]


def interleaved(sched: Scheduler, num_per_group: int, max_tokens: int = 50) -> dict[str, Sequence]:
    """A0 B0 A1 B1 ...: two prefix groups in alternating arrival order."""
    seqs: dict[str, Sequence] = {}
    for i in range(num_per_group):
        for g, prefix in PREFIXES.items():
            sid = f"{g}{i}"
            prompt = prefix + [3000 + 10 * len(seqs) + j for j in range(3)]
            seqs[sid] = seq = Sequence(sid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=float(len(seqs)))
            sched.add(seq)
    return seqs


def run_until_decoding(sched: Scheduler, seqs: dict[str, Sequence]) -> None:
    """Step (``pipeline_depth`` plans, then their updates) until every sequence decodes."""
    for _ in range(100):
        if all(s.block_table and s.num_computed_tokens == len(s.token_ids) - 1 for s in seqs.values()):
            return
        plans = [sched.schedule() for _ in range(sched.pipeline_depth)]
        for plan in plans:
            sched.update_from_output(plan, sampled(plan), seqs, 0.0)
    raise AssertionError("prompts did not finish")


def groups_of(ids: list[str]) -> set[str]:
    return {sid[0] for sid in ids}


def test_pipeline_micro_batches_hold_whole_groups() -> None:
    """pp = 2, four sequences per plan, A and B interleaved in arrival: each plan takes one group."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4), BlockManager(128, BS), 1024, pipeline_depth=2)
    seqs = interleaved(sched, 4)
    run_until_decoding(sched, seqs)
    for g in PREFIXES:  # prefix caching gave each group's members the same first blocks
        assert len({tuple(s.block_table[:2]) for sid, s in seqs.items() if sid[0] == g}) == 1
    for _ in range(3):
        p1, p2 = sched.schedule(), sched.schedule()
        ids1, ids2 = [c.seq_id for c in p1.chunks], [c.seq_id for c in p2.chunks]
        assert len(ids1) == len(ids2) == 4 and all(c.num_tokens == 1 for c in p1.chunks + p2.chunks)
        assert len(groups_of(ids1)) == len(groups_of(ids2)) == 1 and groups_of(ids1) != groups_of(ids2)
        for plan in (p1, p2):
            sched.update_from_output(plan, sampled(plan), seqs, 0.0)
    assert [s.seq_id for s in sched.running] == list(seqs)  # the policy order itself is untouched


def test_a_budget_smaller_than_the_batch_takes_whole_groups() -> None:
    """pp = 1 with a token budget of 4 decodes for 8 running sequences: the step takes one group."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockManager(128, BS), 1024)
    seqs = interleaved(sched, 4)
    run_until_decoding(sched, seqs)
    sched.config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == ["A0", "A1", "A2", "A3"]


def test_no_change_when_everything_fits() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(128, BS), 1024)
    seqs = interleaved(sched, 4)
    run_until_decoding(sched, seqs)
    plan = sched.schedule()
    assert [c.seq_id for c in plan.chunks] == list(seqs)  # arrival (policy) order, groups interleaved


def seq_with(sid: str, table: list[int], rank: int = 1) -> Sequence:
    seq = Sequence(sid, [1] * (BS * len(table)), SamplingParams())
    seq.block_table, seq.class_rank = table, rank
    return seq


def test_groups_sit_at_their_best_member_and_never_cross_classes() -> None:
    # Policy order: class 0 first. x and y share block 5 in class 1; z shares it too but is class 2.
    order = [seq_with("hi", [9, 1]), seq_with("hi5", [5, 1], rank=0), seq_with("x", [5, 2]), seq_with("solo", [7, 3]),
             seq_with("z", [5, 4], rank=2), seq_with("y", [5, 6]), seq_with("lo", [8, 8], rank=2)]
    order[0].class_rank = 0
    grouped = group_by_prefix(order)
    assert grouped is not None
    assert [s.seq_id for s in grouped] == ["hi", "hi5", "x", "y", "solo", "z", "lo"]
    ranks = [s.class_rank for s in grouped]
    assert ranks == sorted(ranks)  # no lower class ahead of a higher one
    assert group_by_prefix([seq_with("a", [1]), seq_with("b", [2]), seq_with("c", [])]) is None  # nothing shared


def test_sub_groups_of_a_tree_stay_adjacent() -> None:
    """Block 1 is a system prompt for all; 2 and 3 two documents, each shared by a sub-group."""
    order = [seq_with("d2a", [1, 2, 10]), seq_with("d3a", [1, 3, 11]), seq_with("own", [1, 4]),
             seq_with("d2b", [1, 2, 12]), seq_with("d3b", [1, 3, 13])]
    grouped = group_by_prefix(order)
    assert grouped is not None and [s.seq_id for s in grouped] == ["d2a", "d2b", "d3a", "d3b", "own"]


class PolicyOrder(PrefixGrouping):
    """The scheduler without grouping: the running loop follows the policy order."""

    def selection_order(self, running: list[Sequence], *args: object) -> list[Sequence]:
        return running


def test_preemption_keeps_the_policy_order_when_memory_is_tight() -> None:
    """With too few free blocks to rule preemption out, the step follows the policy order, and the
    victims are the latest arrivals, exactly as without grouping."""
    plans: dict[bool, list[list[str]]] = {}
    for group in (True, False):
        bm = BlockManager(14, BS)  # 8 prompts of 11 tokens: 2 shared blocks per group + 1 own block each = 12
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm, 1024, pipeline_depth=2)
        seqs = interleaved(sched, 4, max_tokens=8)
        run_until_decoding(sched, seqs)
        if not group:
            sched.prefix_grouping = PolicyOrder()
        preempted: list[list[str]] = []
        for _ in range(6):
            p1, p2 = sched.schedule(), sched.schedule()
            preempted.append(p1.preempted_seq_ids + p2.preempted_seq_ids)
            for plan in (p1, p2):
                sched.update_from_output(plan, sampled(plan), seqs, 0.0)
        plans[group] = preempted
    assert any(plans[True]) and plans[True] == plans[False]
    victims = [sid for step in plans[True] for sid in step]
    assert victims[0] == "B3"  # the latest arrival goes first


def test_grouping_waits_for_free_blocks_and_comes_back() -> None:
    """Eight decodes, four a plan: each needs at most one new block, so grouping needs 4 free."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(128, BS), 1024, pipeline_depth=2)
    seqs = interleaved(sched, 4)
    run_until_decoding(sched, seqs)
    bm, running = sched.block_manager, sched.running

    def order() -> list[Sequence]:
        return sched.prefix_grouping.selection_order(running, 0, 64, 4, bm)

    assert order() is not running
    held = bm.allocate_blocks(bm.num_free_blocks - 3)
    assert held is not None and order() is running
    bm.free_block(held.pop())
    assert order() is not running and [s.seq_id for s in order()][:4] == ["A0", "A1", "A2", "A3"]
    assert sched.prefix_grouping.selection_order(running, 5, 64, 4, bm) is not running  # kept while running is unchanged
    sched.prefix_grouping.invalidate()
    assert sched.prefix_grouping.selection_order(running, 5, 64, 4, bm) is running  # 3 ready: one plan takes them


def test_the_simulator_batches_whole_groups_too() -> None:
    """The simulator runs the same scheduler: on a decode instance with a budget of 4 tokens for 8
    decodes, every decode step holds one group (the policy order would alternate A and B)."""
    requests = []
    for i in range(4):
        for prefix in PREFIXES.values():
            prompt = tuple(prefix + [3000 + 10 * len(requests) + j for j in range(3)])
            requests.append(Request(len(requests), 0.0, len(prompt), 12, prompt_token_ids=prompt))
    coeffs = TpCoefficients(prefill=(5.0, 0.0, 0.0), decode_small=(5.0, 0.0, 0.0), decode_large=(5.0, 0.0, 0.0), decode_threshold=95)
    latency = FittedLatencyModel("facebook/opt-13b", {1: coeffs}, hardware="a100-80g")
    decode = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)  # KV arrives by migration: the budget is the decodes'
    config = SimConfig(block_size=BS, num_blocks=256, enable_prefix_caching=True, decode_scheduler=decode)
    sim = Simulation(Placement.disaggregated(1, 1), latency, config)
    decode_scheduler = sim.decodes[0].core.scheduler
    split: list[list[str]] = []  # decode steps that split more than one group
    num_full_steps = 0  # decode steps taken while more than 4 were running

    def observe(instance_id: str, plan: StepPlan) -> None:
        nonlocal num_full_steps
        if instance_id != "decode-0" or decode_scheduler.num_running <= 4:
            return
        num_full_steps += 1
        taken = {c.seq_id for c in plan.chunks}
        groups = {int(sid) % 2 for sid in taken}
        partial = [g for g in groups if any(int(s.seq_id) % 2 == g and s.seq_id not in taken for s in decode_scheduler.running)]
        if len(partial) > 1:  # whole groups, only the last one taken may be cut short
            split.append(sorted(taken))

    sim.on_plan = observe
    result = sim.run(requests)
    assert all(r.completed for r in result.records)
    assert num_full_steps >= 10 and not split, split
