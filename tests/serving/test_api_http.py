"""The OpenAI-compatible API over real sockets: parity with the engine, errors, disconnects, concurrency, metrics."""

from __future__ import annotations

import asyncio
import json
import pathlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from serving_util import metric_samples, wait_until
import uvicorn
from openai.types import Completion
from openai.types.chat import ChatCompletionMessageParam

from distserve.cli import main as cli_main
from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.dtypes import resolve_dtype
from distserve.engine.frontend import EngineBase
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import LoadedModel, load_model
from distserve.serving.api import build_fastapi_app
from distserve.serving.metrics import ServingMetrics
from distserve.serving.request_log import RequestLog, read_request_log
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.threaded_client import ThreadedEngineClient

pytestmark = pytest.mark.timeout(120)

PROMPT = "Hello, my name is"
QUESTION = "What is the capital of France?"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
CACHE = CacheConfig(num_blocks=2048, block_size=16)
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}


class LiveServer:
    """The app on uvicorn in a background thread, on a free loopback port."""

    def __init__(self, client: ThreadedEngineClient, served_model_name: str = "tiny", metrics: ServingMetrics | None = None) -> None:
        self.client = client
        self.app = build_fastapi_app(client, served_model_name, metrics=metrics)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.client.close()
        self.sock.close()


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny", resolve_dtype("auto"))  # what `LLMEngine("tiny")` and `distserve generate` use


@pytest.fixture(scope="module")
def reference_engine(tiny: LoadedModel) -> LLMEngine:
    return LLMEngine(tiny, cache_config=CACHE)


def make_engine(kind: str, tiny: LoadedModel) -> EngineBase:
    if kind == "disagg":
        return LocalDisaggEngine(tiny, cache_config=CACHE)
    return LLMEngine(tiny, cache_config=CACHE)


def slow_down(engine: EngineBase, step_s: float = 0.01) -> EngineBase:
    """Make every step take at least ``step_s`` so a long request is still running when the test acts."""
    real = engine.step

    def step() -> list[RequestOutput]:
        time.sleep(step_s)
        return real()

    engine.step = step  # type: ignore[method-assign]
    return engine


@pytest.fixture(scope="module", params=["disagg", "colocated"])
def live(request: pytest.FixtureRequest, tiny: LoadedModel) -> Iterator[LiveServer]:
    server = LiveServer(ThreadedEngineClient(make_engine(request.param, tiny)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def disagg(tiny: LoadedModel) -> Iterator[LiveServer]:
    server = LiveServer(ThreadedEngineClient(make_engine("disagg", tiny)), served_model_name="smollm2-135m")
    yield server
    server.stop()


def test_completion_matches_engine(live: LiveServer, reference_engine: LLMEngine) -> None:
    ref = reference_engine.generate([PROMPT], GREEDY)[0]
    oai = live.openai()
    resp = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.id.startswith("cmpl-")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)

    chunks: list[Completion] = list(
        oai.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason

    ids = oai.completions.create(model="tiny", prompt=ref.prompt_token_ids, max_tokens=MAX_TOKENS, temperature=0)
    assert ids.choices[0].text == ref.text


def test_chat_matches_engine(live: LiveServer, reference_engine: LLMEngine) -> None:
    prompt = reference_engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    ref = reference_engine.generate([prompt], GREEDY)[0]
    oai = live.openai()
    resp = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.usage is not None and resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(ref.token_ids)

    stream = oai.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.usage is None for c in chunks)


def test_text_matches_distserve_generate(disagg: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "--model", "tiny", "--chat", "--prompt", QUESTION, "--max-tokens", "10", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    resp = disagg.openai().chat.completions.create(
        model="HuggingFaceTB/SmolLM2-135M-Instruct", messages=CHAT, max_tokens=10, temperature=0
    )
    assert resp.choices[0].message.content == expected["text"]
    assert resp.usage is not None and resp.usage.completion_tokens == expected["num_output_tokens"]


def test_models_and_health(disagg: LiveServer) -> None:
    models = disagg.openai().models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    health = httpx.get(f"{disagg.url}/health")
    assert health.status_code == 200


def test_logprobs(disagg: LiveServer, reference_engine: LLMEngine) -> None:
    ref = reference_engine.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, logprobs=True))[0]
    resp = disagg.openai().completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and ref.logprobs is not None
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-3)
    assert len(lp.tokens or []) == 5


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
        ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("completions", {"prompt": "hi", "n": 500}, 400, "n"),
        ("completions", {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 65}, 400, "n"),
        ("completions", {"prompt": "x" * 3000}, 400, "prompt"),
        ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
        ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ("completions", {"temperature": 0}, 400, "prompt"),
        ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x" * 3000}]}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]"),
        ("chat/completions", {"messages": []}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(disagg: LiveServer, path: str, body: dict[str, object], status: int, param: str) -> None:
    resp = httpx.post(f"{disagg.url}/v1/{path}", json={"model": "smollm2-135m", **body})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"] and "type" in error and "code" in error


def test_bad_json_and_openai_client_errors(disagg: LiveServer) -> None:
    resp = httpx.post(
        f"{disagg.url}/v1/completions", content=b'{"prompt": "hi",', headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        disagg.openai().completions.create(model="smollm2-135m", prompt="hi", temperature=-1)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        disagg.openai().completions.create(model="gpt-4", prompt="hi")


def test_queue_full_is_429(tiny: LoadedModel) -> None:
    server = LiveServer(ThreadedEngineClient(slow_down(make_engine("disagg", tiny)), max_queued_requests=1))
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "a", "stream": True, **LONG}) as first:
            lines = first.iter_lines()  # keep a reference: a discarded line iterator closes the connection
            assert next(lines).startswith("data:")
            with pytest.raises(openai.RateLimitError) as exc:
                server.openai().completions.create(model="tiny", prompt="b", max_tokens=4)
            assert exc.value.status_code == 429
            raw = httpx.post(f"{server.url}/v1/completions", json={"prompt": "b"})
            assert raw.status_code == 429 and raw.json()["error"]["type"] == "rate_limit_error"
        assert wait_until(lambda: server.client.num_outstanding == 0)
        # the overload gate may still hold the in-flight refusal for its Retry-After (0.1 s): a client
        # that honours Retry-After (the openai client's retries do) gets through
        retrying = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=3)
        ok = retrying.completions.create(model="tiny", prompt="b", max_tokens=4)
        assert ok.usage is not None and ok.usage.completion_tokens >= 1
    finally:
        server.stop()


