"""Incremental detokenization: a stream of generated token ids in, text deltas out, never a partial
UTF-8 character.

Fast (Rust-backed) tokenizers use the tokenizers library's own ``DecodeStream``; slow (pure Python)
tokenizers, which have no Rust decoder for it to drive, use ``WindowDetokenizer``: vLLM's
prefix_offset/read_offset technique over ``decode``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distserve.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

NUM_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, so its first token keeps a leading space
REPLACEMENT_CHAR = "\ufffd"
# What DecodeStream raises when a tokenizer's decoding of a longer prefix is not an extension of the
# shorter one (vLLM issue 17448): the stream is restarted from the token that broke it.
_INVALID_PREFIX = "Invalid prefix encountered"


class Detokenizer(ABC):
    """Turns generated token ids into text deltas; ``skip_special_tokens`` drops special tokens' text."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skipped = tokenizer.skipped_token_ids if skip_special_tokens else frozenset()
        self._token_ids: list[int] = []
        self._text = ""
        self._context = self._prompt_context(prompt_token_ids)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last few (kept) tokens, or none if they end inside a character."""
        context = [t for t in prompt_token_ids if t not in self._skipped][-NUM_CONTEXT_TOKENS:]
        if REPLACEMENT_CHAR in self._decode(context):
            return []
        return context

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became stable (possibly "")."""
        self._token_ids.append(token_id)
        delta = self._push(token_id)
        self._text += delta
        return delta

    def flush(self) -> str:
        """End of stream: emit any held-back text (e.g. an incomplete UTF-8 sequence as '\\ufffd')."""
        delta = self._flush()
        self._text += delta
        return delta

    @abstractmethod
    def _push(self, token_id: int) -> str: ...

    @abstractmethod
    def _flush(self) -> str: ...

    @property
    def text(self) -> str:
        """All stable text emitted so far."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids pushed so far (prompt ids excluded)."""
        return list(self._token_ids)


class DecodeStreamDetokenizer(Detokenizer):
    """``tokenizers.decoders.DecodeStream`` primed with the prompt's last tokens.

    ``DecodeStream`` returns None while a character is incomplete; the tokens since its last chunk
    are kept so that ``flush`` can emit their text (as '\\ufffd') at the end.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        super().__init__(tokenizer, prompt_token_ids, skip_special_tokens)
        from tokenizers.decoders import DecodeStream

        self._new_stream = lambda ids: DecodeStream(ids, skip_special_tokens=skip_special_tokens)
        self._backend = tokenizer.hf.backend_tokenizer
        self._stream = self._new_stream(self._context)
        self._pending: list[int] = []  # tokens stepped since the last chunk

    def _push(self, token_id: int) -> str:
        try:
            return self._step(token_id)
        except Exception as exc:  # noqa: BLE001 - only the documented invalid-prefix failure is recovered
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            logger.warning("detokenizer: %s; restarting the decode stream", exc)
            held, self._pending = self._pending, []
            self._stream = self._new_stream([])
            return "".join(self._step(t) for t in [*held, token_id])

    def _step(self, token_id: int) -> str:
        chunk = self._stream.step(self._backend, token_id)
        if chunk is None:
            self._pending.append(token_id)
            return ""
        self._pending = []
        return chunk

    def _flush(self) -> str:
        if not self._pending:
            return ""
        # Decoding the held tokens after the context shows what they stand for, '\ufffd' for a partial character.
        with_context = self._decode(self._context + self._token_ids)
        full = with_context[len(self._decode(self._context)):]
        self._pending = []
        self._stream = self._new_stream(self._token_ids[-NUM_CONTEXT_TOKENS:])
        return full[len(self._text):] if full.startswith(self._text) else ""


class WindowDetokenizer(Detokenizer):
    """For slow tokenizers: each step decodes only a short window (vLLM's prefix_offset/read_offset).

    The text of ``window[prefix_offset:read_offset]`` was already emitted, so the delta is what
    decoding ``window[prefix_offset:]`` adds beyond it. Decoding from ``prefix_offset`` rather than
    ``read_offset`` keeps SentencePiece leading spaces, which are stripped from a decode's first token.
    Skipped special tokens are kept out of the window because ``decode`` would drop them anyway.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        super().__init__(tokenizer, prompt_token_ids, skip_special_tokens)
        self._window: list[int] = list(self._context)
        self._prefix_offset = 0
        self._read_offset = len(self._window)

    def _push(self, token_id: int) -> str:
        if token_id in self._skipped:
            return ""
        self._window.append(token_id)
        prefix_text = self._decode(self._window[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._window[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return new_text[len(prefix_text) :]

    def _flush(self) -> str:
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._window[self._prefix_offset :])
        self._advance()
        return new_text[len(prefix_text) :]

    def _advance(self) -> None:
        self._window = self._window[self._read_offset :]
        self._prefix_offset = 0
        self._read_offset = len(self._window)


def make_detokenizer(tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> Detokenizer:
    """``DecodeStreamDetokenizer`` for a fast tokenizer, ``WindowDetokenizer`` for a slow one."""
    if getattr(tokenizer.hf, "is_fast", False) and getattr(tokenizer.hf, "backend_tokenizer", None) is not None:
        return DecodeStreamDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return WindowDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
