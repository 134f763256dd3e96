"""Five LLM applications, each written twice over one server: as a dataflow program and request by request.

* ``ChainSummary``: a document's chunks summarised in sequence, each call refining the previous summary.
* ``MapReduceSummary``: every chunk summarised in parallel (map), then one call summarises the summaries
  (reduce): the maps form a task group.
* ``MultiAgentCoding``: an architect writes a design, several coders write their parts in parallel, a
  reviewer reviews them all; each prompt extends the architect's (a shared, growing context).
* ``Copilot``: one long shared system prompt, many users' short queries at once.
* ``Mixed``: chat requests at a steady rate through the OpenAI API while map-reduce jobs run
  (through dataflow, read for throughput, or request by request); its figure is the chat latency.
* ``Concurrent``: several apps at once (Parrot's multi-agent figure: latency vs number of apps).

A dataflow program submits its DAG in two rounds of concurrent requests whatever its depth
(``DataflowClient.submit_dag``), then reads its final variables; a request-centric one waits for
one round trip per level of its DAG. ``dataflow(df, rc)`` and ``request_centric(rc)`` run the app once and return an ``AppResult``: the
final outputs (the same prompts both ways, so greedy outputs agree), the app's latency (from its
first request to its last output, sessions opened before and closed after), and app-specific extras.
Texts are pseudo-English drawn from ``seed``: a different seed gives prompts that share no prefix
with another run's (except what the app shares on purpose), so runs do not reuse each other's KV.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from apps.clients import DataflowClient, OutputOf, RequestClient, template_function
from distserve.dataflow.frontend import SemanticFunction, Variable

LATENCY, THROUGHPUT = "latency", "throughput"
_VOCAB = (
    "the system model data request server memory cache batch token prefix engine queue latency decode prefill "
    "user agent plan code review test design module function value result error report chunk document summary "
    "fast slow large small first last new old shared local remote simple complex stable early late main core "
    "reads writes sends keeps moves builds checks runs splits joins waits grows frees holds finds starts ends "
    "with from into over under after before while because then also only each every both many few more less "
    "team project task goal step part page line word number list table field record file folder network link"
).split()
SUMMARIZE = "Write a one-sentence summary of the following text.\n{{chunk}}\nSummary:{{summary}}"


def words(rng: random.Random, num: int) -> str:
    """``num`` pseudo-English words, as sentences."""
    out, sentence = [], []
    for _ in range(num):
        sentence.append(rng.choice(_VOCAB))
        if len(sentence) >= rng.randint(8, 14):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


@dataclass
class AppResult:
    outputs: list[str]
    latency_s: float
    extra: dict[str, Any] = field(default_factory=dict)


class App(Protocol):
    name: str
    seed: int

    async def dataflow(self, df: DataflowClient, rc: RequestClient) -> AppResult: ...

    async def request_centric(self, rc: RequestClient) -> AppResult: ...


@dataclass(frozen=True)
class ChainSummary:
    num_chunks: int = 4
    chunk_words: int = 150
    summary_tokens: int = 24
    seed: int = 0
    name: str = "chain"

    def _setup(self) -> tuple[list[str], SemanticFunction, SemanticFunction]:
        rng = random.Random(self.seed)
        chunks = [words(rng, self.chunk_words) for _ in range(self.num_chunks)]
        first = template_function("summarize", SUMMARIZE, "summary", self.summary_tokens)
        refine = template_function("refine", "Here is a summary of a document so far:\n{{previous}}\nRefine it with the next "
                                   "part of the document below.\n{{chunk}}\nRefined summary:{{summary}}", "summary", self.summary_tokens)
        return chunks, first, refine

    async def dataflow(self, df: DataflowClient, rc: RequestClient) -> AppResult:
        chunks, first, refine = self._setup()
        s = await df.session()
        try:
            t0 = time.monotonic()
            calls = [(first, {"chunk": chunks[0]})] + [(refine, {"previous": OutputOf(i - 1), "chunk": c}) for i, c in enumerate(chunks[1:], 1)]
            final = await df.get((await df.submit_dag(s, LATENCY, calls))[-1], LATENCY)
            return AppResult([final], time.monotonic() - t0)
        finally:
            await df.close(s)

    async def request_centric(self, rc: RequestClient) -> AppResult:
        chunks, first, refine = self._setup()
        t0 = time.monotonic()
        text = await rc.complete(first, chunk=chunks[0])
        for chunk in chunks[1:]:
            text = await rc.complete(refine, previous=text, chunk=chunk)
        return AppResult([text], time.monotonic() - t0)


@dataclass(frozen=True)
class MapReduceSummary:
    num_chunks: int = 4
    chunk_words: int = 150
    map_tokens: int = 24
    reduce_tokens: int = 32
    seed: int = 0
    name: str = "map_reduce"

    def _setup(self) -> tuple[list[str], SemanticFunction, SemanticFunction]:
        rng = random.Random(self.seed)
        chunks = [words(rng, self.chunk_words) for _ in range(self.num_chunks)]
        mapper = template_function("summarize", SUMMARIZE, "summary", self.map_tokens)
        parts = "".join(f"Part {i + 1}:\n{{{{s{i}}}}}\n" for i in range(self.num_chunks))
        reducer = template_function("reduce", f"Here are summaries of the parts of a document.\n{parts}Write a one-sentence "
                                    "summary of the whole document.\nSummary:{{summary}}", "summary", self.reduce_tokens)
        return chunks, mapper, reducer

    async def submit(self, df: DataflowClient, s: Any, perf: str) -> Variable:
        """Submit the maps and the reduce (``submit_dag``); the reduce's output variable."""
        chunks, mapper, reducer = self._setup()
        calls = [(mapper, {"chunk": c}) for c in chunks] + [(reducer, {f"s{i}": OutputOf(i) for i in range(len(chunks))})]
        return (await df.submit_dag(s, perf, calls))[-1]

    async def run_requests(self, rc: RequestClient) -> str:
        chunks, mapper, reducer = self._setup()
        summaries = await asyncio.gather(*(rc.complete(mapper, chunk=c) for c in chunks))
        return await rc.complete(reducer, **{f"s{i}": v for i, v in enumerate(summaries)})

    async def dataflow(self, df: DataflowClient, rc: RequestClient) -> AppResult:
        s = await df.session()
        try:
            t0 = time.monotonic()
            final = await df.get(await self.submit(df, s, LATENCY), LATENCY)
            return AppResult([final], time.monotonic() - t0)
        finally:
            await df.close(s)

    async def request_centric(self, rc: RequestClient) -> AppResult:
        t0 = time.monotonic()
        final = await self.run_requests(rc)
        return AppResult([final], time.monotonic() - t0)


