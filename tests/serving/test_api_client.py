"""ThreadedEngineClient and the API's building blocks without sockets: errors, bounds, aborts, crashes, stats, SSE close."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import httpx
import pytest

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import PromptTooLongError, QueueFullError
from distserve.serving.api import build_fastapi_app
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.stats import normalize_stats
from distserve.serving.metrics import ServingMetrics
from distserve.serving.streams import SSEResponse
from distserve.runtime.threaded_client import EngineDeadError, ThreadedEngineClient
from serving_util import drain

pytestmark = pytest.mark.timeout(60)

CACHE = CacheConfig(num_blocks=512, block_size=16)
LONG = SamplingParams(max_tokens=900, ignore_eos=True, temperature=0)
SHORT = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def test_outputs_match_engine_and_validation_errors_surface(tiny: LoadedModel) -> None:
    ref = LLMEngine(tiny, cache_config=CACHE).generate(["abc"], SHORT)[0]
    client = ThreadedEngineClient(LocalDisaggEngine(tiny, cache_config=CACHE))

    async def run() -> None:
        out = await drain(client.generate("abc", SHORT, "r1"))
        assert out.token_ids == ref.token_ids and out.text == ref.text
        bad = client.generate("x" * 3000, SHORT, "r2")
        with pytest.raises(PromptTooLongError):
            await anext(bad)
        assert client.num_outstanding == 0

    try:
        asyncio.run(run())
    finally:
        client.close()


def test_queue_bound_and_close_aborts(tiny: LoadedModel) -> None:
    engine = LocalDisaggEngine(tiny, cache_config=CACHE)
    client = ThreadedEngineClient(engine, max_queued_requests=2)

    async def run() -> None:
        a = client.generate("a", LONG, "a")
        b = client.generate("b", LONG, "b")
        await anext(a)
        await anext(b)
        with pytest.raises(QueueFullError):
            await anext(client.generate("c", SHORT, "c"))
        await a.aclose()
        await b.aclose()
        assert client.num_outstanding == 0
        out = await drain(client.generate("c", SHORT, "c"))
        assert out.finish_reason in ("stop", "length")

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 5
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished_requests()
        assert all(i.core.block_manager.usage == 0.0 for i in engine.prefill + engine.decode)
    finally:
        client.close()


def crash_after(engine: LLMEngine, num_steps: int) -> LLMEngine:
    real_step = engine.step
    calls = {"n": 0}

    def step() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] > num_steps:
            raise RuntimeError("boom")
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    return engine


def test_engine_crash_fails_streams_instead_of_hanging(tiny: LoadedModel) -> None:
    client = ThreadedEngineClient(crash_after(LLMEngine(tiny, cache_config=CACHE), 3))

    async def run() -> None:
        streams = [client.generate(p, LONG, p) for p in ("a", "b", "c")]
        results = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams), return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) and "boom" in str(r) for r in results)
        with pytest.raises(EngineDeadError):
            await anext(client.generate("d", SHORT, "d"))
        with pytest.raises(EngineDeadError):
            await client.stats()

    try:
        asyncio.run(run())
        assert client.is_dead
    finally:
        client.close()


def test_engine_crash_over_http(tiny: LoadedModel) -> None:
    client = ThreadedEngineClient(crash_after(LLMEngine(tiny, cache_config=CACHE), 3))
    app = build_fastapi_app(client, "tiny")

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            body = {"prompt": "x", "stream": True, "max_tokens": 50, "ignore_eos": True}
            resp = await asyncio.wait_for(h.post("/v1/completions", json=body), 10)
            events = [e for e in resp.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert "boom" in json.loads(events[-2][len("data: ") :])["error"]["message"]
            assert (await h.get("/health")).status_code == 503
            resp = await h.post("/v1/completions", json={"prompt": "x"})
            assert resp.status_code == 503 and resp.json()["error"]["message"]
            assert (await h.get("/metrics")).status_code == 200

    try:
        asyncio.run(run())
    finally:
        client.close()


def test_server_exits_1_when_the_engine_dies(tiny: LoadedModel) -> None:
    """A dead engine stops ``run_server`` with status 1 (so a supervisor restarts the process),
    instead of a server that answers 503 forever; a poison request alone does not kill it."""
    from distserve.serving.server import open_listen_socket, run_server

    engine = LLMEngine(tiny, cache_config=CACHE)
    engine.runner.inject_step_fault("poison")
    client = ThreadedEngineClient(engine)
    sock = open_listen_socket("127.0.0.1", 0)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    status: list[int] = []
    ready = threading.Event()
    server = threading.Thread(target=lambda: status.append(run_server(client, "tiny", sock, on_ready=lambda _: ready.set(), log_level="warning")))
    server.start()
    try:
        assert ready.wait(30)
        body = {"prompt": "x", "max_tokens": 4}

        async def poison() -> RequestOutput:
            return await drain(client.generate("x", SHORT, "poison"))

        out = asyncio.run(poison())
        assert out.finish_reason == "error" and out.error  # failed alone: the engine serves on
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        assert status == [] and server.is_alive()
        crash_after(engine, 0)  # now every step fails: the engine is broken, not a request
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 503 and resp.headers["retry-after"]
        server.join(30)
        assert status == [1]
    finally:
        client.close()
        server.join(30)


def test_shutdown_fails_in_flight_and_stops_thread(tiny: LoadedModel) -> None:
    client = ThreadedEngineClient(LLMEngine(tiny, cache_config=CACHE))

    async def run() -> None:
        stream = client.generate("a", LONG, "a")
        await anext(stream)
        await client.shutdown()
        with pytest.raises(EngineDeadError):
            await drain(stream)

    asyncio.run(run())
    assert not client._thread.is_alive()


def test_idle_thread_sleeps(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, cache_config=CACHE)
    real = engine.has_unfinished_requests
    calls = {"n": 0}

    def counting() -> bool:
        calls["n"] += 1
        return real()

    engine.has_unfinished_requests = counting  # type: ignore[method-assign]
    client = ThreadedEngineClient(engine)
    try:
        asyncio.run(drain(client.generate("a", SHORT, "a")))
        time.sleep(0.1)
        before = calls["n"]
        time.sleep(0.5)
        assert calls["n"] - before <= 2  # blocked on the command queue, not spinning
    finally:
        client.close()


def test_stats_shapes(tiny: LoadedModel) -> None:
    disagg = ThreadedEngineClient(LocalDisaggEngine(tiny, num_prefill=2, num_decode=1, cache_config=CACHE))
    colocated = ThreadedEngineClient([LLMEngine(tiny, cache_config=CACHE), LLMEngine(tiny, cache_config=CACHE)])

    async def run() -> None:
        await asyncio.gather(*(drain(disagg.generate(p, SHORT, p)) for p in ("a", "b", "c")))
        stats = await disagg.stats()
        instances = cast(list[dict[str, object]], stats["instances"])
        assert [(i["instance"], i["phase"]) for i in instances] == [
            ("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")
        ]
        assert stats["kv_migration_bytes_total"] > 0  # type: ignore[operator]
        assert len(stats["kv_migration_seconds"]) == 3  # type: ignore[arg-type]
        assert (await disagg.stats())["kv_migration_seconds"] == []  # only new durations
        outs = await asyncio.gather(*(drain(colocated.generate(p, SHORT, p)) for p in ("a", "b")))
        assert all(o.finished for o in outs)
        stats = await colocated.stats()
        instances = cast(list[dict[str, object]], stats["instances"])
        assert [(i["instance"], i["phase"]) for i in instances] == [("colocated-0", "colocated"), ("colocated-1", "colocated")]
        assert stats["kv_migration_seconds"] == [] and stats["kv_migration_bytes_total"] == 0

    try:
        asyncio.run(run())
    finally:
        disagg.close()
        colocated.close()


def test_colocated_engines_share_load(tiny: LoadedModel) -> None:
    engines = [LLMEngine(tiny, cache_config=CACHE), LLMEngine(tiny, cache_config=CACHE)]
    seen: list[int] = []
    for i, e in enumerate(engines):
        real = e.add_request

        def add(*args: Any, _real: Callable[..., str] = real, _i: int = i, **kwargs: Any) -> str:
            seen.append(_i)
            return _real(*args, **kwargs)

        e.add_request = add  # type: ignore[method-assign]
    client = ThreadedEngineClient(engines)

    async def run() -> None:
        streams = [client.generate(p, LONG, p) for p in ("a", "b")]
        for s in streams:
            await anext(s)
        for s in streams:
            await s.aclose()

    try:
        asyncio.run(run())
        assert sorted(seen) == [0, 1]
    finally:
        client.close()


def test_normalize_raw_engine_stats(tiny: LoadedModel) -> None:
    disagg = normalize_stats(LocalDisaggEngine(tiny, cache_config=CACHE).stats())
    assert [i["phase"] for i in disagg["instances"]] == ["prefill", "decode"]
    engine = LLMEngine(tiny, cache_config=CACHE)
    [out] = engine.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True))
    colocated = normalize_stats(engine.stats())
    assert colocated["instances"][0]["instance"] == "colocated-0"
    metrics = ServingMetrics(model_name="tiny")
    metrics.update_engine_stats({**disagg, "kv_migration_seconds": [0.001, 0.002]})
    assert b'distserve:kv_migration_seconds_count{engine="all",model_name="tiny",phase="decode"} 2.0' in metrics.render()
    metrics.update_engine_stats(colocated)  # the colocated engine's step histograms and counters, as its InstanceCore counts them
    text = metrics.render().decode()
    labels = 'engine="colocated-0",model_name="tiny",phase="colocated"'
    assert f"distserve:iteration_tokens_total_count{{{labels}}} 3.0" in text  # the prompt's step, then two decodes
    assert f"distserve:engine_step_seconds_count{{{labels}}} 3.0" in text
    assert f"distserve:prefix_cache_queries_total{{{labels}}} {float(len(out.prompt_token_ids))}" in text
    assert f"distserve:num_preemptions_total{{{labels}}} 0.0" in text


def test_sse_response_closes_its_generator_on_disconnect() -> None:
    """Starlette's StreamingResponse leaves the generator to the GC; ours closes it, which aborts the request."""
    closed = threading.Event()

    async def events() -> AsyncIterator[str]:
        try:
            while True:
                yield "data: x\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    async def run() -> None:
        gen = events()
        disconnect = asyncio.Event()
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)
            if len(sent) >= 3:  # the client leaves while a chunk is being written: ``gen`` sits at a yield
                disconnect.set()
                await asyncio.sleep(10)

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await asyncio.wait_for(SSEResponse(gen)(scope, receive, send), 5)  # type: ignore[arg-type]
        assert closed.is_set()  # ``gen`` is still referenced here, so no GC finalizer did it

    asyncio.run(run())


