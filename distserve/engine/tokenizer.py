"""Tokenizer wrapper over HF tokenizers: encode/decode, chat templates, incremental detokenization."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from distserve.errors import InvalidConfigError, ModelNotFoundError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Turn terminators that chat models emit instead of (or besides) their nominal eos token.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Thin wrapper over an HF tokenizer with the few operations the engine needs."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        self.hf = hf_tokenizer
        self._extra_eos_token_ids: tuple[int, ...] = ()
        self._skipped_ids: frozenset[int] | None = None
        self._eos_token_ids: tuple[int, ...] | None = None

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Load from a folder with ``tokenizer.json``/``tokenizer_config.json`` (and optionally
        ``generation_config.json``, whose eos ids are added to ``eos_token_ids``)."""
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ModelNotFoundError(f"tokenizer folder {path!r} does not exist")
        if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
            raise ModelNotFoundError(f"folder {path!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises OSError/ValueError/KeyError/... for bad folders
            raise ModelNotFoundError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
        tokenizer = cls(hf_tokenizer)
        generation_config = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_config):
            try:
                with open(generation_config, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                eos = None
            if isinstance(eos, int):
                tokenizer._extra_eos_token_ids = (eos,)
            elif isinstance(eos, list):
                tokenizer._extra_eos_token_ids = tuple(int(e) for e in eos)
        return tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's eos id, generation-config eos ids, and known end-of-turn special tokens."""
        if self._eos_token_ids is not None:
            return self._eos_token_ids
        ids: list[int] = []
        if self.hf.eos_token_id is not None:
            ids.append(int(self.hf.eos_token_id))
        ids.extend(self._extra_eos_token_ids)
        vocab = self.hf.get_vocab()
        skipped = self.skipped_token_ids
        for token in _END_OF_TURN_TOKENS:
            token_id = vocab.get(token)
            if token_id is not None and token_id in skipped:
                ids.append(token_id)
        self._eos_token_ids = tuple(dict.fromkeys(ids))
        return self._eos_token_ids

    @property
    def skipped_token_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops (special added tokens)."""
        if self._skipped_ids is None:
            ids = {int(i) for i in self.hf.all_special_ids}
            ids.update(int(i) for i, tok in self.hf.added_tokens_decoder.items() if tok.special)
            self._skipped_ids = frozenset(ids)
        return self._skipped_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (it mentions them), as tool calling needs."""
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):  # named templates: the "tool_use" one, or any that reads tools
            return any("tools" in t for t in template.values())
        return bool(template) and "tools" in template

    def chat_prompt_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
        """Render ``messages`` (and the ``tools`` the model may call) with the tokenizer's chat template."""
        if not getattr(self.hf, "chat_template", None):
            raise InvalidConfigError(
                "this model's tokenizer has no chat template; use a plain completion prompt instead"
            )
        text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
        if not isinstance(text, str):
            raise InvalidConfigError(f"chat template rendered {type(text).__name__}, expected str")
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat; the template supplies any bos/special tokens itself."""
        return self.encode(self.chat_prompt_text(messages, add_generation_prompt, tools), add_special_tokens=False)

    def detokenizer(self, prompt_token_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; never emits a partial UTF-8 character.

    Each step decodes only a short window (vLLM's prefix_offset/read_offset technique): the text of
    ``window[prefix_offset:read_offset]`` was already emitted, so the delta is what decoding
    ``window[prefix_offset:]`` adds beyond it. Decoding from ``prefix_offset`` rather than
    ``read_offset`` keeps SentencePiece leading spaces, which are stripped from a decode's first token.
    Special tokens are kept out of the window because ``decode`` skips them anyway.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skipped = tokenizer.skipped_token_ids
        context = [t for t in prompt_token_ids if t not in self._skipped][-_NUM_CONTEXT_TOKENS:]
        if _REPLACEMENT_CHAR in tokenizer.decode(context):
            context = []
        self._window: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._token_ids: list[int] = []
        self._text = ""

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became stable (possibly "")."""
        self._token_ids.append(token_id)
        if token_id in self._skipped:
            return ""
        self._window.append(token_id)
        prefix_text = self._tokenizer.decode(self._window[self._prefix_offset : self._read_offset])
        new_text = self._tokenizer.decode(self._window[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._advance()
        self._text += delta
        return delta

    def flush(self) -> str:
        """End of stream: emit any held-back text (e.g. an incomplete UTF-8 sequence as '\\ufffd')."""
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._tokenizer.decode(self._window[self._prefix_offset : self._read_offset])
        new_text = self._tokenizer.decode(self._window[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._advance()
        self._text += delta
        return delta

    def _advance(self) -> None:
        self._window = self._window[self._read_offset :]
        self._prefix_offset = 0
        self._read_offset = len(self._window)

    @property
    def text(self) -> str:
        """All stable text emitted so far."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids pushed so far (prompt ids excluded)."""
        return list(self._token_ids)
