"""Tokenizer wrapper over HF tokenizers: encode/decode, chat templates, and the incremental detokenizer of an output
(``distserve.engine.detokenizer``)."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from distserve.engine.detokenizer import Detokenizer, make_detokenizer
from distserve.errors import InvalidConfigError, ModelNotFoundError, PromptTooLongError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Turn terminators that chat models emit instead of (or besides) their nominal eos token.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_chat_template(value: str) -> str:
    """A chat template given as a file or as the template itself (vLLM's ``--chat-template``): a value that
    names no readable file is the template if it has Jinja's ``{``/``}`` or a newline (escapes such as
    ``\\n`` decoded, as vLLM does), else an error. The template must compile (Jinja syntax)."""
    import codecs

    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise InvalidConfigError(f"{value!r} looks like a file path but cannot be read: {exc.strerror or exc}",
                                     "chat_template") from None
        template = codecs.decode(value, "unicode_escape")
    except UnicodeDecodeError as exc:
        raise InvalidConfigError(f"{value!r} is not UTF-8 text: {exc}", "chat_template") from None
    try:  # the environment transformers renders chat templates in
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidConfigError(f"the chat template is not valid Jinja (line {exc.lineno}): {exc.message}", "chat_template") from None
    return template


class Tokenizer:
    """Thin wrapper over an HF tokenizer with the few operations the engine needs."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        self.hf = hf_tokenizer
        self._extra_eos_token_ids: tuple[int, ...] = ()
        self._skipped_ids: frozenset[int] | None = None
        self._eos_token_ids: tuple[int, ...] | None = None
        self._reserved_kwargs: frozenset[str] | None = None
        self._max_token_chars: int | None = None

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

    @property
    def max_token_chars(self) -> int:
        """Characters of the vocabulary's longest token (its raw string: at least what it decodes to)."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1)
        return self._max_token_chars

    def check_text_fits(self, text: str, num_tokens: int, param: str = "prompt") -> None:
        """Refuse, without tokenizing it, text that cannot fit ``num_tokens`` tokens: more characters than
        ``num_tokens`` of the longest token (tokenizing ~1M characters takes seconds of a core)."""
        max_chars = num_tokens * self.max_token_chars
        if len(text) > max_chars:
            raise PromptTooLongError(f"{param} has {len(text)} characters, more than {num_tokens} tokens of at most "
                                     f"{self.max_token_chars} characters each: it cannot fit the context of {num_tokens} tokens", param)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def supports_tools(self, chat_template: str | None = None) -> bool:
        """Whether the chat template (``chat_template``, else the tokenizer's) renders ``tools`` (it
        mentions them), as tool calling needs."""
        template = chat_template if chat_template is not None else getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):  # named templates: the "tool_use" one, or any that reads tools
            return any("tools" in t for t in template.values())
        return bool(template) and "tools" in template

    def chat_template_reserved_kwargs(self) -> frozenset[str]:
        """Names a request's ``chat_template_kwargs`` may not use: ``apply_chat_template``'s own parameters."""
        if self._reserved_kwargs is None:
            params = inspect.signature(self.hf.apply_chat_template).parameters
            names = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
            self._reserved_kwargs = frozenset(names | {"messages", "self"})
        return self._reserved_kwargs

    def chat_prompt_text(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
        *, chat_template: str | None = None, continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` (and the ``tools`` the model may call) with ``chat_template`` (default: the
        tokenizer's); ``template_kwargs`` are extra variables the template reads (e.g. ``enable_thinking``)."""
        if chat_template is None and not getattr(self.hf, "chat_template", None):
            raise InvalidConfigError(
                "this model's tokenizer has no chat template; use a plain completion prompt instead (or serve --chat-template)"
            )
        text = self.hf.apply_chat_template(
            messages, tools=tools, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {}),
        )
        if not isinstance(text, str):
            raise InvalidConfigError(f"chat template rendered {type(text).__name__}, expected str")
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
        *, chat_template: str | None = None, continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False, max_tokens: int | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template supplies any bos/special tokens itself
        (``add_special_tokens`` adds the tokenizer's on top, as vLLM's request field does). A rendered chat
        that cannot fit ``max_tokens`` is refused before it is tokenized (``check_text_fits``, naming ``messages``)."""
        text = self.chat_prompt_text(messages, add_generation_prompt, tools, chat_template=chat_template,
                                     continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        if max_tokens is not None:
            self.check_text_fits(text, max_tokens, "messages")
        return self.encode(text, add_special_tokens=add_special_tokens)

    def detokenizer(self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> Detokenizer:
        """An incremental detokenizer of one output (``DecodeStream`` for fast tokenizers)."""
        return make_detokenizer(self, prompt_token_ids, skip_special_tokens)