@dataclass(frozen=True)
class MultiAgentCoding:
    num_coders: int = 3
    task_words: int = 120
    design_tokens: int = 32
    code_tokens: int = 32
    review_tokens: int = 24
    seed: int = 0
    name: str = "multi_agent"

    def _setup(self) -> tuple[str, SemanticFunction, list[SemanticFunction], SemanticFunction]:
        rng = random.Random(self.seed)
        task = words(rng, self.task_words)
        context = (f"You are part of a software team of an architect, {self.num_coders} coders and a reviewer.\nTask:\n{{{{task}}}}\n"
                   f"The architect splits the work into {self.num_coders} parts.\nDesign:")
        architect = template_function("architect", context + "{{design}}", "design", self.design_tokens)
        coders = [template_function(f"coder{i}", context + f"{{{{design}}}}\nYou are coder {i + 1}. Write the code of part {i + 1}."
                                    "\nCode:{{code}}", "code", self.code_tokens) for i in range(self.num_coders)]
        codes = "".join(f"Code of part {i + 1}:\n{{{{code{i}}}}}\n" for i in range(self.num_coders))
        reviewer = template_function("reviewer", context + "{{design}}\n" + codes + "You are the reviewer. Review the code above."
                                     "\nReview:{{review}}", "review", self.review_tokens)
        return task, architect, coders, reviewer

    async def dataflow(self, df: DataflowClient, rc: RequestClient) -> AppResult:
        task, architect, coders, reviewer = self._setup()
        s = await df.session()
        try:
            t0 = time.monotonic()
            calls = [(architect, {"task": task})] + [(c, {"task": task, "design": OutputOf(0)}) for c in coders]
            calls.append((reviewer, {"task": task, "design": OutputOf(0), **{f"code{i}": OutputOf(i + 1) for i in range(len(coders))}}))
            final = await df.get((await df.submit_dag(s, LATENCY, calls))[-1], LATENCY)
            return AppResult([final], time.monotonic() - t0)
        finally:
            await df.close(s)

    async def request_centric(self, rc: RequestClient) -> AppResult:
        task, architect, coders, reviewer = self._setup()
        t0 = time.monotonic()
        design = await rc.complete(architect, task=task)
        codes = await asyncio.gather(*(rc.complete(c, task=task, design=design) for c in coders))
        review = await rc.complete(reviewer, task=task, design=design, **{f"code{i}": v for i, v in enumerate(codes)})
        return AppResult([review], time.monotonic() - t0)


