"""Admission over HTTP: a request's ``timeout`` (seconds it may wait in the admission queue) ends it
with a 408 in OpenAI's shape once it waited too long, the queue's ``max_queue_delay_s`` with a 429, a bad ``timeout`` is a 400 naming it, the
other requests are unharmed; and the serve/simulate admission flags build the ``AdmissionConfig``
the runtimes and the simulator share (tiny model, in-process 1P1D engine, 127.0.0.1)."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from serving_util import wait_until

from distserve.cli.args import admission_config_of, build_parser
from distserve.cli.serve import _check_serve_args, prefill_scheduler_config
from distserve.cluster.admission import AdmissionConfig
from distserve.config import CacheConfig, SchedulerConfig
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import load_model
from distserve.errors import InvalidConfigError
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving import overload_gate
from distserve.serving.api import build_fastapi_app

pytestmark = pytest.mark.timeout(300)
STEP_S = 0.01


class SlowDisagg(LocalDisaggEngine):
    """The real 1P1D engine, each step at least ``STEP_S``, so requests queue for a while."""

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_S)
        return super().step()


@contextmanager
def serving(admission: AdmissionConfig, max_queued_requests: int = 64) -> Iterator[str]:
    def build() -> LocalDisaggEngine:
        # One prompt per prefill step and one request waiting in the prefill scheduler: the rest wait in admission.
        return SlowDisagg(load_model("tiny"), cache_config=CacheConfig(num_blocks=512, block_size=16),
                          prefill_scheduler_config=SchedulerConfig(max_num_seqs=1), admission=admission)

    client = ThreadedEngineClient(build, max_queued_requests=max_queued_requests)
    app = build_fastapi_app(client, "tiny")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 30), "server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        client.close()
        sock.close()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(AdmissionConfig(max_waiting=1)) as root:
        yield root


def body(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0, **extra}


def test_a_request_that_waits_past_its_timeout_gets_408_and_the_others_complete(url: str) -> None:
    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            ahead = [asyncio.create_task(http.post("/v1/completions", json=body(f"request number {i} of the queue")))
                     for i in range(20)]
            await asyncio.sleep(0.1)  # they are queued (one is dispatched per >= 10 ms step: 200 ms for all)
            late = await http.post("/v1/completions", json=body("the impatient one", timeout=0.02))
            return list(await asyncio.gather(*ahead)), late

    ahead, late = asyncio.run(run())
    assert late.status_code == 408, late.text
    err = late.json()["error"]
    assert err["param"] == "timeout" and err["type"] == "timeout_error" and err["code"] == "request_timeout"
    assert "admission queue" in err["message"]
    assert [r.status_code for r in ahead] == [200] * 20
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in ahead)
    # A generous timeout changes nothing for a request served at once.
    ok = httpx.post(f"{url}/v1/completions", json=body("patient", timeout=60), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_requests_that_wait_the_max_queue_delay_get_429_with_retry_after_and_the_others_complete() -> None:
    """A burst on a cold server (no drain rate measured: every request is queued): one request is
    dispatched per >= 10 ms step, so those still queued after 60 ms are shed with a 429."""
    async def run(root: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=root, timeout=120) as http:
            return list(await asyncio.gather(*(http.post("/v1/completions", json=body(f"request number {i} of the burst"))
                                               for i in range(30))))

    with serving(AdmissionConfig(max_waiting=1, max_queue_delay_s=0.06)) as root:
        responses = asyncio.run(run(root))
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 4
        else:
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and float(r.headers["Retry-After"]) > 0
    assert any("max_queue_delay" in r.json()["error"]["message"] for r in responses if r.status_code == 429)


def test_while_a_refusal_holds_for_every_request_the_next_are_refused_at_the_door(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request past the server's in-flight bound is refused by the engine; while that refusal holds (30 s
    here, so the machine's speed does not matter) the next requests get the gate's 429 at the door
    (``OverloadDoor``: before the body is parsed, so a body that breaks the schema too; a Parrot semantic call
    too), counted as queue_full; other routes are answered, and the request in flight completes."""
    monkeypatch.setattr(overload_gate, "UNKNOWN_HOLD_S", 30.0)
    monkeypatch.setattr(overload_gate, "MAX_HOLD_S", 30.0)

    async def run(root: str) -> tuple[list[httpx.Response], httpx.Response, str, str]:
        async with httpx.AsyncClient(base_url=root, timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json=body("the one in flight", max_tokens=32, stream=True)) as first:
                lines = first.aiter_lines()
                while not (await anext(lines)).startswith("data:"):  # it is in flight once its first token streamed
                    pass
                refused = [await http.post("/v1/completions", json=body(f"one too many {i}")) for i in range(3)]
                bad = await http.post("/v1/completions", json={"model": "tiny", "max_tokens": 4})  # no prompt
                call = await http.post("/v1/semantic_call", json={"session_id": 1, "template": "{{output:x}}"})
                models = await http.get("/v1/models")
                rest = "".join([line async for line in lines])
            return refused + [bad, call], models, rest, (await http.get("/metrics")).text

    with serving(AdmissionConfig(max_waiting=1), max_queued_requests=1) as root:
        refused, models, rest, metrics = asyncio.run(run(root))
    assert [r.status_code for r in refused] == [429] * 5
    messages = [r.json()["error"]["message"] for r in refused]
    assert "limit of 1 requests in flight" in messages[0] and "refusing requests for" not in messages[0]  # the engine's
    for r, message in zip(refused[1:], messages[1:]):  # the gate's, naming the refusal it holds for
        assert message.startswith("the server is refusing requests for") and "limit of 1 requests in flight" in message
        assert r.json()["error"]["code"] == "queue_full" and int(r.headers["Retry-After"]) >= 1
    assert models.status_code == 200
    assert rest.rstrip().endswith("[DONE]")
    assert re.search(r'tenant_requests_rejected_total\{[^}]*reason="queue_full",tenant="anonymous"\} 5\.0', metrics)


