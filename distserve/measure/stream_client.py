"""One streamed completion over HTTP, timed on the client side, and the tokenizer calibration probes.

It works against any base URL that serves ``POST {base_url}/completions`` (endpoint type
``completions``) or ``POST {base_url}/chat/completions`` (``chat``: the prompt is one user message)
with ``"stream": true`` (ours, vLLM, SGLang, ...). A request starts when the client sends it; output
arrives with each chunk carrying non-empty text (``choices[].text``, or ``choices[].delta.content``
for chat), and every such chunk's arrival time is kept (``RequestResult.chunk_times_s``): the gaps
between consecutive ones are the inter-token latencies (ITL, vLLM's definition: one gap per streamed
chunk after the first, so a chunk carrying several tokens is one gap). The number of output tokens
is taken from the final usage chunk (``stream_options.include_usage``) when the server sends one,
else the number of text chunks. The latencies these timestamps define are ``distserve.slo``'s.

``ignore_eos`` and ``min_tokens`` (vLLM-style extensions that fix the output length) are only sent
when asked for, since other servers may reject unknown fields.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from distserve.measure.workload import WORDS, Workload
from distserve.slo import TimedRequest

ENDPOINT_PATHS = {"completions": "/completions", "chat": "/chat/completions"}  # endpoint type -> path under the base URL


@dataclass
class RequestResult(TimedRequest):
    """One request as the client saw it; times are seconds from the start of the run."""

    index: int
    arrival_s: float
    input_len: int
    sent_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    num_prompt_tokens: int | None = None  # from the server's usage chunk
    num_output_tokens: int = 0
    error: str | None = None
    cancelled: bool = False  # ended (or never sent) because the run stopped early; ``error`` says so
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of every chunk carrying output

    @property
    def itls_s(self) -> list[float]:
        """Inter-token latencies: the gap before every output chunk after the first."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def start_s(self) -> float | None:
        return self.sent_s

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_s is not None


def _error_message(status: int, body: bytes) -> str:
    try:
        err = json.loads(body)
        message = err["error"]["message"] if isinstance(err.get("error"), dict) else (err.get("error") or err.get("detail") or err.get("message"))
    except (ValueError, AttributeError, KeyError, TypeError):
        message = body[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {message}"


def endpoint_url(base_url: str, endpoint_type: str) -> str:
    if endpoint_type not in ENDPOINT_PATHS:
        raise ValueError(f"endpoint type must be one of {sorted(ENDPOINT_PATHS)}, got {endpoint_type!r}")
    return base_url.rstrip("/") + ENDPOINT_PATHS[endpoint_type]


def completion_body(model: str, prompt: str, workload: Workload, max_tokens: int, stream: bool,
                    endpoint_type: str = "completions") -> dict[str, Any]:
    """The request body (``/completions``, or ``/chat/completions`` with the prompt as one user
    message, as vLLM's benchmark sends it); the extensions only when the workload asks for them."""
    body: dict[str, Any] = {"model": model, "temperature": workload.temperature}
    if endpoint_type == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if workload.min_tokens:
        body["min_tokens"] = max_tokens
    return body


async def _probe_prompt_tokens(client: httpx.AsyncClient, url: str, model: str, prompt: str, headers: dict[str, str],
                               endpoint_type: str) -> int | None:
    body = completion_body(model, prompt, Workload(1, 1.0, 1, 1), 1, stream=False, endpoint_type=endpoint_type)
    resp = await client.post(url, json=body, headers=headers)
    if resp.status_code != 200:
        raise RuntimeError(f"calibration request failed: {_error_message(resp.status_code, resp.content)}")
    usage = resp.json().get("usage") or {}
    tokens = usage.get("prompt_tokens")
    return int(tokens) if tokens else None


async def calibrate_tokens_per_word(client: httpx.AsyncClient, url: str, model: str, headers: dict[str, str],
                                    endpoint_type: str = "completions") -> tuple[float, float]:
    """(mean tokens per word, fixed overhead tokens such as BOS or the chat template) of the server's
    tokenizer on ``WORDS``, probed on the endpoint the run uses.

    The probes are the whole word list once and twice, so the difference is exactly the mean over
    the list that prompts sample from, with no sampling noise.
    """
    once = " ".join(WORDS)
    t1 = await _probe_prompt_tokens(client, url, model, once, headers, endpoint_type)
    t2 = await _probe_prompt_tokens(client, url, model, f"{once} {once}", headers, endpoint_type)
    if t1 is None or t2 is None or t2 <= t1:
        return 1.0, 0.0  # no usage reported: assume one token per word
    per_word = (t2 - t1) / len(WORDS)
    return per_word, max(0.0, 2.0 * t1 - t2)


def _describe(exc: BaseException) -> str:
    """``Type: message``, plus the root cause when the exception wraps one (httpx's ``ConnectError:
    All connection attempts failed`` hides whether the port refused, the address was unavailable...)."""
    text = f"{type(exc).__name__}: {exc}"
    cause, seen = exc.__cause__ or exc.__context__, 0
    while cause is not None and seen < 8:
        if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
            cause = cause.exceptions[0]
        root, cause, seen = cause, cause.__cause__ or cause.__context__, seen + 1
    if seen and str(root) and str(root) not in text:
        text += f" ({type(root).__name__}: {root})"
    return text


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    result: RequestResult,
    t0: float,
    request_timeout_s: float,
) -> None:
    """Send one streamed request and fill ``result`` (times from ``t0``); failures go to ``result.error``."""
    num_text_chunks = 0
    usage_tokens: int | None = None
    done = False
    result.sent_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(request_timeout_s):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    result.error = _error_message(resp.status_code, await resp.aread())
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter() - t0
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        err = chunk["error"]
                        result.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                        return
                    if any(choice.get("text") or (choice.get("delta") or {}).get("content") for choice in chunk.get("choices") or []):
                        if result.first_token_s is None:
                            result.first_token_s = now
                        result.last_token_s = now
                        result.chunk_times_s.append(now)
                        num_text_chunks += 1
                    usage = chunk.get("usage")
                    if usage:
                        usage_tokens = usage.get("completion_tokens")
                        result.num_prompt_tokens = usage.get("prompt_tokens")
        if not done:
            result.error = "stream ended without [DONE]"
        elif result.first_token_s is None:
            result.error = "no text in the response"
    except TimeoutError:
        result.error = f"timed out after {request_timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001 - one bad request is counted, never ends the run
        result.error = _describe(exc)
    finally:
        result.finish_s = time.perf_counter() - t0
        result.num_output_tokens = usage_tokens if usage_tokens is not None else num_text_chunks
