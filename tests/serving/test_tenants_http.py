"""Tenants over HTTP (``serve --api-keys``): 401 without a valid key on every route but /health and
/metrics, each request reaching the engine with its tenant and tier, tenants isolated from each
other's sessions and variables, per-tenant session limits, 429/408 in OpenAI's shape with
``Retry-After``, and per-tenant Prometheus series (tiny model, in-process engine, 127.0.0.1)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from serving_util import metric_samples, wait_until

from distserve.cluster.classes import RequestClass
from distserve.config import CacheConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import load_model
from distserve.errors import QueueFullError, RequestTimeoutError
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api import build_fastapi_app
from distserve.serving.api_keys import load_api_keys
from distserve.serving.http_errors import engine_error, error_response

pytestmark = pytest.mark.timeout(300)
CACHE = CacheConfig(num_blocks=512, block_size=16)
ACME_KEY = "sk-acme-0123456789abcdef"
ACME_SECOND_KEY = "sk-acme-second-0123456789"
NIGHTLY_KEY = "sk-nightly-0123456789abcd"
KEY_FILE = f"""\
tenants:
  acme: {{weight: 2, tier: interactive, max_sessions: 2}}
  nightly: {{tier: batch}}
keys:
  {ACME_KEY}: acme
  {ACME_SECOND_KEY}: acme
  {NIGHTLY_KEY}: nightly