@pytest.mark.parametrize("timeout", [-1, 0, "soon", float("inf")])
def test_a_bad_timeout_is_a_400_naming_it(url: str, timeout: object) -> None:
    payload = body("x", timeout=timeout) if timeout != float("inf") else None
    if payload is None:  # JSON has no infinity: send the literal a lenient client would
        r = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "timeout": 1e999}',
                       headers={"Content-Type": "application/json"}, timeout=30)
    else:
        r = httpx.post(f"{url}/v1/completions", json=payload, timeout=30)
    assert r.status_code in (400, 422), r.text
    assert r.json()["error"]["param"] == "timeout"


def test_admission_flags_build_the_shared_config() -> None:
    parser = build_parser()
    serve = parser.parse_args(["serve", "--model", "tiny"])
    assert admission_config_of(serve, None) == AdmissionConfig()  # fair, TNG's backpressure: the product's defaults
    serve = parser.parse_args(["serve", "--model", "tiny", "--admission-policy", "fcfs", "--no-backpressure"])
    assert admission_config_of(serve, 0.1) == AdmissionConfig("fcfs", max_waiting=None)
    serve = parser.parse_args(["serve", "--model", "tiny", "--max-waiting", "5", "--tpot-backpressure"])
    assert admission_config_of(serve, 0.1) == AdmissionConfig(max_waiting=5, tpot_slo_s=0.1)
    serve = parser.parse_args(["serve", "--model", "tiny", "--waiting-unit", "requests", "--max-waiting", "2"])
    assert admission_config_of(serve, None) == AdmissionConfig(max_waiting=2, waiting_unit="requests")  # TNG's rule
    serve = parser.parse_args(["serve", "--model", "tiny", "--max-waiting", "5", "--tpot-backpressure"])
    with pytest.raises(InvalidConfigError, match="--tpot-backpressure needs a TPOT SLO"):
        admission_config_of(serve, None)
    serve = parser.parse_args(["serve", "--model", "tiny", "--prefill-chunk", "256"])
    assert prefill_scheduler_config(serve) == SchedulerConfig(enable_chunked_prefill=True, max_num_batched_tokens=256)
    assert prefill_scheduler_config(parser.parse_args(["serve", "--model", "tiny"])) == SchedulerConfig()
    assert prefill_scheduler_config(parser.parse_args(["serve", "--model", "tiny", "--no-layer-preemption"])) == SchedulerConfig(layer_preemption=False)
    for flag in (["--no-layer-preemption"], ["--prefill-chunk", "128"]):  # prefill instances only
        with pytest.raises(InvalidConfigError, match=flag[0]):
            _check_serve_args(parser.parse_args(["serve", "--model", "tiny", "--colocated", "1", *flag]))
    sim = parser.parse_args(["simulate", "--model", "facebook/opt-13b", "--ttft", "1", "--tpot", "0.1", "--admission-policy", "priority"])
    assert admission_config_of(sim, sim.tpot) == AdmissionConfig("priority")
