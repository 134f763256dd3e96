"""How log-probabilities appear in OpenAI responses: completions' ``logprobs`` (with an echoed
prompt's), chat's ``logprobs.content`` with ``top_logprobs``, and vLLM's ``prompt_logprobs``.

The values are the engine's (``distserve.engine.logprobs``: the model's raw distribution, vLLM's
default ``raw_logprobs``); -inf is reported as -9999.0, as vLLM does, since JSON has no infinity.
A token's text is its id decoded alone, special tokens kept, and its ``bytes`` that text's UTF-8
(vLLM's convention: a token that is part of a multi-byte character reads as U+FFFD).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from distserve.engine.logprobs import PromptLogprobs, TopLogprobs
from distserve.engine.outputs import RequestOutput
from distserve.engine.tokenizer import Tokenizer
from distserve.serving.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprobsOut,
    PromptTokenLogprob,
)

LOGPROB_FLOOR = -9999.0
MAX_CACHED_TEXTS = 1 << 17

# One position of a response: (token id, its logprob or None for an echoed prompt's first token,
# the top alternatives or None when there are none to report).
Entry = tuple[int, float | None, TopLogprobs | None]


def _clamp(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares false: floored too


class LogprobsRenderer:
    """Builds the logprobs parts of responses from ``RequestOutput``s, with a cache of token texts."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._texts) < MAX_CACHED_TEXTS:
                self._texts[token_id] = text
        return text

    # ---- positions ------------------------------------------------------------------------------
    @staticmethod
    def output_entries(out: RequestOutput, new_only: bool = False) -> list[Entry]:
        """The output tokens (all of them, or those new in ``out``) with their logprobs."""
        ids = out.new_token_ids if new_only else out.token_ids
        if out.logprobs is None or not ids:
            return []
        n = len(ids)
        logprobs = out.logprobs[len(out.logprobs) - n :]
        tops: Sequence[TopLogprobs | None] = (
            out.top_logprobs[len(out.top_logprobs) - n :] if out.top_logprobs is not None else [None] * n
        )
        return list(zip(ids, logprobs, tops))

    @staticmethod
    def prompt_entries(out: RequestOutput) -> list[Entry]:
        """The prompt tokens with their logprobs (the first has none; all None if they are missing)."""
        ids = out.prompt_token_ids
        pl = out.prompt_logprobs
        if pl is None or len(pl) != len(ids) - 1:
            return [(t, None, None) for t in ids]
        return [(ids[0], None, None)] + [(t, lp, top) for t, lp, top in zip(ids[1:], pl.logprobs, pl.top)]

    # ---- response parts -------------------------------------------------------------------------
    def completion(self, entries: list[Entry], offset: int, k: int) -> CompletionLogprobs:
        """Completions' ``logprobs`` from character ``offset``: each position's token and its ``k`` most
        likely tokens (so up to k + 1 entries, as OpenAI documents; fewer when texts coincide)."""
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float] | None] = []
        for token_id, logprob, top in entries:
            text = self.text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if logprob is None:
                tops.append(None)
                continue
            alternatives = {text: _clamp(logprob)}  # the token first (vLLM's order); it keeps its value if texts collide
            for t, lp in (top or ())[:k]:
                alternatives.setdefault(self.text(t), _clamp(lp))
            tops.append(alternatives)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if lp is None else _clamp(lp) for _, lp, _ in entries],
            top_logprobs=tops,
            text_offset=offsets,
        )

    def chat(self, entries: list[Entry], k: int) -> ChatLogprobs:
        """Chat's ``logprobs``: each token with its ``k`` most likely alternatives."""
        content = []
        for token_id, logprob, top in entries:
            text = self.text(token_id)
            content.append(ChatTokenLogprob(
                token=text, logprob=_clamp(logprob if logprob is not None else -math.inf), bytes=_bytes(text),
                top_logprobs=[ChatTopLogprob(token=(t_text := self.text(t)), logprob=_clamp(lp), bytes=_bytes(t_text))
                              for t, lp in (top or ())[:k]],
            ))
        return ChatLogprobs(content=content)

    def prompt_logprobs(self, out: RequestOutput, k: int) -> PromptLogprobsOut | None:
        """vLLM's ``prompt_logprobs``: null for the first prompt token, then for each the token itself
        and the ``k`` most likely, by token id, with logprob, rank (1: most likely) and text."""
        pl: PromptLogprobs | None = out.prompt_logprobs
        ids = out.prompt_token_ids
        if pl is None or len(pl) != len(ids) - 1:
            return None
        result: PromptLogprobsOut = [None]
        for token_id, logprob, rank, top in zip(ids[1:], pl.logprobs, pl.ranks, pl.top):
            position = {str(token_id): PromptTokenLogprob(logprob=_clamp(logprob), rank=rank, decoded_token=self.text(token_id))}
            for r, (t, lp) in enumerate(top[:k], start=1):
                position.setdefault(str(t), PromptTokenLogprob(logprob=_clamp(lp), rank=r, decoded_token=self.text(t)))
            result.append(position)
        return result


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


__all__ = ["Entry", "LOGPROB_FLOOR", "LogprobsRenderer"]