"""
GREEDY = {"temperature": 0, "max_gen_length": 4, "ignore_tokenizer_eos": True}
LONG_CALL = {"temperature": 0, "max_gen_length": 900, "ignore_tokenizer_eos": True}
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}
MAX_IN_FLIGHT = 2


class SlowEngine(LLMEngine):
    """The real engine, each step at least 5 ms, so a long request is still running when a test acts."""

    def step(self) -> list[RequestOutput]:
        time.sleep(0.005)
        return super().step()


class RecordingClient(ThreadedEngineClient):
    """The real in-process client, recording the scheduling class each request was sent with."""

    def __init__(self) -> None:
        super().__init__(SlowEngine(load_model("tiny"), cache_config=CACHE), max_queued_requests=MAX_IN_FLIGHT)
        self.classes: dict[str, RequestClass | None] = {}

    def generate(self, prompt, sampling, request_id, priority=0, request_class=None, timeout_s=None):  # type: ignore[no-untyped-def]
        self.classes[request_id] = request_class
        return super().generate(prompt, sampling, request_id, priority, request_class=request_class, timeout_s=timeout_s)


class Server:
    """The app with API keys on uvicorn on a free loopback port, in a background thread."""

    def __init__(self, key_file: Path | None) -> None:
        self.client = RecordingClient()
        app = build_fastapi_app(self.client, "tiny", api_keys=load_api_keys(key_file) if key_file else None)
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        assert wait_until(lambda: self.server.started, 30), "server did not start"

    def http(self, key: str | None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {key}"} if key else {})

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.client.close()
        self.sock.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(KEY_FILE)
    srv = Server(path)
    yield srv
    srv.stop()


def call(http: httpx.Client, auth: dict[str, Any], template: str, placeholders: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return http.post("/v1/semantic_call", json={**auth, "template": template, "placeholders": placeholders, **extra})


ROUTES = [
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None), ("POST", "/v1/session", {}), ("GET", "/v1/session/1", None), ("DELETE", "/v1/session/1", None),
    ("POST", "/v1/semantic_call", {"session_id": 1}), ("POST", "/v1/semantic_var", {"session_id": 1}),
    ("GET", "/v1/semantic_var", None), ("GET", "/v1/semantic_var/v1", None), ("GET", "/v1/semantic_var/v1/stream", None),
    ("POST", "/v1/py_native_call", {}), ("GET", "/openapi.json", None), ("GET", "/docs", None), ("GET", "/no/such/route", None),
]


@pytest.mark.parametrize("authorization", [None, "Bearer sk-wrong-0123456789abcdef", f"Basic {ACME_KEY}", f"Bearer {ACME_KEY}x", "Bearer"])
def test_every_route_but_health_and_metrics_needs_a_valid_key(server: Server, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    num_requests = len(server.client.classes)
    with httpx.Client(base_url=server.url, timeout=30, headers=headers) as http:
        for method, path, body in ROUTES:
            r = http.request(method, path, json=body)
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert r.json() == {"error": {
                "message": "Incorrect API key provided." if authorization and authorization.startswith("Bearer ") and len(authorization) > 7
                else "Missing API key: send it in an `Authorization: Bearer <key>` header.",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
            assert r.headers["WWW-Authenticate"].startswith("Bearer") and ACME_KEY not in r.text
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    assert len(server.client.classes) == num_requests  # nothing reached the engine


def test_a_valid_key_serves_the_openai_api_as_its_tenant_and_tier(server: Server) -> None:
    for key, tenant, tier in ((ACME_KEY, "acme", "interactive"), (ACME_SECOND_KEY, "acme", "interactive"), (NIGHTLY_KEY, "nightly", "batch")):
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        done = sdk.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=3, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 3
        chunks = list(sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True))
        assert server.client.classes[done.id] == server.client.classes[chunks[0].id] == RequestClass(tenant=tenant, tier=tier)
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-not-a-key-0123456789", max_retries=0).models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_a_tenant_sees_only_its_own_sessions_and_variables(server: Server) -> None:
    with server.http(ACME_KEY) as acme, server.http(NIGHTLY_KEY) as nightly, server.http(ACME_SECOND_KEY) as acme_too:
        mine = acme.post("/v1/session").json()
        auth = {"session_id": mine["session_id"], "session_auth": mine["session_auth"]}
        doc = acme.post("/v1/semantic_var", json={**auth, "var_name": "doc"}).json()["var_id"]
        assert acme.post(f"/v1/semantic_var/{doc}", json={**auth, "content": "bees"}).status_code == 200
        running = call(acme, auth, "Long: {{x}}", [{"name": "x", "is_output": True, "sampling_config": LONG_CALL}], output_criteria="latency")
        assert running.status_code == 200, running.text
        out = running.json()["param_info"][0]["var_id"]
        assert wait_until(lambda: server.client.num_outstanding == 1, 10)
        request_id = next(k for k, c in server.client.classes.items() if k.startswith(f"s{auth['session_id']}-"))
        assert server.client.classes[request_id] == RequestClass(objective="latency", tenant="acme", tier="interactive")

        unknown = {"session_id": 987654, "session_auth": mine["session_auth"]}
        for who in (auth, unknown):  # another tenant, even holding the token, gets what an unknown id gets: 404
            sid = who["session_id"]
            answers = [
                nightly.get(f"/v1/session/{sid}", params=who), nightly.request("DELETE", f"/v1/session/{sid}", json=who),
                nightly.post("/v1/semantic_var", json=who), nightly.get("/v1/semantic_var", params=who),
                nightly.get(f"/v1/semantic_var/{doc}", params=who), nightly.post(f"/v1/semantic_var/{doc}", json={**who, "content": "x"}),
                nightly.get(f"/v1/semantic_var/{out}/stream", params=who),
                call(nightly, who, "Read {{d}} {{y}}", [{"name": "d", "is_output": False, "var_id": doc}, {"name": "y", "is_output": True}]),
            ]
            for r in answers:
                assert r.status_code == 404, r.text
                error = r.json()["error"]
                assert error["message"] in (f"no live session {sid!r} (never created, deleted or expired)",
                                            f"no live session {str(sid)!r} (never created, deleted or expired)"), error
                assert (error["type"], error["param"], error["code"]) == ("not_found_error", "session_id", None)
        theirs = nightly.post("/v1/session").json()
        their_auth = {"session_id": theirs["session_id"], "session_auth": theirs["session_auth"]}
        r = call(nightly, their_auth, "Read {{d}} {{y}}", [{"name": "d", "is_output": False, "var_id": doc}, {"name": "y", "is_output": True}])
        assert r.status_code == 404 and r.json()["error"]["param"] == "var_id", r.text  # acme's variable is unknown in nightly's session
        assert nightly.get("/v1/semantic_var", params=their_auth).json() == {"variables": []}
        assert acme.get(f"/v1/session/{theirs['session_id']}", params=their_auth).status_code == 404  # and the other way round

        # nightly's delete did not end acme's session nor abort its call; another key of acme's reaches it
        assert server.client.num_outstanding == 1
        info = acme_too.get(f"/v1/session/{auth['session_id']}", params=auth).json()
        assert info["calls"]["running"] == 1
        assert acme_too.get(f"/v1/semantic_var/{doc}", params=auth).json() == {"content": "bees"}
        assert acme.request("DELETE", f"/v1/session/{auth['session_id']}", json=auth).status_code == 200  # its owner can end it
        assert wait_until(lambda: server.client.num_outstanding == 0, 10)
        assert nightly.request("DELETE", f"/v1/session/{theirs['session_id']}", json=their_auth).status_code == 200


def test_a_tenant_holds_at_most_its_max_sessions(server: Server) -> None:
    with server.http(ACME_KEY) as acme, server.http(NIGHTLY_KEY) as nightly:
        before = metric_samples(server.url)
        first, second = acme.post("/v1/session").json(), acme.post("/v1/session").json()
        r = acme.post("/v1/session")
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"] == {"message": "tenant 'acme' holds its maximum of 2 sessions; delete one first",
                                     "type": "rate_limit_error", "param": "session_id", "code": "limit_exceeded"}
        assert nightly.post("/v1/session").status_code == 200  # another tenant is not held back
        key = ("distserve:tenant_requests_rejected_total", (("reason", "session_limit"), ("tenant", "acme")))
        assert metric_samples(server.url)[key] == before.get(key, 0) + 1
        assert acme.request("DELETE", f"/v1/session/{first['session_id']}", json=first).status_code == 200
        third = acme.post("/v1/session")
        assert third.status_code == 200
        for s in (second, third.json()):
            acme.request("DELETE", f"/v1/session/{s['session_id']}", json=s)


def test_a_full_queue_is_429_with_retry_after_and_counted_per_tenant(server: Server) -> None:
    before = metric_samples(server.url)
    with server.http(NIGHTLY_KEY) as nightly, server.http(ACME_KEY) as acme:
        with nightly.stream("POST", "/v1/completions", json={"prompt": "a", "stream": True, **LONG}) as one, \
                nightly.stream("POST", "/v1/completions", json={"prompt": "b", "stream": True, **LONG}) as two:
            lines = [one.iter_lines(), two.iter_lines()]  # keep them: a discarded iterator closes the connection
            assert all(next(it).startswith("data:") for it in lines)
            during = metric_samples(server.url)
            assert during[("distserve:tenant_requests_running", (("tenant", "nightly"),))] == 2
            r = acme.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"] == {"message": f"server is at its limit of {MAX_IN_FLIGHT} requests in flight; retry later",
                                         "type": "rate_limit_error", "param": None, "code": "queue_full"}
    assert wait_until(lambda: server.client.num_outstanding == 0, 10)
    # the in-flight refusal shut the overload gate for 0.1 s: the module's next tests find it open
    assert wait_until(lambda: server.app.state.server.overload.shut_for_s == 0, 5)
    after = metric_samples(server.url)
    rejected = ("distserve:tenant_requests_rejected_total", (("reason", "queue_full"), ("tenant", "acme")))
    assert after[rejected] == before.get(rejected, 0) + 1
    for tenant in ("acme", "nightly"):
        for gauge in ("queued", "running"):
            assert after[(f"distserve:tenant_requests_{gauge}", (("tenant", tenant),))] == 0  # aborted streams left the gauges


def test_engine_errors_carry_retry_after_and_timeouts_are_408() -> None:
    for retry_after_s, header in ((2.3, "3"), (0.2, "1"), (None, "1"), (40.0, "40")):
        response = error_response(engine_error(QueueFullError("tenant acme's queue is full", None, retry_after_s), "prompt"))
        assert response.status_code == 429 and response.headers["Retry-After"] == header
    timeout = engine_error(RequestTimeoutError("request r1 waited 5 s in the admission queue, beyond its timeout of 5 s", "timeout"), "prompt")
    assert timeout.status_code == 408 and timeout.body()["error"] == {
        "message": "the request timed out before it was served: request r1 waited 5 s in the admission queue, beyond its timeout of 5 s",
        "type": "timeout_error", "param": "timeout", "code": "request_timeout"}
    assert "Retry-After" not in error_response(timeout).headers


def test_per_tenant_series_appear_on_metrics_with_a_bounded_label_set(server: Server) -> None:
    before = metric_samples(server.url)
    for key, n in ((ACME_KEY, 2), (NIGHTLY_KEY, 1)):
        with server.http(key) as http:
            for _ in range(n):
                assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sk-guess-0000000000000000"})
    after = metric_samples(server.url)

    def delta(name: str, tenant: str) -> float:
        key = (name, (("tenant", tenant),))
        return after[key] - before.get(key, 0.0)

    assert delta("distserve:tenant_requests_admitted_total", "acme") == 2
    assert delta("distserve:tenant_requests_admitted_total", "nightly") == 1
    assert delta("distserve:tenant_time_to_first_token_seconds_count", "acme") == 2
    assert delta("distserve:tenant_time_to_first_token_seconds_count", "nightly") == 1
    assert delta("distserve:tenant_requests_admitted_total", "anonymous") == 0
    assert after[("distserve:requests_unauthenticated_total", ())] >= before[("distserve:requests_unauthenticated_total", ())] + 1
    tenants = {dict(labels)["tenant"] for (name, labels) in after if name.startswith("distserve:tenant_")}
    assert tenants == {"acme", "nightly", "anonymous", "other"}


def test_without_keys_everyone_is_the_anonymous_tenant() -> None:
    srv = Server(None)
    try:
        with httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": "Bearer anything"}) as http:
            done = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert done.status_code == 200 and srv.client.classes[done.json()["id"]] == RequestClass()
            s = http.post("/v1/session").json()
            assert http.get(f"/v1/session/{s['session_id']}", params=s).status_code == 200
        samples = metric_samples(srv.url)
        assert samples[("distserve:tenant_requests_admitted_total", (("tenant", "anonymous"),))] == 1
        assert {dict(labels)["tenant"] for (name, labels) in samples if name.startswith("distserve:tenant_")} == {"anonymous", "other"}
    finally:
        srv.stop()
