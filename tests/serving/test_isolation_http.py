"""Isolation over HTTP with API keys, and nothing a client sends is executed (issue 20).

Sessions and variables of another tenant answer 404 (``test_tenants_http``); here: a client-chosen request id
(``X-Request-Id`` or the body's ``request_id``) can never make one tenant's request share, end or read another's;
chat messages and ``chat_template_kwargs`` are data to the (sandboxed) Jinja template, never template code; semantic
templates expand only their own ``{{placeholders}}``, never text inside values; native calls and per-request
templates are refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from distserve.config import CacheConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import load_model
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api_keys import load_api_keys
from serving_util import HttpServer, metric_samples, wait_until

pytestmark = pytest.mark.timeout(180)
ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef00"
KEYS = f"tenants:\n  alice: {{}}\n  bob: {{}}\nkeys:\n  {ALICE}: alice\n  {BOB}: bob\n"
# Renders a kwarg the way a template author would: as a value. The sandbox is what stands between a template and Python.
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if note %}(note: {{ note }}){% endif %}"
INJECTIONS = ["{{ 7 * 7 }}", "{% for x in range(3) %}loop{% endfor %}", "{{ ''.__class__.__mro__[1].__subclasses__() }}",
              "{{ cycler.__init__.__globals__.os.system('touch /tmp/pwned') }}"]


class SlowEngine(LLMEngine):
    """The real engine, each step at least 5 ms, so a long request is still running while the test acts."""

    def step(self) -> list[RequestOutput]:
        time.sleep(0.005)
        return super().step()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(KEYS)
    loaded = load_model("tiny")

    async def make_client() -> ThreadedEngineClient:
        return ThreadedEngineClient(SlowEngine(loaded, cache_config=CacheConfig(num_blocks=256, block_size=16)))

    srv = HttpServer(make_client, api_keys=load_api_keys(path), chat_template=TEMPLATE)
    yield srv
    srv.stop()


def prompt_tokens(server: HttpServer) -> float:
    return sum(v for (name, _), v in metric_samples(server.url).items() if name == "distserve:prompt_tokens_total")


def client(server: HttpServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def test_a_client_chosen_request_id_never_reaches_another_tenants_request(server: HttpServer) -> None:
    """Bob sends Alice's id (header and body) while her request runs, then hangs up: her request is untouched."""
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    alice_result: dict[str, Any] = {}

    def alice_request() -> None:
        with client(server, ALICE) as alice:
            resp = alice.post("/v1/completions", json=long, headers={"X-Request-Id": "shared-id"})
            alice_result.update(status=resp.status_code, body=resp.json(), header=resp.headers["x-request-id"])

    thread = threading.Thread(target=alice_request)
    thread.start()
    assert server.client is not None
    assert wait_until(lambda: server.client.num_outstanding == 1, 10)  # type: ignore[union-attr]
    with client(server, BOB) as bob:
        copied = bob.post("/v1/completions", json={**long, "max_tokens": 2}, headers={"X-Request-Id": "shared-id"})
        assert copied.status_code == 200 and copied.json()["id"] == "cmpl-shared-id-1"  # its own engine request
        by_body = bob.post("/v1/completions", json={**long, "max_tokens": 2, "request_id": "shared-id"})
        assert by_body.json()["id"] == "cmpl-shared-id-1"
        with bob.stream("POST", "/v1/completions", json={**long, "stream": True}, headers={"X-Request-Id": "shared-id"}) as stream:
            next(stream.iter_lines())  # started ...
        # ... and hung up: its abort names its own id, never Alice's
    thread.join(60)
    assert alice_result["status"] == 200 and alice_result["header"] == "shared-id"
    body = alice_result["body"]
    assert body["id"] == "cmpl-shared-id" and body["usage"]["completion_tokens"] == 60 and body["choices"][0]["finish_reason"] == "length"
    assert wait_until(lambda: server.client.num_outstanding == 0, 10)  # type: ignore[union-attr]


@pytest.mark.parametrize("injection", INJECTIONS)
def test_messages_and_template_kwargs_are_data_not_template_code(server: HttpServer, injection: str) -> None:
    with client(server, ALICE) as alice:
        resp = alice.post("/tokenize", json={"messages": [{"role": "user", "content": injection}], "chat_template_kwargs": {"note": injection}})
        assert resp.status_code == 200, resp.text
        text = alice.post("/detokenize", json={"tokens": resp.json()["tokens"]}).json()["prompt"]
        assert text == f"[user]{injection}(note: {injection})"  # rendered verbatim, twice: never evaluated
        chat = alice.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": injection}], "max_tokens": 2,
                                                        "chat_template_kwargs": {"note": injection}})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == resp.json()["count"]
    assert not Path("/tmp/pwned").exists()


def test_templates_run_in_a_sandbox_and_requests_cannot_bring_their_own(server: HttpServer) -> None:
    """transformers renders chat templates in Jinja's ImmutableSandboxedEnvironment: even the server's own template
    cannot reach Python internals. A request's own ``chat_template`` is refused outright."""
    assert server.client is not None
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match="unsafe|access to attribute"):
        server.client.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=escape)
    with client(server, ALICE) as alice:
        resp = alice.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "chat_template": escape})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template"
        native = alice.post("/v1/py_native_call", json={"code": "import os"})
        assert native.status_code == 400 and "never executes client code" in native.json()["error"]["message"]


def test_semantic_templates_expand_only_their_own_placeholders(server: HttpServer) -> None:
    """A value that looks like a placeholder or Jinja stays text; a template with anything else in ``{{ }}`` is refused."""
    with client(server, ALICE) as alice:
        s = alice.post("/v1/session").json()
        auth = {"session_id": s["session_id"], "session_auth": s["session_auth"]}
        value = "{{secret}} {{ 7*7 }} {% if 1 %}x{% endif %}"
        expected = alice.post("/tokenize", json={"prompt": f"Say {value} then "}).json()["count"]
        before = prompt_tokens(server)
        call = alice.post("/v1/semantic_call", json={**auth, "template": "Say {{a}} then {{out}}", "model_type": "text", "placeholders": [
            {"name": "a", "is_output": False, "value": value},
            {"name": "out", "is_output": True, "sampling_config": {"max_gen_length": 2, "temperature": 0}}]})
        assert call.status_code == 200, call.text
        out = next(p["var_id"] for p in call.json()["param_info"] if p["is_output"])
        assert alice.get(f"/v1/semantic_var/{out}", params={**auth, "timeout": 30}).status_code == 200
        assert prompt_tokens(server) - before == expected  # the prompt was the value's text, verbatim
        for template in ("{{ 7*7 }} {{out}}", "{{a.__class__}} {{out}}", "{% for x in y %}{{out}}"):
            bad = alice.post("/v1/semantic_call", json={**auth, "template": template, "placeholders": [
                {"name": "a", "is_output": False, "value": "x"}, {"name": "out", "is_output": True}]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] in ("template", "placeholders"), (template, bad.text)
        assert alice.request("DELETE", f"/v1/session/{s['session_id']}", json=auth).status_code == 200
