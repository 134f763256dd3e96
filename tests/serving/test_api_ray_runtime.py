"""The HTTP API over the Ray runtime (1P1D actors, KV over gloo): parity, streaming, disconnect, metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from distserve.config import CacheConfig, SamplingParams, StructuredOutput
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.runtime.config import DeploymentConfig
from distserve.placement import Placement
from distserve.runtime.ray_client import ControllerClient
from promql_util import VLLM_DASHBOARD_QUERIES, dashboard_queries, exported_series, unanswered
from serving_util import HttpServer

pytestmark = pytest.mark.timeout(300)
CACHE = CacheConfig(num_blocks=1024, block_size=16)
PROMPT = "Hello, my name is"


def start_server() -> HttpServer:
    async def make_client() -> ControllerClient:
        client = await ControllerClient.create(
            DeploymentConfig("tiny", Placement.disaggregated(), dtype="float32", cache_config=CACHE, kv_transfer_timeout_s=20.0)
        )
        assert client.controller.config.kv_transfer_timeout_s == 20.0
        return client

    return HttpServer(make_client)


def stats(server: HttpServer) -> dict[str, Any]:
    assert server.client is not None
    return server.call(server.client.stats())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def server(ray_cluster: Any) -> Iterator[HttpServer]:
    srv = start_server()
    try:
        yield srv
    finally:
        srv.stop()


def test_openai_client_greedy_matches_engine(server: HttpServer) -> None:
    expected = LLMEngine(load_model("tiny"), cache_config=CACHE).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.0)
    )[0].text
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices
    )
    assert streamed == expected
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'distserve:kv_migration_bytes_total{engine="all",model_name="tiny",phase="decode"}' in metrics


def test_structured_output_matches_the_colocated_engine(server: HttpServer) -> None:
    """The decode actor rebuilds each matcher from the spec and the token the prefill actor sampled."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    engine = LLMEngine(load_model("tiny"), cache_config=CACHE)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    for field, spec in (("guided_json", schema), ("guided_regex", r"[a-c]{2,6}-[0-9]{2}")):
        kind = "json" if field == "guided_json" else "regex"
        structured = StructuredOutput(kind, json.dumps(spec) if kind == "json" else spec, field)  # type: ignore[arg-type]
        expected = engine.generate([PROMPT], SamplingParams(max_tokens=32, temperature=0.0, structured=structured))[0]
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0, extra_body={field: spec}).choices[0]
        assert got.text == expected.text and got.finish_reason == expected.finish_reason == "stop"


def test_disconnect_frees_kv_on_both_instances(server: HttpServer) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i > 6:
                    break  # leave mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        instances = stats(server)["instances"]
        if all(i["kv_cache_usage_perc"] == 0.0 and i["num_requests_running"] == 0 for i in instances):
            break
        time.sleep(0.1)
    assert all(i["kv_cache_usage_perc"] == 0.0 for i in stats(server)["instances"])


def test_dashboards_read_only_series_the_ray_runtime_exports(server: HttpServer) -> None:
    """Our dashboard's queries, and vLLM's under the default prefix, against the Ray runtime's /metrics
    (its instance figures cross from the actors: step histograms, cache configs, prefix-cache counters)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, stream=False)
    text = httpx.get(f"{server.url}/metrics").text
    exported = exported_series(text)
    vllm_queries = [q.replace("vllm:", "distserve:") for panel in VLLM_DASHBOARD_QUERIES.values() for q in panel]
    # Goodput/attainment read distserve:request_slo_total, which exists only with an SLO (this server has none).
    ours = [q for q in dashboard_queries() if "request_slo_total" not in q]
    assert unanswered(ours + vllm_queries, exported) == {}
    for engine, phase in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert f'distserve:engine_step_seconds_count{{engine="{engine}",model_name="tiny",phase="{phase}"}}' in text
        assert f'distserve:cache_config_info{{block_size="16",enable_prefix_caching="True",engine="{engine}"' in text