@dataclass(frozen=True)
class Copilot:
    num_users: int = 6
    system_words: int = 450
    query_words: int = 12
    answer_tokens: int = 16
    seed: int = 0
    name: str = "copilot"

    def _setup(self) -> tuple[list[str], SemanticFunction]:
        rng = random.Random(self.seed)
        system = f"You are the coding copilot of workspace {self.seed}. Follow these rules.\n{words(rng, self.system_words)}\n"
        queries = [words(rng, self.query_words) for _ in range(self.num_users)]
        return queries, template_function("assist", system + "User:\n{{query}}\nAssistant:{{answer}}", "answer", self.answer_tokens)

    async def dataflow(self, df: DataflowClient, rc: RequestClient) -> AppResult:
        queries, assist = self._setup()
        sessions = await asyncio.gather(*(df.session() for _ in queries))  # one per user

        async def user(s: Any, query: str) -> tuple[str, float]:
            t = time.monotonic()
            answer = await df.get(await df.call(s, assist, LATENCY, query=query), LATENCY)
            return answer, time.monotonic() - t

        try:
            t0 = time.monotonic()
            done = await asyncio.gather(*(user(s, q) for s, q in zip(sessions, queries)))
            return _per_user(done, time.monotonic() - t0, self.answer_tokens)
        finally:
            await asyncio.gather(*(df.close(s) for s in sessions))

    async def request_centric(self, rc: RequestClient) -> AppResult:
        queries, assist = self._setup()

        async def user(query: str) -> tuple[str, float]:
            t = time.monotonic()
            return await rc.complete(assist, query=query), time.monotonic() - t

        t0 = time.monotonic()
        done = await asyncio.gather(*(user(q) for q in queries))
        return _per_user(done, time.monotonic() - t0, self.answer_tokens)


def _per_user(done: list[tuple[str, float]], latency_s: float, answer_tokens: int) -> AppResult:
    """Per user: its request's latency; per output token: that over the answer's tokens (Parrot's copilot figure)."""
    mean = statistics.fmean(t for _, t in done)
    return AppResult([a for a, _ in done], latency_s, {"mean_user_latency_s": mean, "per_token_latency_s": mean / answer_tokens})


@dataclass(frozen=True)
class Concurrent:
    """``apps`` started together, each its own way; the latency is their mean (``max_app_latency_s``: the slowest)."""

    apps: tuple[App, ...]
    seed: int = 0
    name: str = "concurrent"

    async def dataflow(self, df: DataflowClient, rc: RequestClient) -> AppResult:
        return _together(await asyncio.gather(*(app.dataflow(df, rc) for app in self.apps)))

    async def request_centric(self, rc: RequestClient) -> AppResult:
        return _together(await asyncio.gather(*(app.request_centric(rc) for app in self.apps)))


