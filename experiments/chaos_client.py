"""The chaos suite's clients and ledger (``chaos.py``): streamed chat, completion and dataflow requests,
each recorded with how it ended and checked against its greedy reference.

How a request ends (``Record.outcome``):
- ``identical``: it completed with exactly the reference text;
- ``error``: it ended with a clear error (an HTTP error status with a message, an SSE error event, or
  the connection refused before the request was sent);
- ``differs``: it completed with other text than the reference (a silently wrong answer);
- ``dropped``: its stream ended with neither ``[DONE]`` nor an error (e.g. the connection was cut);
- ``hung``: it had not ended by its deadline;
- ``disconnected``: the client itself left mid-stream (the disconnect storm).
``differs`` and ``dropped`` are what the report counts as **lost**.

Transport: one ``aiohttp.ClientSession`` (``session()``). Under the overload row's burst (140 requests/s, most of
them refused at once) the load generator shares the server's 2 cores; aiohttp costs ~0.4 ms of CPU per
request where httpx cost ~0.9 (measured with the same requests against a bare uvicorn app).

References: chat and completion prompts are tokenized by the server (``/tokenize``, exactly what it
prefills) and generated greedily by the colocated ``LLMEngine`` in this process; a dataflow program's
reference is its own fault-free run on the server before any fault (the server renders its prompts).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from distserve.measure.workload import WORDS

KINDS = ("chat", "completion", "dataflow")
LOST = ("differs", "dropped")
SUMMARY_TEMPLATE = "Document: {{doc}}\nSummary: {{summary}}"
TITLE_TEMPLATE = "Summary: {{s}}\nA short title: {{title}}"


@dataclass(frozen=True)
class Job:
    """One request to send: ``key`` names its reference (the same prompt and kind share one)."""

    kind: str
    prompt: str
    max_tokens: int

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.max_tokens}:{self.prompt}"


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the ledger's start."""

    scenario: str
    index: int
    kind: str
    outcome: str = "pending"
    status: int | None = None
    error: str | None = None
    retry_after: str | None = None
    text: str = ""
    sent_s: float = 0.0
    first_s: float | None = None
    end_s: float | None = None
    num_chunks: int = 0
    done: bool = False  # its stream ended with [DONE]


@dataclass
class Ledger:
    """Every request of the run."""

    t0: float = field(default_factory=time.perf_counter)
    records: list[Record] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, scenario: str, kind: str) -> Record:
        rec = Record(scenario, len(self.records), kind, sent_s=self.now())
        self.records.append(rec)
        return rec

    def counts(self, scenario: str) -> Counter[str]:
        return Counter(r.outcome for r in self.records if r.scenario == scenario)

    def dump(self) -> list[dict[str, Any]]:
        """Every record; the text only where it is not the reference's (an identical one is the reference)."""
        return [{**asdict(r), "text": None if r.outcome == "identical" else r.text} for r in self.records]


def make_jobs(num: int, max_tokens: int, seed: int, num_prompts: int = 12, words: tuple[int, int] = (6, 24)) -> list[Job]:
    """``num`` jobs cycling chat, completion, chat, completion, ..., with a dataflow program every tenth,
    over ``num_prompts`` distinct prompts (so references are few)."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(num_prompts)]
    jobs = []
    for i in range(num):
        kind = "dataflow" if i % 10 == 9 else KINDS[i % 2]
        jobs.append(Job(kind, prompts[i % num_prompts], max_tokens))
    return jobs


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body)
        inner = err.get("error", err)
        message = inner.get("message", inner) if isinstance(inner, dict) else inner
    except (ValueError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {message}"


def request_body(model: str, job: Job, stream: bool = True) -> tuple[str, dict[str, Any]]:
    """(path, body) of a chat or completion job: greedy, exactly ``max_tokens`` tokens."""
    body: dict[str, Any] = {"model": model, "temperature": 0.0, "min_tokens": job.max_tokens, "stream": stream}
    if job.kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": job.prompt}], "max_completion_tokens": job.max_tokens}
    return "/v1/completions", {**body, "prompt": job.prompt, "max_tokens": job.max_tokens}


def session() -> aiohttp.ClientSession:
    """The client every request goes through: no bound on connections (a wave, a burst or the storm all in
    flight), idle connections given up after 2 s (before the server's 5 s keep-alive closes them, so a request
    never goes out on a connection the server is closing), 30 s to connect; each request's deadline is
    ``run_job``'s."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0))


async def _sse(resp: aiohttp.ClientResponse, rec: Record) -> AsyncIterator[dict[str, Any]]:
    """``resp``'s SSE events, parsed, up to ``[DONE]`` (``rec.done``); an error status is recorded in ``rec`` instead."""
    rec.status = resp.status
    if resp.status != 200:
        rec.retry_after = resp.headers.get("Retry-After")
        rec.error = _error_text(resp.status, await resp.read())
        return
    async for raw in resp.content:
        line = raw.decode("utf-8")
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                rec.done = True
                return
            yield json.loads(data)


async def _stream_openai(client: aiohttp.ClientSession, root: str, model: str, job: Job, rec: Record, ledger: Ledger,
                         leave_after_first: bool) -> bool | None:
    """Stream a chat or completion job into ``rec``: True if it finished with ``[DONE]``, None if the client left."""
    path, body = request_body(model, job)
    async with client.post(root + path, json=body) as resp:
        async for chunk in _sse(resp, rec):
            if chunk.get("error"):
                err = chunk["error"]
                rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                return False
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") if job.kind == "completion" else (choice.get("delta") or {}).get("content")
                if piece:
                    rec.text += piece
                    rec.num_chunks += 1
                    if rec.first_s is None:
                        rec.first_s = ledger.now()
            if leave_after_first and rec.num_chunks:
                resp.close()  # drops the connection mid-stream
                return None
    return rec.done


