"""What a step's executor reports back to the ``Scheduler`` (a mixin): the tokens it sampled, applied to the
sequences with the token-level stop rules (``update_from_output``, ``check_token_stop``), and how long the
step took, which the step budget and the backlog cap learn from (``observe_step``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import TYPE_CHECKING

from distserve.engine.block_manager import BlockManager
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.engine.step_budget import StepBudget
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.engine.structured_output import SequenceGrammars


class StepOutputs:
    """``Scheduler``'s side of a finished step (a mixin)."""

    in_flight: set[str]
    block_manager: BlockManager
    clears_isolation: bool
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    grammars: SequenceGrammars | None
    step_budget: StepBudget
    _static_budget: bool
    _observe_prompts: bool

    # the scheduler's own and its other mixins' (mypyc: unconditional; each is overridden earlier in Scheduler's MRO)
    def finish(self, seq: Sequence, reason: str) -> None: ...
    def observe_prompt_cost(self, prompt_tokens: int, seconds: float) -> None: ...
    def _fork(self, leader: Sequence, get_token: Callable[[str], SampledToken | None], now: float,
              updated: list[Sequence]) -> None: ...

    def observe_step(self, plan: StepPlan, seconds: float, num_lazy_decodes: int = 0, lazy_decode_ctx: int = 0) -> None:
        """The executor's report of how long ``plan`` took (measured, or modelled in the simulator),
        with the lazy decodes it was scheduled with (``schedule``)."""
        if (self._static_budget and not self._observe_prompts) or not (plan.chunks or num_lazy_decodes):
            return
        num_decodes, decode_ctx, prefill_tokens = num_lazy_decodes, lazy_decode_ctx, 0
        for chunk in plan.chunks:
            n = len(chunk.token_ids)
            if n == 1:
                num_decodes += 1
                decode_ctx += chunk.start_pos + 1
            else:
                prefill_tokens += n
        if prefill_tokens and self._observe_prompts:
            self.observe_prompt_cost(prefill_tokens, seconds)
        if not self._static_budget:
            self.step_budget.observe(num_decodes, decode_ctx, prefill_tokens, seconds)

    def update_from_output(
        self, plan: StepPlan, sampled: Seq[SampledToken], seqs: dict[str, Sequence], now: float
    ) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, apply token-level stop rules.

        Returns the sequences that received a token this step (finished ones included).
        """
        by_id = {s.seq_id: s for s in sampled}
        updated: list[Sequence] = []
        in_flight = self.in_flight
        commit = self.block_manager.commit
        check_token_stop = self.check_token_stop
        running_status = SequenceStatus.RUNNING
        get_seq = seqs.get
        get_token = by_id.get
        forks = plan.forks
        for chunk in plan.chunks:
            seq_id = chunk.seq_id
            if in_flight:
                in_flight.discard(seq_id)
            seq = get_seq(seq_id)
            if seq is None or seq.status is not running_status:
                continue  # aborted or preempted while the step ran
            seq.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            commit(seq)
            if seq.isolate and self.clears_isolation:
                seq.isolate = False  # it ran a step alone: a later crash is not blamed on it alone
            if forks and seq_id in forks and seq.forks:
                self._fork(seq, get_token, now, updated)  # before the leader's token: a stop would free the blocks
            token = get_token(seq_id)
            if token is None:
                continue
            if token.error is not None:
                seq.error = token.error
                seq.finish_time = now
                self.finish(seq, "error")
                updated.append(seq)
                continue
            seq.token_ids.append(token.token_id)
            if token.logprob is not None:
                seq.logprobs.append(token.logprob)
                if token.top_logprobs is not None:
                    seq.top_logprobs.append(token.top_logprobs)
            if seq.first_token_time is None:
                seq.first_token_time = now
                if token.prompt_logprobs is not None:
                    seq.prompt_logprobs = token.prompt_logprobs
            reason = check_token_stop(seq)
            if reason is not None:
                seq.finish_time = now
                self.finish(seq, reason)
            updated.append(seq)
        return updated

    def check_token_stop(self, seq: Sequence) -> str | None:
        """Stop reason from the last token alone (stop strings are the engine's job), or None."""
        sp = seq.sampling
        token_ids = seq.token_ids
        num_tokens = len(token_ids)
        num_output_tokens = num_tokens - len(seq.prompt_token_ids)
        if num_output_tokens >= sp.min_tokens:
            token = token_ids[-1]
            if not sp.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in sp.stop_token_ids:
                return "stop"
        if sp.structured is not None and self.grammars is not None:
            reason = self.grammars.accept(seq)  # its grammar complete: "stop" (EOS would be the only token left)
            if reason is not None:
                return reason
        if num_output_tokens >= sp.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None
