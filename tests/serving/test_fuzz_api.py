"""Fuzzing every HTTP route, on the local and the Ray runtime: bad input is a 4xx, never a 5xx, a
hang or a dead engine, and the server keeps serving plain requests afterwards.

Schemathesis reads the routes from ``/openapi.json`` (so a route added later is fuzzed too) and
generates, with a fixed seed, requests that fit the schema and requests that do not; the values
that once took the whole service down are sent explicitly as well.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from distserve.config import CacheConfig, SchedulerConfig
from distserve.engine.weights import load_model
from distserve.runtime.config import DeploymentConfig
from distserve.placement import Placement
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.ray_client import ControllerClient
from distserve.runtime.threaded_client import ThreadedEngineClient
from serving_util import HttpServer

pytestmark = pytest.mark.timeout(600)

CACHE = CacheConfig(num_blocks=256, block_size=16)
# A short context bounds what a generated request may ask for, so hundreds of cases stay quick.
SCHED = SchedulerConfig(max_model_len=96)
EXAMPLES_PER_MODE = 60  # per route and generation mode (fitting the schema, and not): a few hundred in all

PLAIN = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
# The reports that once crashed the engine: each must now be a 400 naming its field.
EDGE_CASES: list[tuple[dict[str, Any], str]] = [
    ({"seed": 1180591620717411303424}, "seed"),
    ({"seed": -18121509656578299527168}, "seed"),
    ({"priority": 2**63}, "priority"),
    ({"top_k": 2**40}, "top_k"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"max_tokens": 2**62}, "max_tokens"),
    ({"temperature": 1e308}, "temperature"),
    ({"stop": ["x" * 600] * 3}, "stop"),
    ({"stop": [f"s{i}" * 40 for i in range(3000)]}, "stop"),
    ({"logit_bias": {str(i): 1.0 for i in range(5000)}}, "logit_bias"),
    ({"top_p": 0}, "top_p"),
    ({"min_tokens": 10}, "min_tokens"),
    ({"prompt": [2**63]}, "prompt"),
]


def local_server() -> HttpServer:
    async def make_client() -> ThreadedEngineClient:
        engine = LocalDisaggEngine(load_model("tiny"), cache_config=CACHE, decode_scheduler_config=SCHED)
        return ThreadedEngineClient(engine)

    return HttpServer(make_client)


def ray_server() -> HttpServer:
    async def make_client() -> ControllerClient:
        return await ControllerClient.create(
            DeploymentConfig("tiny", Placement.disaggregated(), dtype="float32", cache_config=CACHE, scheduler_config=SCHED)
        )

    return HttpServer(make_client)


@pytest.fixture(params=["local", pytest.param("ray", marks=pytest.mark.integration)])
def server(request: pytest.FixtureRequest) -> Iterator[HttpServer]:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    srv = local_server() if request.param == "local" else ray_server()
    try:
        yield srv
    finally:
        srv.stop()


# The cases a completed fuzzing run generated, in order. Generation is derandomized (the same cases for the same
# schema, which both runtimes serve), and costs more than sending: a later run sends these instead of drawing them again.
GENERATED: list[tuple[str, str, Any]] = []


def fuzz_every_route(base_url: str) -> collections.Counter[tuple[str, str, int]]:
    """Status codes of the generated requests per route; fails on the first 5xx."""
    seen: collections.Counter[tuple[str, str, int]] = collections.Counter()

    def send(method: str, path: str, case: Any) -> None:
        response = case.call(base_url=base_url, timeout=60)
        seen[(method, path, response.status_code)] += 1
        assert response.status_code < 500, f"{method} {path} answered {response.status_code} {response.text[:300]!r} to {case.body!r:.500}"

    if GENERATED:
        for method, path, case in GENERATED:
            send(method, path, case)
        return seen
    generated: list[tuple[str, str, Any]] = []
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        method, path = operation.method.upper(), operation.path
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES_PER_MODE, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                generated.append((method, path, case))
                send(method, path, case)

            try:
                check()
            except Unsatisfiable:
                pass  # a route without parameters has no request that violates its schema
    GENERATED[:] = generated
    return seen


def test_fuzzed_and_edge_requests_never_5xx_and_server_keeps_serving(server: HttpServer) -> None:
    seen = fuzz_every_route(server.url)
    routes = {(method, path) for method, path, _ in seen}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/health")} <= routes
    assert any(code == 200 for (_, path, code) in seen if path == "/v1/completions"), "no generated request succeeded"
    assert sum(seen.values()) >= 200
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for fields, param in EDGE_CASES:
            for route, body in (("/v1/completions", {**PLAIN, **fields}), ("/v1/chat/completions", _chat({**PLAIN, **fields}))):
                if route.endswith("chat/completions") and "prompt" in fields:
                    continue
                resp = http.post(route, json=body)
                assert resp.status_code == 400, (route, fields, resp.status_code, resp.text[:300])
                assert resp.json()["error"]["param"] == param, (route, fields, resp.text[:300])
        resp = http.post("/v1/completions", json=PLAIN)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        assert http.get("/health").status_code == 200


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    chat = {k: v for k, v in body.items() if k != "prompt"}
    chat["messages"] = [{"role": "user", "content": body["prompt"]}]
    return chat
