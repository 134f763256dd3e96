"""Continuous-batching scheduler: it makes the ``StepPlan`` (``distserve.engine.step_plan``) each step runs.

Every step the scheduler decides how many new tokens each sequence computes (a decode is one
token; a prefill is the uncached part of the prompt, possibly chunked) under a token budget and a
sequence cap, allocating KV blocks as it goes and preempting by recompute when blocks run out.
The result is a plain ``StepPlan``; whoever executes it reports sampled tokens back through
``update_from_output`` (``engine.step_outputs``). ``n`` > 1 completions are forked in ``engine.forks``.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from distserve.cluster.classes import GroupArrivals
from distserve.cluster.recovery import solo_order
from distserve.config import SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.prefix_grouping import PrefixGrouping
from distserve.engine.forks import ForkedCompletions
from distserve.engine.rank_order import RECENT_ADMISSIONS, AdmissionRankOrder
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.engine.step_budget import StaticBudget, make_step_budget
from distserve.engine.step_outputs import StepOutputs
from distserve.engine.step_plan import ScheduledChunk, StepPlan, chunk_history
from distserve.engine.structured_output import SequenceGrammars
from distserve.errors import StepFailedError


# ---- policies: a sort key over sequences; the largest key is preempted first --------------------
PolicyKey = Callable[[Sequence], tuple]


# Keys start with the class rank (latency first, whatever the policy), then a task group's first
# (arrival, order), so its members stay adjacent (``_stamp``). attrgetter: no Python call per sequence.
_fcfs_key: PolicyKey = attrgetter("class_rank", "admission_rank", "group_arrival", "group_order", "arrival_time", "order")
_priority_key: PolicyKey = attrgetter("class_rank", "admission_rank", "priority", "group_arrival", "group_order", "arrival_time", "order")


SCHEDULING_POLICIES: dict[str, PolicyKey] = {"fcfs": _fcfs_key, "priority": _priority_key}

_LAZY_DECODE: Any = None  # a lazy decode's place in a plan (``schedule``); Any: mypyc checks a ScheduledChunk's type


def get_policy(name: str) -> PolicyKey:
    if name not in SCHEDULING_POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {sorted(SCHEDULING_POLICIES)}")
    return SCHEDULING_POLICIES[name]


class Scheduler(AdmissionRankOrder):  # (mypyc: AdmissionRankOrder(ForkedCompletions(StepOutputs)), the same MRO)
    """Colocated continuous batching: running sequences first, then admissions by policy.

    Crash suspects (``Sequence.isolate``, set by ``distserve.cluster.recovery``) wait in
    ``isolated`` and each gets a step of its own before it is batched again, so a request that
    makes steps fail is caught alone rather than with the requests it happened to share a batch
    with. ``clears_isolation`` is False where a phase cannot prove a suspect innocent (prefill: the
    fault may lie in decoding), so the suspect is isolated again where it runs next.
    """

    clears_isolation = True
    forks_run_here = True  # a prompt's ``n`` completions decode here: admitting it takes n running slots
    phase = "colocated"  # the instance role this scheduler serves (``PrefillScheduler``: prefill; ``DecodeScheduler``: decode)
    # Constrained decoding: the instance's grammar matchers, advanced as tokens are appended (set by ``InstanceCore``).
    grammars: SequenceGrammars | None = None

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        pipeline_depth: int = 1,
    ) -> None:
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
        self.config = config
        # With pipeline parallelism up to ``pipeline_depth`` plans are in flight at once: a sequence
        # in an unfinished plan is skipped (and never preempted) until its update arrives.
        self.pipeline_depth = pipeline_depth
        self.in_flight: set[str] = set()
        # max_num_seqs bounds one batch; each micro-batch in flight gets its own share.
        self.max_running = config.max_num_seqs * pipeline_depth
        self.eos_token_ids = eos_token_ids
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.policy = get_policy(config.policy)
        self.step_budget = make_step_budget(config)
        self._static_budget = isinstance(self.step_budget, StaticBudget)
        self._chunk_prefills = config.enable_chunked_prefill or self.step_budget.chunks_prefills
        self._prompts_alone = config.step_policy == "vllm-2023"  # prompts in steps of their own (``STEP_POLICIES``)
        self.waiting: list[Sequence] = []  # sorted by policy key
        self._waiting_keys: list[tuple] = []
        self.running: list[Sequence] = []  # in policy order at each step; add with _append_running
        self.isolated: list[Sequence] = []  # crash suspects, each waiting for a step of its own
        self._running_sorted = True  # False once an append broke the order; schedule() re-sorts then
        self._finished_since_plan: list[str] = []
        self._scheduling: Sequence | None = None  # the sequence being decided on (crash attribution)
        self._step_rank: int | None = None  # the lowest admission rank of the prompts in the step being planned
        self._recent_ranks: deque[int] = deque(maxlen=RECENT_ADMISSIONS)  # ``_backlog_room``
        self._prompt_cost = [0.0, 0.0]  # ``observe_prompt_cost``
        self._observe_prompts = config.backlog_step_s is not None and self.phase != "decode"
        self.prefix_grouping = PrefixGrouping()  # the order the running loop offers sequences
        self._order = 0
        self._groups = GroupArrivals()
        self.num_preemptions = 0
        self.num_prefix_cache_query_tokens = 0  # tokens of the sequences admissions looked up in the prefix cache
        self.num_prefix_cache_hit_tokens = 0  # ... and those taken from it
        self.forking: dict[str, Sequence] = {}  # leaders (``n`` > 1) whose completions are not forked yet
        self.num_forked_completions = 0  # completions that took their prompt's KV from a fork, not a prefill

    # ---- queue management --------------------------------------------------------------------
    def _stamp(self, seq: Sequence) -> None:
        """Number ``seq`` in admission order and key it by its task group's first member."""
        seq.order = order = self._order
        self._order += 1
        group = seq.request_class.group
        arrival = seq.arrival_time if seq.dispatch_time is None else seq.dispatch_time  # behind an admission queue: its order
        if group is None:
            seq.group_arrival, seq.group_order = arrival, order
        else:
            seq.group_arrival, seq.group_order = self._groups.first(group, arrival, order)

    def add(self, seq: Sequence) -> None:
        self._stamp(seq)
        if seq.forks:
            self.forking[seq.seq_id] = seq
        if seq.isolate:
            seq.status = SequenceStatus.WAITING
            self.isolated.append(seq)
        else:
            self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        key = self.policy(seq)
        i = bisect.bisect_right(self._waiting_keys, key)
        self._waiting_keys.insert(i, key)
        self.waiting.insert(i, seq)

    def _append_running(self, seq: Sequence) -> None:
        self.prefix_grouping.invalidate()  # a sequence that comes back may need more tokens than when grouped
        running = self.running
        if running and self._running_sorted and self.policy(seq) < self.policy(running[-1]):
            self._running_sorted = False
        running.append(seq)

    def _pop_waiting(self, i: int = 0) -> Sequence:
        self._waiting_keys.pop(i)
        return self.waiting.pop(i)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.isolated)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return self.has_work()

    def has_work(self) -> bool:
        """Something to compute: queued, running or isolated sequences (not ones parked elsewhere)."""
        return bool(self.waiting or self.running or self.isolated)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop ``seq`` (done, stopped or aborted) and release its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self._pop_waiting(self.waiting.index(seq))
        elif seq in self.isolated:
            self.isolated.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._finished_since_plan.append(seq.seq_id)
        if seq.forks:
            self._unfork(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop its KV and put it back in the waiting queue."""
        self.running.remove(seq)
        self.prefix_grouping.invalidate()
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self, num_lazy_decodes: int = 0, lazy_decode_ctx: int = 0, num_lazy_in_flight: int = 0,
                 lazy_in_flight_ctx: int = 0) -> StepPlan:
        """The next step's plan. A failure while deciding one sequence's share is blamed on that
        sequence (``StepFailedError``): a request that breaks scheduling fails alone, as one that
        breaks the model does.

        Lazy decodes (the simulator keeps decoding sequences in a compact form): the first
        ``num_lazy_decodes + num_lazy_in_flight`` running sequences are the driver's, their state
        unread; ``num_lazy_decodes`` of them (contexts ``lazy_decode_ctx``) decode one token each in
        this plan, in its budget and cap but without a chunk (the driver made their slots and
        applies them), the others are in plans in flight. The driver vouches that the decoding ones
        fit (budget, cap, policy order) and nothing is isolated or waits for a prompts-alone step:
        the plan is ``schedule()``'s less their chunks."""
        self._scheduling = None
        try:
            plan = self._schedule(num_lazy_decodes, lazy_decode_ctx, num_lazy_in_flight, lazy_in_flight_ctx)
            if self.forking:
                self._plan_forks(plan)
            return plan
        except Exception as exc:
            seq: Sequence | None = self._scheduling
            if seq is None:
                raise
            raise StepFailedError(f"scheduling {seq.seq_id} failed: {type(exc).__name__}: {exc}", [seq.seq_id]) from exc

    def _schedule(self, num_lazy: int = 0, lazy_ctx: int = 0, num_lazy_in_flight: int = 0, lazy_in_flight_ctx: int = 0) -> StepPlan:
        plan = StepPlan([], [], [], self._finished_since_plan)
        self._finished_since_plan = []
        running = self.running
        if not (self.waiting or self.isolated) and len(running) <= num_lazy + num_lazy_in_flight and (
                self._running_sorted or not running):
            # Nothing to plan beyond the driver's lazy decodes (or nothing at all): what follows would
            # plan no chunk and change nothing, so skip it.
            self._running_sorted = True
            return plan
        if self.isolated and not self.in_flight and self._schedule_isolated(plan):
            return plan
        if self._prompts_alone and self.waiting and self._schedule_prompts_alone(plan):
            return plan
        if self._static_budget:
            budget = self.config.max_num_batched_tokens
        else:
            # The sequences that decode this step (one token left to compute): their TPOT is what a budget protects.
            head = num_lazy + num_lazy_in_flight
            decoding = [len(s.token_ids) for s in (self.running[head:] if head else self.running)
                        if len(s.token_ids) - s.num_computed_tokens <= 1]
            budget = self.step_budget.tokens(head + len(decoding), lazy_ctx + lazy_in_flight_ctx + sum(decoding))
        # The lazy decodes hold their places in the batch (counts and emptiness below), not a chunk.
        decodes: list[ScheduledChunk] = [_LAZY_DECODE] * num_lazy
        prefills: list[ScheduledChunk] = []
        preempted = False
        block_manager = self.block_manager
        append_slots = block_manager.append_slots
        block_copies = plan.block_copies

        # Running sequences in policy order, so the lowest-ranked are preempted first.
        if not self._running_sorted:  # removals keep the order; only _append_running can break it
            running.sort(key=self.policy)
            self._running_sorted = True
        i = num_lazy + num_lazy_in_flight
        in_flight = self.in_flight
        max_seqs = self.config.max_num_seqs  # per plan: with pp > 1, each micro-batch gets its share
        # ``running`` itself, or prefix groups together when the step cannot take them all and cannot preempt.
        order = self.prefix_grouping.selection_order(running, len(in_flight) + num_lazy_in_flight, budget, max_seqs, block_manager)
        if i:
            assert order is running and num_lazy <= min(budget, max_seqs), "lazy decodes must all fit, in policy order"
            budget -= num_lazy
        # The running sequences before the waiting ones, except partly computed prompts that rank after
        # the first waiting one: those go after (``_overtaken``).
        self._step_rank = None
        prompt_tokens = 0  # prompt tokens this step computes so far (``_backlog_room``)
        split: int | None = None  # where the overtaken prompts start in ``order`` (None: none are)
        if self._chunk_prefills and self.waiting:
            order, split = self._overtaken(order, num_lazy + num_lazy_in_flight)
        waiting = [] if self._prompts_alone else self.waiting  # "vllm-2023": prompts never join decodes
        for late in (False, True):
            # len(order) each time: preemption may shrink ``order`` (it can be ``running`` itself)
            while i < (len(order) if late or split is None else split) and budget > 0 and len(decodes) + len(prefills) < max_seqs:
                seq = self._scheduling = order[i]
                token_ids = seq.token_ids
                start = seq.num_computed_tokens
                n = len(token_ids) - start
                if n > budget:
                    n = budget
                if n <= 0 or (in_flight and seq.seq_id in in_flight) or (n > 1 and self._above_step_rank(seq)):
                    i += 1
                    continue
                if n > 1:  # a prompt's next chunk: within the backlog cap
                    room = self._backlog_room(prompt_tokens)
                    if room is not None and n > room:
                        if room <= 0:
                            i += 1
                            continue
                        n = room
                    prompt_tokens += n
                copies = append_slots(seq, n)
                while copies is None and not late:  # overtaken prompts never preempt what this step computes
                    victim = self._preemption_victim()
                    if victim is None:
                        break
                    self._preempt(victim)
                    plan.preempted_seq_ids.append(victim.seq_id)
                    preempted = True
                    if victim is seq:
                        break
                    copies = append_slots(seq, n)
                if copies is None:
                    break
                if copies:
                    block_copies.extend(copies)
                # _chunk inlined (this loop runs per sequence per step); a decode's one token without a slice.
                end = start + n
                num_tokens = len(token_ids)
                sampling = seq.sampling
                num_output_tokens = num_tokens - len(seq.prompt_token_ids)
                chunk = ScheduledChunk(
                    seq.seq_id, [token_ids[start]] if n == 1 else token_ids[start:end], start, seq.block_table[:],
                    end == num_tokens, sampling, num_output_tokens,
                    chunk_history(token_ids, sampling, num_output_tokens) if sampling.needs_history else None,
                )
                (decodes if n == 1 else prefills).append(chunk)
                budget -= n
                i += 1
            if not late:
                budget = self._admit_waiting(waiting, budget, preempted, decodes, prefills, max_seqs)
                if split is None:
                    break
                i = split
        self._scheduling = None
        if num_lazy:
            del decodes[:num_lazy]
        if prefills:
            decodes.extend(prefills)
        plan.chunks = decodes
        if self.pipeline_depth > 1:
            in_flight.update(c.seq_id for c in decodes)
        return plan

    def _admit_waiting(
        self, waiting: list[Sequence], budget: int, preempted: bool, decodes: list[ScheduledChunk],
        prefills: list[ScheduledChunk], max_seqs: int,
    ) -> int:
        """Admit waiting sequences into this step; returns the budget left.

        Not when the step just had to preempt (memory is tight); one that would recompute a prefix
        being computed here right now waits (``_held``) without blocking its class: requests of its
        class (or a higher one) are admitted past it, a lower class is not (a held latency request
        keeps its place ahead of throughput work).
        """
        block_manager = self.block_manager
        share = self.config.enable_inflight_prefix_sharing
        held_rank: int | None = None
        w = 0
        while (
            w < len(waiting) and not preempted and budget > 0
            and len(self.running) < self.max_running and len(decodes) + len(prefills) < max_seqs
        ):
            seq = self._scheduling = waiting[w]
            if held_rank is not None and seq.class_rank > held_rank:
                break
            if share and self._held(seq):
                held_rank = seq.class_rank if held_rank is None else min(held_rank, seq.class_rank)
                w += 1
                continue
            if self._above_step_rank(seq):
                w += 1
                continue
            if not self._fits(seq) or (seq.forks and self.forks_run_here and len(self.running) + seq.num_completions > self.max_running):
                break
            n = seq.num_tokens - block_manager.num_cached_prefix_tokens(seq)
            if n > budget:
                if self._chunk_prefills:
                    n = budget
                elif decodes or prefills:
                    break
                # A prompt larger than the whole budget runs alone rather than never.
            if prefills or self._chunk_prefills:  # the first prompt of a step runs whole (or chunked)
                room = self._backlog_room(sum(len(c.token_ids) for c in prefills))
                if room is not None and n > room:
                    if room <= 0 or not self._chunk_prefills:
                        break
                    n = room
            self._pop_waiting(w)
            self._recent_ranks.append(seq.admission_rank)
            self._allocate(seq)
            n = min(n, seq.num_uncomputed_tokens)
            seq.status = SequenceStatus.RUNNING
            self._append_running(seq)
            chunk = self._chunk(seq, n)
            (decodes if chunk.is_decode else prefills).append(chunk)
            budget -= n
        return budget

    def _allocate(self, seq: Sequence) -> None:
        """Give waiting ``seq`` its blocks (the caller checked they fit), counting its prefix-cache lookup."""
        self.block_manager.allocate(seq)
        self.num_prefix_cache_query_tokens += seq.num_tokens
        self.num_prefix_cache_hit_tokens += seq.num_cached_tokens

    def _fits(self, seq: Sequence) -> bool:
        """Whether waiting ``seq`` may take its blocks now (a phase may keep some back: ``PrefillScheduler``)."""
        return self.block_manager.can_allocate(seq)

    def _schedule_prompts_alone(self, plan: StepPlan) -> bool:
        """Fill ``plan`` with the waiting prompts that can be admitted now, and nothing else (the
        "vllm-2023" step policy: the running decodes pause for this step)."""
        self._step_rank = None
        ones: list[ScheduledChunk] = []  # prompts whose cached prefix leaves one token to compute
        prompts: list[ScheduledChunk] = []
        self._admit_waiting(self.waiting, self.config.max_num_batched_tokens, False, ones, prompts, self.config.max_num_seqs)
        plan.chunks = ones + prompts
        if self.pipeline_depth > 1:
            self.in_flight.update(c.seq_id for c in plan.chunks)
        return bool(plan.chunks)

    def _held(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits for prefix blocks another sequence here is computing now, to take them
        from the cache once committed: if they are at least half of what it would compute (so a
        sibling behind a long shared prompt waits, a prompt sharing only a short header does not)."""
        bm = self.block_manager
        shared = bm.num_blocks_in_flight(seq) * bm.block_size
        return shared > 0 and 2 * shared >= seq.num_tokens - bm.num_cached_prefix_tokens(seq)

    def _schedule_isolated(self, plan: StepPlan) -> bool:
        """Fill ``plan`` with the oldest crash suspect alone, if its blocks can be had now."""
        seq = self._scheduling = min(self.isolated, key=solo_order)  # the order crash attribution assumes
        bm = self.block_manager
        if seq.block_table:  # arrived with its KV (a decode instance's completed migration)
            copies = bm.append_slots(seq, seq.num_uncomputed_tokens)
            if copies is None:
                return False
            plan.block_copies.extend(copies)
        else:
            if not bm.can_allocate(seq):
                return False
            self._allocate(seq)
        n = seq.num_uncomputed_tokens
        if self._chunk_prefills:
            n = min(n, self.config.max_num_batched_tokens)
        self.isolated.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self._append_running(seq)
        plan.chunks = [self._chunk(seq, n)]
        if self.pipeline_depth > 1:
            self.in_flight.add(seq.seq_id)
        return True

    def _preemption_victim(self) -> Sequence | None:
        """The lowest-ranked running sequence that no in-flight plan is computing."""
        for seq in reversed(self.running):
            if seq.seq_id not in self.in_flight:
                return seq
        return None

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        sp, num_output_tokens = seq.sampling, seq.num_output_tokens
        return ScheduledChunk(seq.seq_id, seq.token_ids[start : start + n], start, list(seq.block_table),
                              start + n == seq.num_tokens, sp, num_output_tokens,
                              chunk_history(seq.token_ids, sp, num_output_tokens) if sp.needs_history else None)