def _together(results: list[AppResult]) -> AppResult:
    return AppResult([o for r in results for o in r.outputs], statistics.fmean(r.latency_s for r in results),
                     {"max_app_latency_s": max(r.latency_s for r in results)})


@dataclass(frozen=True)
class Mixed:
    num_jobs: int = 2
    job: MapReduceSummary = MapReduceSummary()
    num_chats: int = 8
    chat_rate: float = 1.0  # requests per second, evenly spaced
    chat_words: int = 20
    chat_tokens: int = 16
    seed: int = 0
    name: str = "mixed"

    def _jobs(self) -> list[MapReduceSummary]:
        return [MapReduceSummary(self.job.num_chunks, self.job.chunk_words, self.job.map_tokens, self.job.reduce_tokens,
                                 seed=self.seed * 1000 + j) for j in range(self.num_jobs)]

    async def _chats(self, rc: RequestClient, t0: float) -> list[tuple[str, float]]:
        rng = random.Random(self.seed)
        prompts = [f"User: {words(rng, self.chat_words)}\nAssistant:" for _ in range(self.num_chats)]

        async def chat(i: int, prompt: str) -> tuple[str, float]:
            await asyncio.sleep(max(0.0, t0 + i / self.chat_rate - time.monotonic()))
            t = time.monotonic()
            text = await rc.completion(prompt, max_tokens=self.chat_tokens, temperature=0, ignore_eos=True)
            return text, time.monotonic() - t

        return list(await asyncio.gather(*(chat(i, p) for i, p in enumerate(prompts))))

    async def _timed(self, t0: float, jobs: Any) -> tuple[list[str], float]:
        outputs = await jobs
        return list(outputs), time.monotonic() - t0

    def _result(self, chats: list[tuple[str, float]], jobs: list[str], jobs_s: float) -> AppResult:
        latencies = [t for _, t in chats]
        return AppResult(jobs + [c for c, _ in chats], statistics.median(latencies),
                         {"chat_latency_mean_s": statistics.fmean(latencies), "chat_latency_max_s": max(latencies), "jobs_s": jobs_s})

    async def dataflow(self, df: DataflowClient, rc: RequestClient) -> AppResult:
        jobs = self._jobs()
        sessions = await asyncio.gather(*(df.session() for _ in jobs))

        async def job(app: MapReduceSummary, s: Any) -> str:
            return await df.get(await app.submit(df, s, THROUGHPUT), THROUGHPUT)

        try:
            t0 = time.monotonic()
            chats, (outs, jobs_s) = await asyncio.gather(
                self._chats(rc, t0), self._timed(t0, asyncio.gather(*(job(a, s) for a, s in zip(jobs, sessions)))))
            return self._result(chats, outs, jobs_s)
        finally:
            await asyncio.gather(*(df.close(s) for s in sessions))

    async def request_centric(self, rc: RequestClient) -> AppResult:
        jobs = self._jobs()
        t0 = time.monotonic()
        chats, (outs, jobs_s) = await asyncio.gather(
            self._chats(rc, t0), self._timed(t0, asyncio.gather(*(a.run_requests(rc) for a in jobs))))
        return self._result(chats, outs, jobs_s)


def make_apps(quick: bool, seed: int) -> list[App]:
    """The five apps at the benchmark's size (``quick``: the tiny model's, a few seconds each)."""
    if quick:
        job = MapReduceSummary(num_chunks=3, chunk_words=40, map_tokens=8, reduce_tokens=8, seed=seed)
        return [ChainSummary(3, 40, 8, seed=seed), job, MultiAgentCoding(2, 40, 8, 8, 8, seed=seed),
                Copilot(4, 80, 8, 8, seed=seed), Mixed(2, job, num_chats=4, chat_rate=4.0, chat_words=10, chat_tokens=8, seed=seed)]
    job = MapReduceSummary(seed=seed)
    return [ChainSummary(seed=seed), job, MultiAgentCoding(seed=seed), Copilot(seed=seed), Mixed(job=job, seed=seed)]
