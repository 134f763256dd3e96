"""Log-probabilities a request asks for: the chosen token's, the top alternatives', and the prompt's.

All of them are under the model's raw distribution (``log_softmax`` of the unprocessed logits), as
vLLM's default ``logprobs_mode`` (``raw_logprobs``) returns: penalties, ``logit_bias``, temperature
and filters change which token is drawn, never the reported log-probabilities. The sampler computes
them for sampled tokens; the model runner for prompt positions (``PromptLogprobsBuilder``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it computes: a Sequence (and the simulator, the planner) needs none
    import torch

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), the most likely first

# Rows of prompt logits turned into log-probabilities at once: bounds the [rows, V] float32 buffers
# (256 x 49k x 4 B = 50 MB) whatever the prompt's length.
PROMPT_LOGPROBS_ROWS = 256


@dataclass
class PromptLogprobs:
    """For each prompt token but the first (position i + 1 at index i): its log-probability given the
    tokens before it, its rank in that distribution (1: the most likely) and the ``k`` most likely
    tokens there (``PromptLogprobsBuilder``'s ``k``; empty lists for 0)."""

    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top: list[TopLogprobs] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)


def top_logprobs(logprobs: torch.Tensor, ks: Sequence[int]) -> list[TopLogprobs]:
    """The ``ks[i]`` most likely tokens of each row of ``logprobs`` (``[N, V]``), most likely first."""
    import torch

    k_max = min(max(ks, default=0), logprobs.shape[1])
    if k_max <= 0:
        return [[] for _ in ks]
    values, ids = torch.topk(logprobs, k_max, dim=-1)  # [N, k_max], sorted
    rows_v, rows_i = values.tolist(), ids.tolist()
    return [list(zip(rows_i[r][:k], rows_v[r][:k])) for r, k in enumerate(ks)]


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor) -> tuple[list[float], list[int]]:
    """Each row's log-probability (``logprobs``: ``[N, V]``) of its token (``token_ids``: ``[N]``), and
    the token's rank (1 + the number of strictly more likely tokens)."""
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    return chosen.squeeze(1).tolist(), ranks.tolist()


class PromptLogprobsBuilder:
    """Prompt logprobs of the sequences whose prompt is being computed, gathered chunk by chunk.

    A chunk computing positions ``start .. end - 1`` gives the logprobs of prompt tokens
    ``start + 1 .. end`` (the last row of the prompt's final chunk predicts the first output token,
    not a prompt token); a chunk starting over (a recompute) replaces what followed its start.
    """

    def __init__(self) -> None:
        self._partial: dict[str, PromptLogprobs] = {}

    def add_chunk(
        self,
        seq_id: str,
        start: int,
        hidden: torch.Tensor,
        targets: Sequence[int],
        k: int,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """``hidden`` (``[R, H]``): the final hidden states of the rows at positions ``start ..`` that
        predict ``targets`` (R prompt tokens); ``compute_logits`` maps them to ``[R, V]`` logits."""
        import torch

        built = self._partial.get(seq_id)
        if built is None or start == 0:
            built = self._partial[seq_id] = PromptLogprobs()
        if len(built) < start:  # rows missing (never computed here): no logprobs rather than misplaced ones
            del self._partial[seq_id]
            return
        del built.logprobs[start:], built.ranks[start:], built.top[start:]
        for r0 in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
            r1 = min(r0 + PROMPT_LOGPROBS_ROWS, len(targets))
            logprobs = torch.log_softmax(compute_logits(hidden[r0:r1]).float(), dim=-1)  # [r1 - r0, V]
            chosen, ranks = token_logprobs(logprobs, torch.tensor(targets[r0:r1]))
            built.logprobs.extend(chosen)
            built.ranks.extend(ranks)
            built.top.extend(top_logprobs(logprobs, [k] * (r1 - r0)))

    def pop(self, seq_id: str) -> PromptLogprobs | None:
        """The finished prompt's logprobs (None if none were gathered for it)."""
        return self._partial.pop(seq_id, None)

    def discard(self, seq_ids: Sequence[str]) -> None:
        for seq_id in seq_ids:
            self._partial.pop(seq_id, None)


__all__ = ["PROMPT_LOGPROBS_ROWS", "PromptLogprobs", "PromptLogprobsBuilder", "TopLogprobs", "token_logprobs", "top_logprobs"]