def _spy_aborts(engine: EngineBase) -> list[str]:
    aborted: list[str] = []
    real = engine.abort_request

    def abort_request(request_id: str) -> None:
        aborted.append(request_id)
        real(request_id)

    engine.abort_request = abort_request  # type: ignore[method-assign]
    return aborted


def _all_freed(engine: LocalDisaggEngine, client: ThreadedEngineClient) -> bool:
    instances = [*engine.prefill, *engine.decode]
    return (
        client.num_outstanding == 0
        and engine.num_requests == 0
        and not engine.has_unfinished_requests()
        and all(inst.core.block_manager.usage == 0.0 and not inst.core.seqs for inst in instances)
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_disconnect_mid_stream_aborts_and_frees_both_sides(tiny: LoadedModel, endpoint: str) -> None:
    engine = LocalDisaggEngine(tiny, cache_config=CACHE)
    slow_down(engine)
    aborted = _spy_aborts(engine)
    server = LiveServer(ThreadedEngineClient(engine))
    try:
        body = {"prompt": "tell me a long story"} if endpoint == "completions" else {"messages": CHAT}
        with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json={"stream": True, **body, **LONG}) as resp:
            lines = resp.iter_lines()
            got = [line for line, _ in zip(lines, range(12)) if line.startswith("data:")]
            assert len(got) >= 5
            assert any(inst.core.block_manager.usage > 0 for inst in engine.decode)  # decoding when we leave
        assert wait_until(lambda: _all_freed(engine, server.client)), engine.stats()
        assert len(aborted) == 1
        samples = metric_samples(server.url)
        assert samples[("distserve:request_success_total", (("finished_reason", "abort"),))] == 1
        assert samples[("distserve:request_success_total", (("finished_reason", "length"),))] == 0
    finally:
        server.stop()


def test_disconnect_during_non_streaming_request_aborts(tiny: LoadedModel) -> None:
    engine = LocalDisaggEngine(tiny, cache_config=CACHE)
    slow_down(engine)
    aborted = _spy_aborts(engine)
    server = LiveServer(ThreadedEngineClient(engine))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json={"prompt": "long", **LONG}, timeout=0.5)
        assert wait_until(lambda: _all_freed(engine, server.client))
        assert len(aborted) == 1
    finally:
        server.stop()