async def _post(client: aiohttp.ClientSession, url: str, payload: dict[str, Any], method: str = "POST") -> dict[str, Any]:
    async with client.request(method, url, json=payload) as resp:
        body = await resp.read()
        if resp.status >= 400:
            raise _HTTPError(resp.status, _error_text(resp.status, body), resp.headers.get("Retry-After"))
        return dict(json.loads(body))


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, retry_after: str | None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


async def _run_dataflow(client: aiohttp.ClientSession, root: str, job: Job, rec: Record, ledger: Ledger) -> bool:
    """Two dependent semantic calls (summarise the prompt, then title the summary), the title streamed."""
    session = await _post(client, root + "/v1/session", {})
    auth = {"session_id": session["session_id"], "session_auth": session["session_auth"]}
    try:
        doc = (await _post(client, root + "/v1/semantic_var", {**auth, "var_name": "doc"}))["var_id"]

        async def call(template: str, inp: str, inp_var: str, out: str) -> str:
            placeholders = [{"name": inp, "is_output": False, "var_id": inp_var},
                            {"name": out, "is_output": True, "sampling_config": {"max_gen_length": job.max_tokens, "temperature": 0}}]
            info = (await _post(client, root + "/v1/semantic_call", {**auth, "template": template, "placeholders": placeholders}))["param_info"]
            return str(next(p["var_id"] for p in info if p["is_output"]))

        summary = await call(SUMMARY_TEMPLATE, "doc", doc, "summary")
        title = await call(TITLE_TEMPLATE, "s", summary, "title")
        await _post(client, root + f"/v1/semantic_var/{doc}", {**auth, "content": job.prompt})
        async with client.get(root + f"/v1/semantic_var/{title}/stream", json={**auth, "criteria": "latency"}) as resp:
            async for event in _sse(resp, rec):
                if "error" in event:
                    rec.error = f"stream error ({event.get('status')}): {event['error']}"
                    return False
                if event.get("delta"):
                    rec.num_chunks += 1
                    if rec.first_s is None:
                        rec.first_s = ledger.now()
                if "content" in event:
                    rec.text = event["content"]
        return rec.done
    finally:
        try:
            async with client.delete(root + f"/v1/session/{auth['session_id']}", json=auth) as resp:
                await resp.read()
        except (aiohttp.ClientError, OSError):
            pass


async def run_job(client: aiohttp.ClientSession, root: str, model: str, job: Job, expected: str | None, rec: Record,
                  ledger: Ledger, deadline_s: float, leave_after_first: bool = False) -> Record:
    """Send ``job`` and classify how it ended (``expected``: its reference text, None for no check)."""
    try:
        async with asyncio.timeout(deadline_s):
            if job.kind == "dataflow":
                done: bool | None = await _run_dataflow(client, root, job, rec, ledger)
            else:
                done = await _stream_openai(client, root, model, job, rec, ledger, leave_after_first)
    except TimeoutError:
        rec.outcome = "hung"
        rec.error = f"no end after {deadline_s:g} s"
    except _HTTPError as exc:
        rec.outcome, rec.status, rec.error, rec.retry_after = "error", exc.status, str(exc), exc.retry_after
    except aiohttp.ClientConnectorError as exc:  # the server refused the connection: the request never started
        rec.outcome = "error"
        rec.error = f"connection refused: {exc}"
    except (aiohttp.ClientError, OSError) as exc:
        rec.outcome = "dropped"
        rec.error = f"{type(exc).__name__}: {exc}"
    else:
        if done is None:
            rec.outcome = "disconnected"
        elif rec.error is not None:
            rec.outcome = "error"
        elif not done:
            rec.outcome = "dropped"
            rec.error = "the stream ended without [DONE] or an error"
        else:
            rec.outcome = "identical" if expected is None or rec.text == expected else "differs"
    rec.end_s = ledger.now()
    return rec


async def tokenize(client: aiohttp.ClientSession, root: str, model: str, job: Job) -> list[int]:
    """The prompt token ids the server prefills for ``job`` (a chat or completion job)."""
    body: dict[str, Any] = {"model": model}
    if job.kind == "chat":
        body["messages"] = [{"role": "user", "content": job.prompt}]
    else:
        body["prompt"] = job.prompt
    return list((await _post(client, root + "/tokenize", body))["tokens"])


async def references(client: aiohttp.ClientSession, root: str, model: str, dtype: str, jobs: list[Job], ledger: Ledger) -> dict[str, str]:
    """Reference text per job key: the colocated engine's greedy output (chat, completion), or a fault-free run (dataflow)."""
    from distserve.config import SamplingParams
    from distserve.engine.llm_engine import LLMEngine
    from distserve.engine.weights import load_model

    unique = list({job.key: job for job in jobs}.values())
    refs: dict[str, str] = {}
    openai_jobs = [j for j in unique if j.kind != "dataflow"]
    if openai_jobs:
        ids = [await tokenize(client, root, model, j) for j in openai_jobs]
        engine = LLMEngine(load_model(model, dtype))  # the same weights as the server: it loads them the same way
        params = [SamplingParams(max_tokens=j.max_tokens, min_tokens=j.max_tokens, temperature=0.0) for j in openai_jobs]
        for job, out in zip(openai_jobs, engine.generate(ids, params)):
            refs[job.key] = out.text
    for job in (j for j in unique if j.kind == "dataflow"):
        rec = await run_job(client, root, model, job, None, ledger.add("reference run", job.kind), ledger, 300.0)
        if rec.outcome != "identical":
            raise RuntimeError(f"the fault-free dataflow run failed: {rec.error}")
        refs[job.key] = rec.text
    return refs
