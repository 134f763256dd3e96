"""What callers get back: ``RequestOutput`` per step, and the text pipeline behind it (``OutputProcessor``:
detokenization, stop strings, logprobs). The front end that produces them is ``engine.frontend``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

from distserve.engine.logprobs import PromptLogprobs, TopLogprobs
from distserve.engine.request_metrics import RequestMetrics
from distserve.engine.sequence import Sequence
from distserve.engine.detokenizer import Detokenizer
from distserve.engine.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    """A request's state after a step; ``new_*`` hold what arrived since its previous output."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[float] | None = None  # of each output token so far, if the request asked
    top_logprobs: list[TopLogprobs] | None = None  # per output token so far, if the request asked
    prompt_logprobs: PromptLogprobs | None = None  # prompt tokens 1.. (``engine.logprobs``), if asked
    error: str | None = None  # set with finish_reason "error": why this request failed
    error_kind: str | None = None  # with ``error``: "timeout" (HTTP 408) or "shed" (429) from the admission queue, else None
    # ``n`` > 1: which completion this output is about. ``finished`` is then the request's (all n
    # completions done); a completion is done once its ``finish_reason`` is set.
    index: int = 0


@dataclass
class _TextState:
    detok: Detokenizer
    num_tokens_reported: int = 0
    text_reported: int = 0  # chars of ``text`` already returned
    text: str = ""
    stop_hit: bool = False
    hold_back: int = 0  # chars withheld while they could still become a stop string


class OutputProcessor:
    """Incremental detokenization and stop strings; stop-string hits are finished via ``finish``."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Seq[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._text: dict[str, _TextState] = {}

    def add(self, seq: Sequence) -> None:
        sp = seq.sampling
        hold = max((len(s) for s in sp.stop), default=1) - 1
        detok = self.tokenizer.detokenizer(seq.prompt_token_ids, skip_special_tokens=sp.skip_special_tokens)
        self._text[seq.seq_id] = _TextState(detok, hold_back=hold)

    def _stopped_by_token(self, seq: Sequence, state: _TextState) -> bool:
        """Whether ``seq``'s last token ended it (an eos or a stop token id), not a stop string or a limit."""
        if seq.finish_reason != "stop" or state.stop_hit or seq.num_output_tokens == 0:
            return False
        token, sp = seq.token_ids[-1], seq.sampling
        return token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids)

    def discard(self, request_id: str) -> None:
        self._text.pop(request_id, None)

    def process(self, seq: Sequence, now: float, finish: Callable[[Sequence, str], None]) -> RequestOutput:
        """The output for ``seq``'s tokens since its previous output (forgets finished requests)."""
        state = self._text[seq.seq_id]
        sp = seq.sampling
        new_ids = seq.token_ids[seq.num_prompt_tokens + state.num_tokens_reported :]
        # As vLLM: the token that stopped the request is not text (an eos stays out even when special tokens are kept).
        drop_last = bool(new_ids) and not sp.include_stop_str_in_output and self._stopped_by_token(seq, state)
        for tok in new_ids[:-1] if drop_last else new_ids:
            state.detok.push(tok)
        if seq.is_finished:
            state.detok.flush()
        text = state.detok.text
        if sp.stop and not state.stop_hit:
            # Only the tail can contain a new match: the previous text was already checked.
            from_pos = max(0, len(state.text) - max(len(s) for s in sp.stop) + 1)
            hit: tuple[int, str] | None = None
            for s in sp.stop:
                idx = text.find(s, from_pos)
                if idx != -1 and (hit is None or idx < hit[0]):
                    hit = (idx, s)
            if hit is not None:
                idx, s = hit
                text = text[: idx + len(s)] if sp.include_stop_str_in_output else text[:idx]
                state.stop_hit = True
                if not seq.is_finished:
                    seq.finish_time = now
                    finish(seq, "stop")
        state.text = text
        finished = seq.is_finished
        visible = len(text) if (finished or state.stop_hit) else max(state.text_reported, len(text) - state.hold_back)
        new_text = text[state.text_reported : visible]
        state.text_reported = visible
        state.num_tokens_reported += len(new_ids)
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=text[:visible],
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            metrics=RequestMetrics.of(seq),
            logprobs=list(seq.logprobs) if sp.logprobs else None,
            top_logprobs=list(seq.top_logprobs) if sp.top_logprobs else None,
            prompt_logprobs=seq.prompt_logprobs,
            error=seq.error,
            index=seq.index,
        )
        if finished:
            self._text.pop(seq.seq_id, None)
        return out

    def failed(self, seq: Sequence, now: float, kind: str | None = None) -> RequestOutput:
        """The last output of a request that failed (``seq.error``): the text already sent, nothing new."""
        state = self._text.pop(seq.seq_id, None)
        text = state.text[: state.text_reported] if state is not None else ""
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=text,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            metrics=RequestMetrics.of(seq, finish_time=now),
            error=seq.error,
            error_kind=kind,
            index=seq.index,
        )