def test_64_concurrent_streams(disagg: LiveServer, reference_engine: LLMEngine) -> None:
    prompts = [f"Request {i}: the quick brown fox number {i * 7} jumps" for i in range(64)]
    refs = reference_engine.generate(prompts, GREEDY)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, int]:
        stream = await client.completions.create(
            model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def run_all() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=f"{disagg.url}/v1", api_key="x", max_retries=0, timeout=60)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [r[0] for r in results] == [r.text for r in refs]
    assert [r[1] for r in results] == [len(r.token_ids) for r in refs]


def test_metrics_histograms_and_gauges(disagg: LiveServer) -> None:
    def count(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
        return samples.get((name, ()), 0.0)

    before = metric_samples(disagg.url)
    disagg.openai().completions.create(model="smollm2-135m", prompt="metrics please", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    after = metric_samples(disagg.url)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert count(after, f"distserve:{name}_count") == count(before, f"distserve:{name}_count") + 1, name
    itl = "distserve:inter_token_latency_seconds_count"
    assert count(after, itl) == count(before, itl) + 5
    assert count(after, "distserve:generation_tokens_total") == count(before, "distserve:generation_tokens_total") + 6
    assert count(after, "distserve:prompt_tokens_total") > count(before, "distserve:prompt_tokens_total")
    for phase, instance in (("prefill", "prefill-0"), ("decode", "decode-0")):
        labels = (("engine", instance), ("phase", phase))
        assert ("distserve:num_requests_waiting", labels) in after
        assert ("distserve:num_requests_running", labels) in after
        assert 0.0 <= after[("distserve:kv_cache_usage_perc", labels)] <= 1.0
    mig = (("engine", "all"), ("phase", "decode"))
    assert after[("distserve:kv_migration_bytes_total", mig)] > before.get(("distserve:kv_migration_bytes_total", mig), 0.0)
    assert ("distserve:kv_migration_blocks_skipped_total", mig) in after
    assert after[("distserve:kv_migration_seconds_count", mig)] >= 1
    assert after[("distserve:instance_restarts_total", ())] == 0.0 and ("distserve:requests_rerun_total", ()) in after


def test_colocated_metrics_labels(live: LiveServer) -> None:
    live.openai().completions.create(model="tiny", prompt="hi", max_tokens=2)
    samples = metric_samples(live.url)
    phases = {dict(labels).get("phase") for name, labels in samples if name == "distserve:num_requests_running"}
    assert phases in ({"colocated"}, {"prefill", "decode"})


BREAKDOWN_HISTOGRAMS = ("queue", "prefill", "decode", "inference")


def test_latency_breakdown_histograms(live: LiveServer) -> None:
    disaggregated = isinstance(live.client.engines[0], LocalDisaggEngine)
    before = metric_samples(live.url)
    live.openai().completions.create(model="tiny", prompt="breakdown please", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = metric_samples(live.url)

    def grew(name: str) -> float:
        key = (f"distserve:request_{name}_time_seconds_count", ())
        assert key in after, name  # every series exists, migration ones on a colocated server too (at 0)
        return after[key] - before.get(key, 0.0)

    assert [grew(n) for n in BREAKDOWN_HISTOGRAMS] == [1.0] * len(BREAKDOWN_HISTOGRAMS)
    assert grew("migration") == grew("migration_queue") == (1.0 if disaggregated else 0.0)
    assert after[("distserve:request_inference_time_seconds_sum", ())] > before.get(("distserve:request_inference_time_seconds_sum", ()), 0.0)


def test_request_log_writes_one_line_per_finished_request(tiny: LoadedModel, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    server = LiveServer(ThreadedEngineClient(make_engine("disagg", tiny)), metrics=ServingMetrics(request_log=log))
    try:
        client = server.openai()
        for n in (3, 6):
            client.completions.create(model="tiny", prompt="log me", max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    finally:
        server.stop()
        log.close()
    records = read_request_log(str(path))
    assert [r["num_output_tokens"] for r in records] == [3, 6]
    for r in records:
        assert r["tenant"] == "anonymous" and r["finish_reason"] == "length" and r["num_prompt_tokens"] > 0
        stamps = [r[k] for k in ("arrival_time", "dispatch_time", "prefill_start_time", "first_token_time",
                                 "migration_start_time", "migration_end_time", "finish_time")]
        assert stamps == sorted(stamps)
        assert abs(sum(v for v in r["breakdown"].values()) - r["e2e_s"]) <= 1e-3
