"""The one registry of request fields this server does not support, and what happens to fields nobody defines.

A field that vLLM's or OpenAI's ``/v1/completions`` or ``/v1/chat/completions`` schema defines and this
server does not implement is refused when it asks for anything (400 naming it in ``param``), never
silently ignored: a value equal to the field's default (``null``, ``false``, ``[]``, ...) asks for
nothing and is accepted. A field nobody defines (a typo, a custom key) is accepted and logged once per
name, as vLLM logs them. Implementing a field means declaring it on the request model
(``serving.protocol``) and deleting its entry here.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from distserve.serving.protocol import bad_request

logger = logging.getLogger(__name__)

MAX_LOGGED_FIELD_NAMES = 1024  # unknown names remembered (so each is logged once) before logging stops


@dataclass(frozen=True)
class Unsupported:
    """Why a field is refused, and the values that ask for nothing (always including null)."""

    why: str
    defaults: tuple[Any, ...] = ()


_NO_MULTIMODAL = "this server serves text only"
_NO_STORAGE = "this server stores no completions"

UNSUPPORTED: dict[str, Unsupported] = {
    # OpenAI's
    "suffix": Unsupported("text after the insertion point (fill-in-the-middle) is not supported", ("",)),
    "audio": Unsupported(f"audio output is not supported: {_NO_MULTIMODAL}"),
    "modalities": Unsupported(f"only the text modality is supported: {_NO_MULTIMODAL}", (["text"],)),
    "prediction": Unsupported("predicted outputs (speculative decoding from a given text) are not supported"),
    "web_search_options": Unsupported("web search is not supported"),
    "store": Unsupported(_NO_STORAGE, (False,)),
    "metadata": Unsupported(f"metadata tags stored completions; {_NO_STORAGE}", ({},)),
    "service_tier": Unsupported("there is one service tier (use the API key's tenant tier or `priority`)", ("auto", "default")),
    "reasoning_effort": Unsupported("the served model has no reasoning-effort setting"),
    "verbosity": Unsupported("the served model has no verbosity setting", ("medium",)),
    "functions": Unsupported("the deprecated `functions` are not supported; use `tools`", ([],)),
    "function_call": Unsupported("the deprecated `function_call` is not supported; use `tool_choice`"),
    # vLLM's
    "prompt_embeds": Unsupported("prompts as embeddings are not supported; send text or token ids"),
    "use_beam_search": Unsupported("beam search is not supported", (False,)),
    "length_penalty": Unsupported("length_penalty applies to beam search, which is not supported", (1.0,)),
    "allowed_token_ids": Unsupported("restricting the output to given token ids is not supported", ([],)),
    "bad_words": Unsupported("bad_words is not supported", ([],)),
    "spaces_between_special_tokens": Unsupported(
        "special tokens' text is kept as the tokenizer decodes it (true is the only setting)", (True,)),
    "include_reasoning": Unsupported("this server has no reasoning parser: reasoning stays in the content", (True,)),
    "documents": Unsupported("documents for retrieval-augmented chat templates are not supported", ([],)),
    "chat_template": Unsupported("a per-request chat template is not accepted; the server's is set with --chat-template"),
    "mm_processor_kwargs": Unsupported(f"multimodal processor arguments are not supported: {_NO_MULTIMODAL}", ({},)),
    "return_tokens_as_token_ids": Unsupported("tokens are returned as text only", (False,)),
    "logits_processors": Unsupported("custom logits processors are not supported", ([],)),
    "kv_transfer_params": Unsupported("KV transfer is planned by the server (its placement), not per request", ({},)),
    "vllm_xargs": Unsupported("extension arguments (vllm_xargs) are not supported", ({},)),
    "cache_salt": Unsupported("prefix-cache salting is not supported"),
    "stream_options.continuous_usage_stats": Unsupported("usage is sent in the last chunk only (include_usage)", (False,)),
}

_logged: set[str] = set()
_logged_lock = threading.Lock()


def is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    """``value`` is null or equals one of ``defaults`` with the same JSON type (``1`` is not ``true``)."""
    if value is None:
        return True
    for default in defaults:
        if isinstance(default, bool) or isinstance(value, bool):
            if isinstance(default, bool) and isinstance(value, bool) and value == default:
                return True
        elif isinstance(default, (int, float)):
            if isinstance(value, (int, float)) and value == default:
                return True
        elif type(value) is type(default) and value == default:
            return True
    return False


def check_request_fields(body: BaseModel, prefix: str = "") -> None:
    """Refuse ``body``'s unsupported fields that ask for something (400 naming the field); log the
    fields nobody defines, once per name. Declared sub-objects (``stream_options``) are checked too."""
    for name, value in (body.model_extra or {}).items():
        param = f"{prefix}{name}"
        entry = UNSUPPORTED.get(param)
        if entry is None:
            _log_unknown(param)
        elif not is_default(value, entry.defaults):
            raise bad_request(f"{param} is not supported: {entry.why}", param)
    for name in type(body).model_fields:
        value = getattr(body, name)
        if isinstance(value, BaseModel):
            check_request_fields(value, f"{prefix}{name}.")


def _log_unknown(param: str) -> None:
    with _logged_lock:
        if param in _logged or len(_logged) >= MAX_LOGGED_FIELD_NAMES:
            return
        _logged.add(param)
    logger.warning("request field %r is not defined by this server's API and was ignored (logged once per field name)",
                   param[:100])
