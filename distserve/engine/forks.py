"""Completions of one prompt (``n`` > 1), forked from its KV: the ``Scheduler``'s part of it (a mixin).

A request for ``n`` completions is one leader sequence whose ``forks`` wait, unscheduled, in
``Scheduler.forking``. The step that computes the leader's last prompt token samples a first token for
each completion from the same logits row (``StepPlan.forks``); applying that step forks the leader's
blocks to each completion (``BlockManager.fork``, copy-on-write) and runs them as sequences of their
own. A leader that ends before that step (aborted, failed) leaves its live completions to be
prefilled on their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from distserve.engine.block_manager import BlockManager
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.step_outputs import StepOutputs


class ForkedCompletions(StepOutputs):
    """The ``n`` > 1 rules of ``Scheduler`` (a mixin: it works on the scheduler's queues)."""

    forking: dict[str, Sequence]  # leaders whose completions are not forked yet
    num_forked_completions: int
    block_manager: BlockManager

    # the scheduler's own (mypyc: unconditional, each overridden by Scheduler; check_token_stop is StepOutputs', later in the MRO)
    def _stamp(self, seq: Sequence) -> None: ...
    def _enqueue(self, seq: Sequence) -> None: ...
    def _append_running(self, seq: Sequence) -> None: ...
    def finish(self, seq: Sequence, reason: str) -> None: ...

    def _unfork(self, leader: Sequence) -> None:
        """``leader`` ended before its completions were forked: the live ones run on their own."""
        self.forking.pop(leader.seq_id, None)
        forks, leader.forks = leader.forks, []
        for f in forks:
            if f.status is not SequenceStatus.FINISHED:
                self._follow(leader, f)
                self._enqueue(f)

    def _follow(self, leader: Sequence, f: Sequence) -> None:
        """Give completion ``f`` its leader's admission order (it was dispatched with it)."""
        f.dispatch_time, f.admission_rank = leader.dispatch_time, leader.admission_rank
        if f.prefill_start_time is None:
            f.prefill_start_time = leader.prefill_start_time
        self._stamp(f)

    def _plan_forks(self, plan: StepPlan) -> None:
        """Completions (``n`` > 1) sample from their leader's row of the step that ends its prompt."""
        forking = self.forking
        for chunk in plan.chunks:
            leader = forking.get(chunk.seq_id) if chunk.sample else None
            if leader is not None:
                plan.forks[chunk.seq_id] = [(f.seq_id, f.sampling) for f in leader.forks if f.status is not SequenceStatus.FINISHED]

    def _fork(self, leader: Sequence, get_token: Callable[[str], SampledToken | None], now: float, updated: list[Sequence]) -> None:
        """``leader``'s prompt KV is computed: each of its completions shares its blocks (copy-on-write,
        ``BlockManager.fork``) and takes the token sampled for it from the same logits. One that got
        no token (a runner that does not sample forks) is queued to prefill on its own."""
        self.forking.pop(leader.seq_id, None)
        forks, leader.forks = leader.forks, []
        lead = get_token(leader.seq_id)
        for f in forks:
            if f.status is SequenceStatus.FINISHED:
                continue  # aborted while the step ran
            self._follow(leader, f)
            token = get_token(f.seq_id)
            error = lead.error if lead is not None and lead.error is not None else (token.error if token is not None else None)
            if error is not None:
                f.error, f.finish_time, f.status, f.finish_reason = error, now, SequenceStatus.FINISHED, "error"
                updated.append(f)
                continue
            if token is None:
                self._enqueue(f)
                continue
            self.block_manager.fork(leader, f)
            f.status = SequenceStatus.RUNNING
            self._append_running(f)
            self.num_forked_completions += 1
            f.token_ids.append(token.token_id)
            if token.logprob is not None:
                f.logprobs.append(token.logprob)
                if token.top_logprobs is not None:
                    f.top_logprobs.append(token.top_logprobs)
            if lead is not None and lead.prompt_logprobs is not None:
                f.prompt_logprobs = lead.prompt_logprobs  # the same prompt: computed once, for the leader
            f.first_token_time = now
            reason = self.check_token_stop(f)  # type: ignore[attr-defined]
            if reason is not None:
                f.finish_time = now
                self.finish(f, reason)
            updated.append(f)
