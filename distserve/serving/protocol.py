"""OpenAI-compatible request bodies (pydantic v2), their conversion to ``SamplingParams``, and the error body
(``APIError``). The response bodies are ``serving.responses``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from distserve.config import MAX_LOGPROBS, SamplingParams, StructuredOutput
from distserve.errors import InvalidSamplingParamsError
from distserve.serving.structured_request import structured_output_of, tool_call_output



class APIError(Exception):
    """An error answered with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``
    and, if given, response ``headers`` (``Retry-After``, ``WWW-Authenticate``)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)).model_dump()


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ---- requests --------------------------------------------------------------------------------
class _Request(BaseModel):
    # Undeclared fields are kept for ``request_fields.check_request_fields``: refused if unsupported, else logged once.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model: str | None = None
    temperature: float | None = None  # None: 1.0, as in OpenAI
    top_p: float | None = None
    top_k: int | None = None  # extension: 0 or -1 disables
    n: int = 1  # completions: the prompt is prefilled once and its KV forked n ways
    best_of: int | None = None  # vLLM's: only best_of = n (no ranking of extra candidates)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    min_tokens: int | None = None  # extension
    ignore_eos: bool = False  # extension
    include_stop_str_in_output: bool = False  # extension
    priority: int = 0  # extension: lower runs first (vLLM's convention), within a tenant
    timeout: float | None = None  # extension: seconds it may wait in the admission queue before a 408
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM's): 1 is off
    min_p: float | None = None  # extension (vLLM's)
    logit_bias: dict[str, Any] | None = None  # token id (a string) -> bias; checked by SamplingParams, naming logit_bias
    prompt_logprobs: int | None = None  # extension (vLLM's): logprobs of the prompt tokens, with this many alternatives
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # vLLM's: only the prompt's last k tokens are used
    skip_special_tokens: bool = True  # vLLM's: false keeps special tokens' text in the output
    request_id: str | None = None  # vLLM's: the request's id when it has no X-Request-Id header
    # Structured output (``serving.structured_request``): OpenAI's, and vLLM's extensions; checked by hand
    # so a malformed one is a 400 naming the field.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _check_supported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of must equal n ({self.n}): returning the best of more candidates is not supported, got {self.best_of}", "best_of")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def _sampling(
        self, max_tokens: int, max_tokens_param: str, logprobs: bool, top_logprobs: int = 0,
        prompt_logprobs: int | None = None, param_names: dict[str, str] | None = None,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        """``prompt_logprobs``: what the response needs of the prompt (default: the request's own field);
        ``param_names``: the request's name of a ``SamplingParams`` field that it names differently."""
        self._check_supported()
        stop: tuple[str, ...] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        names = {"max_tokens": max_tokens_param, **(param_names or {})}
        try:
            structured = structured or structured_output_of(self.__dict__)
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                seed=self.seed,
                stop=stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                min_tokens=self.min_tokens or 0,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                n=self.n,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                min_p=self.min_p or 0.0,
                logit_bias=self.logit_bias or (),  # type: ignore[arg-type]  # checked there
                top_logprobs=top_logprobs,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                structured=structured,
            )
        except InvalidSamplingParamsError as exc:
            param = names.get(exc.param, exc.param) if exc.param is not None else None
            raise bad_request(str(exc), param) from exc


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (e.g. BOS) before a text prompt

    def prompt_input(self) -> str | list[int]:
        """The single prompt (text or token ids); batches of prompts are refused."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("prompt is empty", "prompt")
        if isinstance(p[0], int):
            return [int(t) for t in p]  # type: ignore[arg-type]
        if len(p) != 1:
            raise bad_request(f"only one prompt per request is supported, got {len(p)}", "prompt")
        first = p[0]
        return first if isinstance(first, str) else [int(t) for t in first]  # type: ignore[union-attr]

    def to_sampling_params(self, max_model_len: int, num_prompt_tokens: int | None = None) -> SamplingParams:
        """``num_prompt_tokens`` is needed only when ``max_tokens`` is null (the rest of the context)."""
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.max_tokens is not None:
            max_tokens = self.max_tokens
        else:
            max_tokens = max(1, max_model_len - (num_prompt_tokens or 0))
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens come with their logprobs
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._sampling(max_tokens, "max_tokens", self.logprobs is not None, self.logprobs or 0, prompt_logprobs,
                              {"top_logprobs": "logprobs"})


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it: a call's ``arguments`` parsed (templates write them with ``tojson``)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        if self.tool_calls:
            if self.role != "assistant":
                raise bad_request("only assistant messages carry tool_calls", f"messages[{index}].tool_calls")
            calls = []
            for j, call in enumerate(self.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError as exc:
                    raise bad_request(f"tool call arguments must be JSON text: {exc}", f"messages[{index}].tool_calls[{j}].function.arguments") from exc
                calls.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}})
            msg["tool_calls"] = calls
        if self.role == "tool":
            if self.tool_call_id is None:
                raise bad_request("a tool message needs the tool_call_id it answers", f"messages[{index}].tool_call_id")
            msg["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            msg["name"] = self.name
        return msg

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts: list[str] = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"only text content parts are supported, got type {part.type!r}", f"messages[{index}].content[{j}]"
                )
            texts.append(part.text)
        return "\n".join(texts)


class ChatInput(_Request):
    """A chat as the chat template renders it: what chat completions and ``/tokenize`` share."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # extension
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is left open for the model to continue
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens on top of the chat template's
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables of the chat template (enable_thinking, ...)
    tools: list[ChatTool] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """``tools`` as chat templates read them (OpenAI's shape), or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ChatCompletionRequest(_SamplingRequest, ChatInput):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call is returned

    def tool_mode(self, auto_tool_choice: bool) -> Literal["none", "auto", "forced"]:
        """Whether the output is parsed for tool calls (``auto``), is the call(s) (``forced``: "required" or a
        named function, decoded under the calls' JSON schema) or neither (``none``); 400 for what is not supported.

        ``auto_tool_choice``: the server runs with ``--enable-auto-tool-choice`` and a ``--tool-call-parser``
        (vLLM's rule: without them "auto" is refused rather than returning calls as text)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
            return "none"
        if choice == "none":
            return "none"
        if isinstance(choice, NamedToolChoice) or choice == "required":
            if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
                raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools", "tool_choice")
            return "forced"
        if not auto_tool_choice:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice")
        return "auto"

    @property
    def forced_function(self) -> str | None:
        """The function ``tool_choice`` names, or None."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def to_sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """Without a token limit the answer may fill the rest of the context, as in vLLM."""
        if self.max_completion_tokens is not None:
            max_tokens, param = self.max_completion_tokens, "max_completion_tokens"
        elif self.max_tokens is not None:
            max_tokens, param = self.max_tokens, "max_tokens"
        else:
            max_tokens, param = max(1, max_model_len - num_prompt_tokens), "max_tokens"
        structured = None
        if self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)):
            try:
                if structured_output_of(self.__dict__) is not None:
                    raise bad_request('tool_choice "required" or a named function already constrains the output; '
                                      "it takes no response_format or guided decoding", "tool_choice")
                structured = tool_call_output(self.tool_dicts() or [], self.forced_function, self.parallel_tool_calls)
            except InvalidSamplingParamsError as exc:
                raise bad_request(str(exc), exc.param) from exc
        return self._sampling(max_tokens, param, self.logprobs, self.top_logprobs or 0, structured=structured)