def test_metrics_count_requests_meeting_the_deployment_slo(tiny: LoadedModel) -> None:
    from distserve.slo import SLO

    client = ThreadedEngineClient(LLMEngine(tiny, cache_config=CACHE))

    async def run() -> str:
        for slo, met in ((SLO(60.0, 60.0), "true"), (SLO(60.0, 1e-9), "false")):
            app = build_fastapi_app(client, "tiny", metrics=ServingMetrics(slo=slo))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
                body = {"prompt": "x", "max_tokens": 4, "min_tokens": 4, "stream": True}
                assert (await h.post("/v1/completions", json=body)).status_code == 200
                text = (await h.get("/metrics")).text
                assert f'distserve:request_slo_total{{met="{met}",model_name="tiny",objective="default"}} 1.0' in text, text
        return text

    try:
        asyncio.run(run())
    finally:
        client.close()


def test_ray_serve_options_carry_the_tpot_slo_to_the_decoding_instances() -> None:
    from distserve.runtime.local_client import build_local_engine_client
    from distserve.serving.app_config import ServeAppConfig

    client = build_local_engine_client(ServeAppConfig.from_args({"model": "tiny", "tpot_slo": "0.1"}).resolve().deployment)
    try:
        engine = client.engines[0]
        assert isinstance(engine, LocalDisaggEngine)
        assert [i.core.scheduler.config.step_budget for i in engine.decode] == ["slo"]
        assert [i.core.scheduler.config.step_budget for i in engine.prefill] == ["static"]
    finally:
        client.close()


def test_engines_built_by_a_factory_run_on_the_engine_thread(tiny: LoadedModel) -> None:
    """A factory runs on the engine thread (the process's compute thread), with the torch threads asked for."""
    import torch

    seen: dict[str, Any] = {}

    def build() -> LLMEngine:
        seen["thread"] = threading.current_thread().name
        seen["torch_threads"] = torch.get_num_threads()
        return LLMEngine(tiny, cache_config=CACHE)

    before = torch.get_num_threads()
    client = ThreadedEngineClient(build, num_threads=1)
    try:
        assert seen == {"thread": "distserve-engine", "torch_threads": 1}
        assert client.model_name == tiny.config.name
        ref = LLMEngine(tiny, cache_config=CACHE).generate(["abc"], SHORT)[0]
        out = asyncio.run(drain(client.generate("abc", SHORT, "r1")))
        assert out.token_ids == ref.token_ids
    finally:
        client.close()
        torch.set_num_threads(before)


def test_a_factory_that_fails_fails_the_constructor() -> None:
    def build() -> LLMEngine:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        ThreadedEngineClient(build)
    with pytest.raises(ValueError, match="at least one engine"):
        ThreadedEngineClient(lambda: [])
