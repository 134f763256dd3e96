"""Every query of our Grafana dashboard, and of vLLM's with ``--metrics-prefix vllm``, reads series
the in-process 1P1D server exports after a few requests, with the labels the queries use."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from promql_util import VLLM_DASHBOARD_QUERIES, dashboard_queries, exported_series, series_and_labels, unanswered

from distserve.config import CacheConfig
from distserve.engine.weights import load_model
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api import build_fastapi_app
from distserve.serving.metrics import ServingMetrics
from distserve.serving.metrics_exposition import METRICS_PREFIXES, VLLM_SERIES
from distserve.slo import SLO

pytestmark = pytest.mark.timeout(120)

CACHE = CacheConfig(num_blocks=512, block_size=16)
VLLM_QUERIES = [q for panel in VLLM_DASHBOARD_QUERIES.values() for q in panel]
REQUESTS = (  # streamed and not, chat and completions, n > 1: every series has samples afterwards
    ("/v1/completions", {"prompt": "Hello, my name is", "max_tokens": 6, "ignore_eos": True, "stream": True}),
    ("/v1/completions", {"prompt": "Hello, my name is Ann", "max_tokens": 4, "n": 2, "temperature": 0.8, "seed": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
)


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    """The ``/metrics`` text of the same 1P1D engine behind an app per prefix, after ``REQUESTS`` through each."""
    client = ThreadedEngineClient(LocalDisaggEngine(load_model("tiny"), cache_config=CACHE))

    async def run() -> dict[str, str]:
        texts = {}
        for prefix in METRICS_PREFIXES:
            app = build_fastapi_app(client, "tiny", metrics=ServingMetrics(slo=SLO(60.0, 60.0), prefix=prefix))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as http:
                for path, body in REQUESTS:
                    assert (await http.post(path, json=body)).status_code == 200
                texts[prefix] = (await http.get("/metrics")).text
        return texts

    try:
        return asyncio.run(run())
    finally:
        client.close()


@pytest.mark.parametrize("prefix", METRICS_PREFIXES)
def test_our_dashboard_reads_only_exported_series(exported: dict[str, str], prefix: str) -> None:
    queries = dashboard_queries(prefix=prefix)
    assert len(queries) >= 30 and all("${" not in q for q in queries)
    assert unanswered(queries, exported_series(exported[prefix])) == {}


def test_vllm_dashboard_reads_the_vllm_prefixed_series(exported: dict[str, str]) -> None:
    assert unanswered(VLLM_QUERIES, exported_series(exported["vllm"])) == {}
    # Under the default prefix the same queries read distserve:* instead: the prefix is all that differs.
    assert unanswered([q.replace("vllm:", "distserve:") for q in VLLM_QUERIES], exported_series(exported["distserve"])) == {}


def test_every_series_carries_model_name_and_vllm_names_only_vllm_series(exported: dict[str, str]) -> None:
    for prefix, text in exported.items():
        series = exported_series(text)
        assert all("model_name" in labels for labels in series.values()), prefix
        assert not any("instance" in labels for labels in series.values())  # Prometheus's own label, set on scrape
        prefixes = {name.split(":")[0] for name in series}
        assert prefixes == ({"distserve"} if prefix == "distserve" else {"distserve", "vllm"})
    vllm = {name.split(":")[1] for name in exported_series(exported["vllm"]) if name.startswith("vllm:")}
    assert {n for n in vllm if not any(n.startswith(s) for s in VLLM_SERIES)} == set()
    assert 'engine="prefill-0"' in exported["vllm"] and 'vllm:cache_config_info{block_size="16"' in exported["vllm"]


def test_query_parser_finds_series_and_labels() -> None:
    expr = ('histogram_quantile(0.99, sum by(le, engine) (rate(distserve:engine_step_seconds_bucket{model_name="$m", engine=~"$e"}[5m])))'
            ' / sum(rate(vllm:prompt_tokens_total[1m])) > 1e-9')
    assert series_and_labels(expr) == ({"distserve:engine_step_seconds_bucket", "vllm:prompt_tokens_total"}, {"engine", "model_name"})
    assert unanswered([expr], {"vllm:prompt_tokens_total": {"model_name"}}) != {}
