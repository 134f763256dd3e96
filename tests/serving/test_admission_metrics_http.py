"""Per-tenant admission series on /metrics (tiny model, colocated engine behind the threaded
client's admission queue, a key file's tenants, 127.0.0.1): a token-rate refusal, a request that
waits past its timeout, dispatches and their wait, each under its tenant; and a semantic-variable
call counted in the per-tenant request and TTFT series like an OpenAI request."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serving_util import HttpServer, Samples, metric_samples, wait_until

from distserve.cluster.admission import AdmissionConfig
from distserve.config import CacheConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api_keys import load_api_keys

pytestmark = pytest.mark.timeout(300)
ACME_KEY, NIGHTLY_KEY, BETA_KEY = "sk-acme-0123456789abcdef", "sk-nightly-0123456789abcd", "sk-beta-0123456789abcdef0"
KEY_FILE = f"""\
tenants:
  acme: {{tokens_per_minute: 300}}
  nightly: {{tier: batch}}
  beta: {{}}
keys:
  {ACME_KEY}: acme
  {NIGHTLY_KEY}: nightly
  {BETA_KEY}: beta
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """The app with the key file's tenants; a decoding request holds every other in the admission
    queue (a TPOT SLO no step meets)."""
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(KEY_FILE)
    keys = load_api_keys(path)
    loaded = load_model("tiny")

    async def make_client() -> ThreadedEngineClient:
        return ThreadedEngineClient(LLMEngine(loaded, cache_config=CacheConfig(num_blocks=512, block_size=16)),
                                    admission=AdmissionConfig(tenants=tuple(keys.tenants.values()), tpot_slo_s=1e-9))

    srv = HttpServer(make_client, api_keys=keys)
    yield srv
    srv.stop()


def http(server: HttpServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(f"distserve:{name}", tuple(sorted(labels.items())))]


def test_admission_series_per_tenant_and_semantic_calls_counted_as_their_tenants(server: HttpServer) -> None:
    fresh = metric_samples(server.url)
    for tenant in ("acme", "nightly", "beta", "anonymous", "other"):  # every series exists from the start, at 0
        assert value(fresh, "tenant_admission_queued", tenant=tenant) == 0
        assert value(fresh, "tenant_admission_dispatched_total", tenant=tenant) == 0
        assert value(fresh, "tenant_admission_refused_total", tenant=tenant, reason="token_rate") == 0

    with http(server, ACME_KEY) as acme:  # 300 tokens a minute: one request of ~200 tokens, then 429
        assert acme.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}).status_code == 200
        refused = acme.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 200})
        assert refused.status_code == 429 and "tokens per minute" in refused.json()["error"]["message"]

    with http(server, BETA_KEY) as beta, http(server, NIGHTLY_KEY) as nightly:
        with beta.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 900, "ignore_eos": True, "stream": True}) as long:
            lines = long.iter_lines()  # kept: a dropped iterator closes the stream
            assert next(lines).startswith("data:")  # decoding: every later request waits in the queue
            late = nightly.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "timeout": 0.3})
            assert late.status_code == 408, late.text
        # the stream closed: the long request is aborted, the engine free again
        session = nightly.post("/v1/session").json()
        auth = {"session_id": session["session_id"], "session_auth": session["session_auth"]}
        submitted = nightly.post("/v1/semantic_call", json={**auth, "template": "Say {{y}}", "placeholders": [
            {"name": "y", "is_output": True, "sampling_config": {"temperature": 0, "max_gen_length": 3, "ignore_tokenizer_eos": True}}]})
        assert submitted.status_code == 200, submitted.text
        var_id = submitted.json()["param_info"][0]["var_id"]
        assert nightly.get(f"/v1/semantic_var/{var_id}", params={**auth, "criteria": "latency", "timeout": 60}).status_code == 200

    assert wait_until(lambda: server.client.num_outstanding == 0, 10)  # type: ignore[union-attr]
    after = metric_samples(server.url)
    assert value(after, "tenant_admission_refused_total", tenant="acme", reason="token_rate") == 1
    assert value(after, "tenant_admission_refused_total", tenant="acme", reason="queue_bound") == 0
    assert value(after, "tenant_requests_rejected_total", tenant="acme", reason="queue_full") == 1  # the same refusal, at HTTP
    assert value(after, "tenant_admission_expired_total", tenant="nightly") == 1
    assert value(after, "tenant_requests_rejected_total", tenant="nightly", reason="timeout") == 1
    assert {t: value(after, "tenant_admission_dispatched_total", tenant=t) for t in ("acme", "beta", "nightly", "anonymous")} == {
        "acme": 1, "beta": 1, "nightly": 1, "anonymous": 0}  # nightly's: its semantic call
    assert all(value(after, "tenant_admission_queued", tenant=t) == 0 for t in ("acme", "beta", "nightly"))
    assert value(after, "tenant_admission_wait_seconds_total", tenant="nightly") >= 0
    # The semantic call is counted under its tenant, as the OpenAI requests are.
    assert value(after, "tenant_requests_admitted_total", tenant="nightly") == 1
    assert value(after, "tenant_time_to_first_token_seconds_count", tenant="nightly") == 1
    assert value(after, "tenant_requests_admitted_total", tenant="acme") == 1
