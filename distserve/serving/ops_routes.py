"""vLLM's operational routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` and ``GET|POST /ping``.

``/tokenize`` takes a completion's ``prompt`` or a chat's ``messages`` and answers the token ids a
completion with the same fields would be prefilled with (``serving.prompts``: the same chat template,
``add_special_tokens`` and ``add_generation_prompt``), their ``count`` and the server's ``max_model_len``.
``/detokenize`` turns ids back into text (ids outside the vocabulary: 400 naming ``tokens``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from distserve.runtime.client import EngineClient
from distserve.serving.prompts import chat_prompt, text_prompt
from distserve.serving.protocol import APIError, ChatInput, _Request, bad_request
from distserve.serving.request_fields import check_request_fields


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str | list[int]
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatInput):
    model: str | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _parse(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:  # answered like a body that failed FastAPI's own validation
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab_size}), got {bad[:5]}", param=param)


def version() -> str:
    """The installed distserve's version (package metadata)."""
    try:
        return importlib.metadata.version("distserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_ops_routes(
    app: FastAPI, client: EngineClient, check_model: Callable[[str | None], None], chat_template: str | None, model_name: str,
    health: Callable[[], Awaitable[Response]],
) -> None:
    """Add the routes to ``app``; ``check_model`` refuses a ``model`` the server does not serve, ``health``
    is ``/health``'s handler (``/ping`` answers the same)."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        try:
            data = await request.json()
        except ValueError as exc:
            raise bad_request(f"invalid JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request("the body must be a JSON object with `prompt` or `messages`")
        body = _parse(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
        check_request_fields(body)
        check_model(body.model)
        tokenizer = client.tokenizer
        if isinstance(body, TokenizeCompletionRequest) and not isinstance(body.prompt, str):
            check_token_ids(body.prompt, tokenizer.vocab_size, "prompt")  # converting them to strings would fail (500)

        def tokens() -> list[int]:  # in a thread: a long prompt takes seconds
            if isinstance(body, TokenizeChatRequest):
                return chat_prompt(tokenizer, body, chat_template, model_name, client.max_model_len)
            prompt = text_prompt(tokenizer, body.prompt, body.add_special_tokens, None, client.max_model_len)
            return tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

        ids = await asyncio.to_thread(tokens)
        strs = tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=client.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_request_fields(body)
        check_model(body.model)
        check_token_ids(body.tokens, client.tokenizer.vocab_size, "tokens")
        text = await asyncio.to_thread(client.tokenizer.decode, body.tokens, skip_special_tokens=False)  # as vLLM's
        return DetokenizeResponse(prompt=text)

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}

    @app.get("/ping", operation_id="ping_get")  # one id per method: the OpenAPI schema (fuzzed) has no duplicates
    @app.post("/ping", operation_id="ping_post")
    async def ping() -> Response:
        """SageMaker's health route, as vLLM serves it: the same answer as ``/health``."""
        return await health()
