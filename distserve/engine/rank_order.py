"""What a request's admission rank means to the scheduler of the instance it was dispatched to.

The admission queue (``distserve.cluster.admission``) gives each request a rank, its policy's
strict level (``fair``: the tier, then sparse tenants before backlogged ones; ``priority``: the
tier; ``fcfs``: one rank), which the driver copies to ``Sequence.admission_rank``. The scheduler
keeps that order where the queue's order alone would be lost:

* its policy keys order by the rank right after the objective class, so a request of a lower rank
  goes before the prompts of higher ranks already waiting there;
* with chunked prefill, the remaining chunks of a prompt under way wait for a waiting request that
  ranks before it (``_overtaken``): a chat is not stuck behind a long prompt's chunks;
* a step computes prompts of one rank only, the lowest (``_above_step_rank``): the chat's prompt runs
  in a step of its own, about as fast as alone, not in one padded with the backlog's prompts;
* ``waits_before`` tells a prefill plan of a backlogged rank, suspended between layers
  (``engine.preemptible``), that a prompt of a lower rank waits: it runs before the plan resumes;
* on a prefill instance a prompt of rank r leaves ``r`` units of KV blocks free (``_leaves_room``):
  a backlogged tenant's prompts, which wait there holding their KV until the decode side takes
  them, never fill the cache a sparse tenant's prompt arriving later needs;
* while a higher tier (``rank // LEVELS``) was admitted among the last ``RECENT_ADMISSIONS``, a step
  computing prompts of a lower tier takes the prompt tokens that fit in ``backlog_step_s`` at the instance's measured
  seconds per prompt token (``_backlog_room``): the layer a chat arriving mid-step waits for (layer
  preemption) is a short one;
* ``pending_prompt_tokens`` reports the prompt tokens not yet computed by rank, which admission's
  token backpressure reads (``cluster.backpressure``): a request is dispatched while the tokens
  ahead of it fit a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from distserve.cluster.fair_queue import LEVELS
from distserve.config import SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.sequence import Sequence
from distserve.engine.forks import ForkedCompletions


RESERVE_DIVISOR = 32  # a rank's unit of KV held back for lower ranks: 1/32 of a prefill instance's cache
# How far back an instance remembers the ranks it admitted (``backlog_step_s``): at a chat
# tenant's 0.2 req/s next to a backlog's 2 req/s, ~30 s.
RECENT_ADMISSIONS = 64
# Weight of the past in the seconds-per-prompt-token estimate (per step with prompt tokens).
PROMPT_COST_DECAY = 0.9


class AdmissionRankOrder(ForkedCompletions):
    """The admission-rank rules of ``Scheduler`` (a mixin: it reads the scheduler's queues and policy)."""

    waiting: list[Sequence]
    block_manager: BlockManager
    config: SchedulerConfig
    running: list[Sequence]
    isolated: list[Sequence]
    _step_rank: int | None  # the lowest admission rank of the prompts in the step being planned

    policy: Callable[[Sequence], tuple]  # the scheduler's policy key
    _recent_ranks: deque[int]  # the admission ranks of the last RECENT_ADMISSIONS admitted prompts
    _prompt_cost: list[float]  # decayed sums of [seconds, prompt tokens] of steps that computed prompts

    def pending_prompt_tokens(self, num_head_decodes: int = 0) -> tuple[int, ...]:
        """Prompt tokens held and not yet computed (waiting, isolated, partly prefilled), by admission
        rank (index): what admission's token backpressure reads (``cluster.backpressure.EntryLoad``).
        ``num_head_decodes``: the first running sequences are known to decode (the simulator's lazy
        decodes, ``Scheduler.schedule``): they hold no prompt tokens and are not read."""
        pending: list[int] = []
        for seqs in (self.waiting, self.isolated):
            for seq in seqs:
                rank = seq.admission_rank
                if rank >= len(pending):
                    pending.extend([0] * (rank + 1 - len(pending)))
                pending[rank] += len(seq.token_ids) - seq.num_computed_tokens
        running = self.running
        for i in range(num_head_decodes, len(running)):
            seq = running[i]
            n = len(seq.token_ids) - seq.num_computed_tokens
            if n > 1:  # (not the decodes)
                rank = seq.admission_rank
                if rank >= len(pending):
                    pending.extend([0] * (rank + 1 - len(pending)))
                pending[rank] += n
        return tuple(pending)

    def _leaves_room(self, seq: Sequence) -> bool:
        """Whether prompt ``seq`` leaves ``admission_rank`` reserve units of blocks free once it has its
        own (always, on an otherwise empty cache: nothing is ever starved). A unit is 1/32 of the
        cache, at most a step's prompt tokens' worth of blocks."""
        rank = seq.admission_rank
        bm = self.block_manager
        free = bm.num_free_blocks
        if rank == 0 or free == bm.num_blocks:
            return True
        unit = max(1, min(bm.num_blocks // RESERVE_DIVISOR, bm.num_blocks_for(self.config.max_num_batched_tokens)))
        return free - bm.num_blocks_for(seq.num_tokens) >= rank * unit

    def waits_before(self, rank: int) -> bool:
        """Whether a waiting prompt has an admission rank below ``rank``: one a running prompt of
        ``rank`` yields to between layers (``engine.preemptible``)."""
        return any(seq.admission_rank < rank for seq in self.waiting)

    def observe_prompt_cost(self, prompt_tokens: int, seconds: float) -> None:
        """A step that computed ``prompt_tokens`` prompt tokens took ``seconds`` (with its decodes, if any)."""
        cost = self._prompt_cost
        cost[0] = PROMPT_COST_DECAY * cost[0] + seconds
        cost[1] = PROMPT_COST_DECAY * cost[1] + prompt_tokens

    def _backlog_room(self, prompt_tokens: int) -> int | None:
        """Prompt tokens this step may still take beyond its ``prompt_tokens`` (None: no cap): the
        tokens that fit ``backlog_step_s`` at the measured cost while a higher tier than the step's
        was admitted lately (tier: ``rank // LEVELS`` under every admission policy). Within a tier
        (a flood next to chat tenants) steps stay whole: throughput, not a tier's latency, is at stake."""
        limit_s = self.config.backlog_step_s
        rank = self._step_rank
        seconds, tokens = self._prompt_cost
        if limit_s is None or not rank or seconds <= 0 or not self._recent_ranks or min(self._recent_ranks) // LEVELS >= rank // LEVELS:
            return None
        return max(1, int(limit_s * tokens / seconds)) - prompt_tokens

    def _above_step_rank(self, seq: Sequence) -> bool:
        """Whether prompt ``seq`` waits for a later step because this one computes a prompt of a lower
        admission rank (else it sets the step's rank): a sparse tenant's or a higher tier's prompt
        runs in a step of its own, as fast as when it is alone, not one filled with the backlog's."""
        if self._step_rank is None:
            self._step_rank = seq.admission_rank
            return False
        return seq.admission_rank > self._step_rank

    def _overtaken(self, order: list[Sequence], start: int = 0) -> tuple[list[Sequence], int | None]:
        """``order`` with the partly computed prompts that rank after the first waiting sequence moved to
        its end, and where they start: with chunked prefill, a prompt dispatched ahead of another's
        (a higher class or admission rank) does not wait for the other's remaining chunks. The first
        ``start`` are decodes (the scheduler's lazy decodes): they stay."""
        first_waiting = self.policy(self.waiting[0])
        policy = self.policy
        late = [s for s in (order[start:] if start else order)
                if len(s.token_ids) - s.num_computed_tokens > 1 and policy(s) > first_waiting]
        if not late:
            return order, None
        moved = set(map(id, late))
        return [s for s in order if id(s) not in moved] + late, len(order) - len(late)

