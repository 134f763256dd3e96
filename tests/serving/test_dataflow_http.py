"""Parrot's semantic-variable API over HTTP, on the same server as the OpenAI API (tiny model, in-process engine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving_util import HttpServer, colocated_tiny_server

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model

pytestmark = pytest.mark.timeout(300)
CACHE = CacheConfig(num_blocks=256, block_size=16)
GREEDY = {"temperature": 0, "max_gen_length": 5, "ignore_tokenizer_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    srv = colocated_tiny_server(CACHE)
    yield srv
    srv.stop()


def call(http: httpx.Client, session: dict[str, Any], template: str, placeholders: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return http.post("/v1/semantic_call", json={**session, "template": template, "placeholders": placeholders, **extra})


def test_a_parrot_style_program_runs_server_side_and_matches_one_by_one(server: HttpServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        session = http.post("/v1/session", json={}).json()
        assert set(session) == {"session_id", "session_auth"}
        auth = {"session_id": session["session_id"], "session_auth": session["session_auth"]}
        doc = http.post("/v1/semantic_var", json={**auth, "var_name": "doc"}).json()["var_id"]
        first = call(http, auth, "Doc: {{doc}} Summary: {{s}}", [
            {"name": "doc", "is_output": False, "var_id": doc}, {"name": "s", "is_output": True, "sampling_config": GREEDY}])
        assert first.status_code == 200, first.text
        summary = next(p["var_id"] for p in first.json()["param_info"] if p["placeholder_name"] == "s")
        second = call(http, auth, "Title for {{t}}: {{title}}", [
            {"name": "t", "is_output": False, "var_id": summary}, {"name": "title", "is_output": True, "sampling_config": GREEDY}],
            models=[], model_type="token_id", remove_pure_fill=True)
        title = next(p["var_id"] for p in second.json()["placeholders_mapping"] if p["placeholder_name"] == "title")
        assert http.post(f"/v1/semantic_var/{doc}", json={**auth, "content": "bees make honey"}).status_code == 200
        got = http.request("GET", f"/v1/semantic_var/{title}", json={**auth, "criteria": "latency"})  # Parrot: JSON body on GET
        assert got.status_code == 200, got.text
        listed = http.request("GET", "/v1/semantic_var", json=auth).json()["variables"]
        assert {v["var_id"] for v in listed} == {doc, summary, title}
        s_text = http.get(f"/v1/semantic_var/{summary}", params={**auth, "criteria": "throughput"}).json()["content"]

    engine = LLMEngine(load_model("tiny"), cache_config=CACHE)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref_s = engine.generate(["Doc: bees make honey Summary: "], sp)[0].text
    assert s_text == ref_s
    assert got.json()["content"] == engine.generate([f"Title for {ref_s}: "], sp)[0].text


def test_sessions_are_private_and_bad_requests_name_the_problem(server: HttpServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        a = http.post("/v1/session").json()
        b = http.post("/v1/session").json()
        auth_a = {"session_id": a["session_id"], "session_auth": a["session_auth"]}
        auth_b = {"session_id": b["session_id"], "session_auth": b["session_auth"]}
        var = http.post("/v1/semantic_var", json={**auth_a, "var_name": "x"}).json()["var_id"]
        # Another session's token, another session's variable, an unknown session.
        assert http.post("/v1/semantic_var", json={"session_id": a["session_id"], "session_auth": b["session_auth"]}).status_code == 403
        assert http.post(f"/v1/semantic_var/{var}", json={**auth_b, "content": "stolen"}).status_code == 404
        assert http.post("/v1/semantic_var", json={"session_id": 99999, "session_auth": "x"}).status_code == 404
        cases = [
            ({"template": "Hi {{x}}{{y}}", "placeholders": [{"name": "x", "is_output": True}, {"name": "y", "is_output": True}]}, "adjacent", "template"),
            ({"template": "Hi {{ x }}", "placeholders": [{"name": "x", "is_output": True}]}, "malformed", "template"),
            ({"template": "{{a}} {{x}}", "placeholders": [{"name": "a", "var_id": "nope"}, {"name": "x", "is_output": True}]}, "no semantic variable", "var_id"),
            ({"template": "{{x}}", "placeholders": [{"name": "x", "is_output": True}], "output_criteria": "fast"}, "output_criteria", "output_criteria"),
            ({"template": "{{x}}", "placeholders": [{"name": "x", "is_output": True}], "colour": 1}, "unknown fields", "colour"),
        ]
        for extra, message, param in cases:
            r = http.post("/v1/semantic_call", json={**auth_a, **extra})
            assert r.status_code in (400, 404) and message in r.json()["error"]["message"] and r.json()["error"]["param"] == param, r.text
        r = http.post(f"/v1/semantic_var/{var}", json={**auth_a, "content": "v"})
        assert r.status_code == 200
        assert "already set" in http.post(f"/v1/semantic_var/{var}", json={**auth_a, "content": "w"}).json()["error"]["message"]
        assert http.post("/v1/py_native_call", json=auth_a).status_code == 400
        r = http.get(f"/v1/semantic_var/{var}", params={**auth_a, "criteria": "soon"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "criteria"
        pending = http.post("/v1/semantic_var", json={**auth_a, "var_name": "never"}).json()["var_id"]
        assert http.get(f"/v1/semantic_var/{pending}", params={**auth_a, "timeout": 0.05}).status_code == 408
        # The OpenAI API on the same port still works, and a deleted session is gone.
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert http.request("DELETE", f"/v1/session/{a['session_id']}", json=auth_a).status_code == 200
        assert http.request("GET", f"/v1/session/{a['session_id']}", json=auth_a).status_code == 404


def test_a_failed_call_fails_its_downstream_reads_with_424(server: HttpServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        s = http.post("/v1/session").json()
        auth = {"session_id": s["session_id"], "session_auth": s["session_auth"]}
        first = call(http, auth, "Count: {{n}}", [{"name": "n", "is_output": True, "sampling_config": GREEDY}]).json()
        n = first["param_info"][0]["var_id"]
        second = call(http, auth, "{{v}} then {{m}}", [
            {"name": "v", "is_output": False, "var_id": n, "transforms": [{"op": "regex", "pattern": "^NO SUCH TEXT$"}]},
            {"name": "m", "is_output": True, "sampling_config": GREEDY}]).json()
        m = next(p["var_id"] for p in second["param_info"] if p["placeholder_name"] == "m")
        r = http.get(f"/v1/semantic_var/{m}", params={**auth, "criteria": "latency", "timeout": 60})
        assert r.status_code == 424 and f"call {second['request_id']} failed: regex" in r.json()["error"]["message"]
