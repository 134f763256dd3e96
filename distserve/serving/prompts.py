"""A request's prompt as the engine gets it: a completion's text or token ids, or a chat rendered by the
chat template, with vLLM's ``add_special_tokens``, ``truncate_prompt_tokens`` and ``chat_template_kwargs``.

Shared by ``/v1/completions``, ``/v1/chat/completions`` and ``/tokenize``, so that ``/tokenize`` counts
exactly the tokens a completion with the same fields would be prefilled with.
"""

from __future__ import annotations

from distserve.engine.tokenizer import Tokenizer
from distserve.errors import PromptTooLongError
from distserve.serving.protocol import APIError, ChatInput, bad_request


def truncate(ids: list[int], num_tokens: int | None, max_model_len: int) -> list[int]:
    """The last ``num_tokens`` of ``ids`` (vLLM's ``truncate_prompt_tokens``; None: all of them)."""
    if num_tokens is None:
        return ids
    if num_tokens > max_model_len:
        raise bad_request(f"truncate_prompt_tokens is {num_tokens} but the context holds {max_model_len} tokens",
                          "truncate_prompt_tokens")
    return ids[-num_tokens:]


def text_prompt(tokenizer: Tokenizer, prompt: str | list[int], add_special_tokens: bool,
                truncate_prompt_tokens: int | None, max_model_len: int) -> str | list[int]:
    """A completion's prompt: text is left for the engine to encode as it always does (with special
    tokens, untruncated), otherwise it is encoded here (text that cannot fit ``max_model_len`` tokens is refused
    first, naming ``prompt``). Blocking: call it in a thread."""
    if isinstance(prompt, str):
        try:
            tokenizer.check_text_fits(prompt, max_model_len)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from exc
        if add_special_tokens and truncate_prompt_tokens is None:
            return prompt
    ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens) if isinstance(prompt, str) else prompt
    return truncate(ids, truncate_prompt_tokens, max_model_len)


def chat_prompt(tokenizer: Tokenizer, body: ChatInput, chat_template: str | None, model_name: str, max_model_len: int) -> list[int]:
    """Token ids of ``body``'s chat rendered by ``chat_template`` (the server's ``--chat-template``; None:
    the tokenizer's), before any truncation; 400 naming the field at fault (a rendered chat that cannot fit
    ``max_model_len`` tokens, ``context_length_exceeded``, before it is tokenized). Blocking: call it in a thread."""
    messages = body.chat_messages()
    tools = body.tool_dicts()
    if tools is not None and not tokenizer.supports_tools(chat_template):
        raise APIError(400, f"the chat template of model `{model_name}` does not support tools", param="tools")
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true "
                          "(set add_generation_prompt to false to continue the last message)", "continue_final_message")
    kwargs = body.chat_template_kwargs or {}
    reserved = sorted(set(kwargs) & tokenizer.chat_template_reserved_kwargs())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}: it is a request field or the server's",
                          f"chat_template_kwargs.{reserved[0]}")
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tools=tools, chat_template=chat_template,
            continue_final_message=body.continue_final_message, template_kwargs=kwargs, add_special_tokens=body.add_special_tokens,
            max_tokens=max_model_len,
        )
    except PromptTooLongError as exc:
        raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from exc
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages' fault
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
