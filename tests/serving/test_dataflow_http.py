"""Parrot's semantic-variable API over HTTP, on the same server as the OpenAI API (tiny model, in-process engine)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from serving_util import HttpServer, colocated_server, wait_until

from distserve.config import CacheConfig, SamplingParams
from distserve.dataflow.limits import SessionLimits
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api import build_fastapi_app

pytestmark = pytest.mark.timeout(300)
CACHE = CacheConfig(num_blocks=256, block_size=16)
GREEDY = {"temperature": 0, "max_gen_length": 5, "ignore_tokenizer_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    srv = colocated_server(CACHE)
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

    # One by one, as ``dataflow.prompts`` documents: <s>, pieces encoded alone (a trailing space with the
    # text value after it), the summary as its generated ids.
    engine = LLMEngine(load_model("tiny"), cache_config=CACHE)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tok = engine.tokenizer

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    ref_s = engine.generate([[tok.bos_token_id, *enc("Doc:"), *enc(" bees make honey"), *enc(" Summary:"), *enc(" ")]], sp)[0]
    assert s_text == ref_s.text
    s_ids = list(ref_s.token_ids)
    while s_ids and s_ids[-1] in tok.skipped_token_ids:  # a trailing eos is not part of the value
        s_ids.pop()
    assert got.json()["content"] == engine.generate([[tok.bos_token_id, *enc("Title for"), *enc(" "), *s_ids, *enc(":"), *enc(" ")]], sp)[0].text


def test_sessions_are_private_and_bad_requests_name_the_problem(server: HttpServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        a = http.post("/v1/session").json()
        b = http.post("/v1/session").json()
        auth_a = {"session_id": a["session_id"], "session_auth": a["session_auth"]}
        auth_b = {"session_id": b["session_id"], "session_auth": b["session_auth"]}
        var = http.post("/v1/semantic_var", json={**auth_a, "var_name": "x"}).json()["var_id"]
        foreign = http.post("/v1/semantic_var", json={**auth_b, "var_name": "y"}).json()["var_id"]
        generated = call(http, auth_a, "G: {{g}}", [{"name": "g", "is_output": True, "sampling_config": GREEDY}]).json()["param_info"][0]["var_id"]
        # Another session's token, another session's variable, an unknown session.
        assert http.post("/v1/semantic_var", json={"session_id": a["session_id"], "session_auth": b["session_auth"]}).status_code == 403
        assert http.post(f"/v1/semantic_var/{var}", json={**auth_b, "content": "stolen"}).status_code == 404
        assert http.post("/v1/semantic_var", json={"session_id": 99999, "session_auth": "x"}).status_code == 404
        out = {"name": "x", "is_output": True}
        cases = [
            ({"template": "Hi {{x}}{{y}}", "placeholders": [out, {"name": "y", "is_output": True}]}, 400, "adjacent", "template"),
            ({"template": "Hi {{ x }}", "placeholders": [out]}, 400, "malformed", "template"),
            ({"template": "{{x}} then {{x}}", "placeholders": [out]}, 400, "more than once", "template"),
            ({"template": "{{a}} {{x}}", "placeholders": [{"name": "a", "var_id": "nope"}, out]}, 404, "no semantic variable", "var_id"),
            ({"template": "{{a}} {{x}}", "placeholders": [{"name": "a", "var_id": foreign}, out]}, 404, "no semantic variable", "var_id"),
            ({"template": "{{a}} {{x}}", "placeholders": [{"name": "a", "value": "v", "transforms": [{"op": "eval"}]}, out]}, 400, "unknown op", "transforms"),
            ({"template": "{{x}}", "placeholders": [out], "output_criteria": "fast"}, 400, "output_criteria", "output_criteria"),
            ({"template": "{{x}}", "placeholders": [out], "model_type": "tokens"}, 400, "model_type", "model_type"),
            ({"template": "{{x}}", "placeholders": [out], "colour": 1}, 400, "unknown fields", "colour"),
        ]
        for extra, status, message, param in cases:
            r = http.post("/v1/semantic_call", json={**auth_a, **extra})
            assert r.status_code == status and message in r.json()["error"]["message"] and r.json()["error"]["param"] == param, r.text
        r = http.post(f"/v1/semantic_var/{generated}", json={**auth_a, "content": "forged"})
        assert r.status_code == 409 and "generated by call" in r.json()["error"]["message"], r.text  # a conflict with its state
        r = http.post(f"/v1/semantic_var/{var}", json={**auth_a, "content": "v"})
        assert r.status_code == 200
        r = http.post(f"/v1/semantic_var/{var}", json={**auth_a, "content": "w"})
        assert r.status_code == 409 and "already set" in r.json()["error"]["message"] and r.json()["error"]["code"] == "variable_taken", r.text
        assert http.post("/v1/py_native_call", json=auth_a).status_code == 400
        for path in (f"/v1/semantic_var/{var}", f"/v1/semantic_var/{var}/stream"):
            r = http.get(path, params={**auth_a, "criteria": "soon"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "criteria", r.text
            assert http.get(path.replace(var, "s1-v999"), params=auth_a).status_code == 404
        pending = http.post("/v1/semantic_var", json={**auth_a, "var_name": "never"}).json()["var_id"]
        assert http.get(f"/v1/semantic_var/{pending}", params={**auth_a, "timeout": 0.05}).status_code == 408
        # After all that the session still runs calls, and the OpenAI API on the same port still works.
        good = call(http, auth_a, "{{v}} ok {{o}}", [{"name": "v", "var_id": var}, {"name": "o", "is_output": True, "sampling_config": GREEDY}])
        assert good.status_code == 200, good.text
        assert http.get(f"/v1/semantic_var/{good.json()['param_info'][1]['var_id']}", params={**auth_a, "timeout": 60}).status_code == 200
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200
        # A deleted session is gone.
        assert http.request("DELETE", f"/v1/session/{a['session_id']}", json=auth_a).status_code == 200
        assert http.request("GET", f"/v1/session/{a['session_id']}", json=auth_a).status_code == 404


def test_a_consumer_submitted_before_its_producer_into_created_variables_gets_the_producers_value(server: HttpServer) -> None:
    def out(name: str, var_id: str | None = None) -> dict[str, Any]:
        return {"name": name, "is_output": True, "sampling_config": GREEDY, **({"var_id": var_id} if var_id else {})}

    def new_session(http: httpx.Client) -> dict[str, Any]:
        created = http.post("/v1/session").json()
        return {"session_id": created["session_id"], "session_auth": created["session_auth"]}

    produce, consume = "Doc: bees make honey. Summary: {{s}}", "Title for {{t}}: {{title}}"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        ref_auth = new_session(http)  # the reference: producer first, server-assigned ids
        summary_ref = call(http, ref_auth, produce, [out("s")]).json()["param_info"][0]["var_id"]
        title_ref = call(http, ref_auth, consume, [{"name": "t", "var_id": summary_ref}, out("title")]).json()["param_info"][1]["var_id"]
        expected = http.get(f"/v1/semantic_var/{title_ref}", params={**ref_auth, "timeout": 60}).json()["content"]

        auth = new_session(http)
        summary, title, given = (http.post("/v1/semantic_var", json={**auth, "var_name": n}).json()["var_id"] for n in ("summary", "title", "given"))
        consumer = call(http, auth, consume, [{"name": "t", "var_id": summary}, out("title", title)], output_criteria="latency")
        assert consumer.status_code == 200, consumer.text
        info = {p["placeholder_name"]: p for p in consumer.json()["param_info"]}
        assert info["title"]["var_id"] == title and info["title"]["is_output"] and info["t"]["var_id"] == summary
        assert http.get(f"/v1/semantic_var/{title}", params={**auth, "timeout": 0.1}).status_code == 408  # no producer yet: it waits
        producer = call(http, auth, produce, [out("s", summary)])
        assert producer.status_code == 200, producer.text
        got = http.get(f"/v1/semantic_var/{title}", params={**auth, "timeout": 60})
        assert got.status_code == 200 and got.json()["content"] == expected, got.text
        listed = {v["var_id"]: v["producer"] for v in http.get("/v1/semantic_var", params=auth).json()["variables"]}
        assert listed[summary] == producer.json()["call_id"] and listed[title] == consumer.json()["call_id"]

        assert http.post(f"/v1/semantic_var/{given}", json={**auth, "content": "v"}).status_code == 200
        foreign = http.post("/v1/semantic_var", json={**ref_auth, "var_name": "theirs"}).json()["var_id"]
        free = http.post("/v1/semantic_var", json={**auth, "var_name": "free"}).json()["var_id"]
        num_calls = http.get(f"/v1/session/{auth['session_id']}", params=auth).json()["num_calls"]
        for placeholders, status, message in [
            ([out("x", summary)], 409, f"already generated by call {producer.json()['call_id']}"),
            ([out("x", given)], 409, "already set"),
            ([out("x", foreign)], 404, "no semantic variable"),
            ([out("x", free), {"name": "between", "value": ", "}, out("y", free)], 400, "output 'x' of the same call"),
        ]:
            template = "A {{x}}{{between}}B {{y}}" if len(placeholders) == 3 else "A {{x}}"
            r = call(http, auth, template, placeholders)
            assert r.status_code == status and message in r.json()["error"]["message"] and r.json()["error"]["param"] == "var_id", r.text
            assert placeholders[0]["var_id"] in r.json()["error"]["message"]
        assert http.get(f"/v1/session/{auth['session_id']}", params=auth).json()["num_calls"] == num_calls  # refused calls add nothing


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            yield "[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: "):])


def test_a_variable_streams_its_generation_and_a_reader_leaving_does_not_stop_the_call(server: HttpServer) -> None:
    long = {"temperature": 0, "max_gen_length": 900, "ignore_tokenizer_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        s = http.post("/v1/session").json()
        auth = {"session_id": s["session_id"], "session_auth": s["session_auth"]}
        info = call(http, auth, "Story: {{story}}", [{"name": "story", "is_output": True, "sampling_config": GREEDY}]).json()
        story = info["param_info"][0]["var_id"]
        with http.stream("GET", f"/v1/semantic_var/{story}/stream", json={**auth, "criteria": "latency"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = list(sse_events(r.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2] == {"var_id": story, "content": "".join(e["delta"] for e in events[:-2])}
        assert events[-2]["content"] == http.get(f"/v1/semantic_var/{story}", params=auth).json()["content"]

        # A long call; its only reader disconnects after the first delta.
        long_var = call(http, auth, "Saga: {{saga}}", [{"name": "saga", "is_output": True, "sampling_config": long}]).json()["param_info"][0]["var_id"]
        with http.stream("GET", f"/v1/semantic_var/{long_var}/stream", json=auth) as r:
            first = next(sse_events(r.iter_lines()))
        assert "delta" in first

        def state() -> dict[str, Any]:
            return http.get(f"/v1/session/{s['session_id']}", params=auth).json()  # type: ignore[no-any-return]

        assert wait_until(lambda: state()["num_readers"] == 0), "the server did not notice the reader leaving"
        assert state()["calls"]["running"] == 1  # the reader left while the call was generating ...
        r = http.get(f"/v1/semantic_var/{long_var}", params={**auth, "timeout": 60})
        assert r.status_code == 200 and r.json()["content"].startswith(first["delta"])  # ... and it ran to the end
        assert state()["calls"] == {"waiting": 0, "running": 0, "done": 2, "failed": 0}


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
        assert r.status_code == 424 and f"call {second['call_id']} failed: regex" in r.json()["error"]["message"]
        with http.stream("GET", f"/v1/semantic_var/{m}/stream", params=auth) as streamed:
            events = list(sse_events(streamed.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["status"] == 424 and f"call {second['call_id']} failed" in events[-2]["error"]["message"]
        pending = http.post("/v1/semantic_var", json={**auth, "var_name": "never"}).json()["var_id"]
        with http.stream("GET", f"/v1/semantic_var/{pending}/stream", params={**auth, "timeout": 0.1}) as streamed:
            assert list(sse_events(streamed.iter_lines()))[-2]["status"] == 408


@pytest.fixture(scope="module")
def engine_client() -> Iterator[ThreadedEngineClient]:
    c = ThreadedEngineClient(LLMEngine(load_model("tiny"), cache_config=CACHE))
    yield c
    c.close()


def test_limits_answer_429_and_413_naming_the_limit(engine_client: ThreadedEngineClient) -> None:
    limits = SessionLimits(max_sessions=2, max_variables=3, max_pending_calls=1, max_value_chars=40)
    with TestClient(build_fastapi_app(engine_client, "tiny", session_limits=limits)) as http:
        s = http.post("/v1/session").json()
        auth = {"session_id": s["session_id"], "session_auth": s["session_auth"]}
        http.post("/v1/session")
        r = http.post("/v1/session")
        assert r.status_code == 429 and "maximum of 2 sessions" in r.json()["error"]["message"] and "Retry-After" in r.headers
        out = {"name": "x", "is_output": True}
        assert call(http, auth, "Waits: {{x}}", [out]).status_code == 200  # not read: stays pending
        r = call(http, auth, "More: {{x}}", [out])
        assert r.status_code == 429 and "unfinished calls (max 1)" in r.json()["error"]["message"], r.text
        var = http.post("/v1/semantic_var", json=auth).json()["var_id"]
        for body, param in (({**auth, "content": "x" * 41}, "content"),):
            r = http.post(f"/v1/semantic_var/{var}", json=body)
            assert r.status_code == 413 and r.json()["error"]["param"] == param and "at most 40 characters" in r.json()["error"]["message"]
        r = call(http, auth, "{{a}} {{x}}", [{"name": "a", "value": "y" * 41}, out])
        assert r.status_code == 413 and "at most 40 characters" in r.json()["error"]["message"], r.text
        assert http.post("/v1/semantic_var", json=auth).status_code == 200  # the third variable
        r = http.post("/v1/semantic_var", json=auth)
        assert r.status_code == 429 and "maximum of 3 variables" in r.json()["error"]["message"]
        assert http.post(f"/v1/semantic_var/{var}", json={**auth, "content": "fits"}).status_code == 200  # still working


class SessionClock:
    """The sessions' idle clock, moved by the test: on a loaded machine a real 0.3 s TTL could expire while the
    test is still setting up (the background sweep and the aborts it causes stay real)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_idle_sessions_end_in_the_background_and_their_calls_are_aborted(engine_client: ThreadedEngineClient) -> None:
    long = {"temperature": 0, "max_gen_length": 900, "ignore_tokenizer_eos": True}
    ttl_s = 0.3  # the background sweep runs every ttl_s / 4 (real seconds)
    app = build_fastapi_app(engine_client, "tiny", session_limits=SessionLimits(ttl_s=ttl_s))
    clock = app.state.sessions._clock = SessionClock()
    with TestClient(app) as http:
        idle, busy = (http.post("/v1/session").json() for _ in range(2))
        for s in (idle, busy):  # the same long call in each: left alone, they would finish together
            r = call(http, s, "Go: {{x}}", [{"name": "x", "is_output": True, "sampling_config": long}], output_criteria="throughput")
            assert r.status_code == 200
        # A call reaches the engine from the app's executor, after its POST has answered.
        assert wait_until(lambda: engine_client.num_outstanding == 2, 5), "both calls should be running"

        def busy_info() -> dict[str, Any]:  # each access restarts the busy session's idle clock
            return http.get(f"/v1/session/{busy['session_id']}", params=busy).json()  # type: ignore[no-any-return]

        clock.now = ttl_s / 2
        assert busy_info()["calls"]["running"] == 1  # both sessions are within the TTL: neither call was aborted
        assert engine_client.num_outstanding == 2
        clock.now = ttl_s * 1.2  # the idle session (last touched at 0) is past its TTL, the busy one (at ttl_s / 2) is not
        assert wait_until(lambda: busy_info() is not None and engine_client.num_outstanding == 1, 5), "no call was aborted"
        assert busy_info()["calls"]["running"] == 1  # the busy session's twin call still runs: the idle one's was aborted
        r = http.get(f"/v1/session/{idle['session_id']}", params=idle)
        assert r.status_code == 404 and "expired" in r.json()["error"]["message"]
        assert http.request("DELETE", f"/v1/session/{busy['session_id']}", json=busy).status_code == 200
        assert wait_until(lambda: engine_client.num_outstanding == 0, 5)  # deleting a session aborts its calls too


def test_serve_flags_and_ray_serve_args_set_the_session_limits() -> None:
    from distserve.cli.args import build_parser
    from distserve.cli.serve import session_limits
    from distserve.serving.app_config import ServeAppConfig

    flags = ["serve", "--session-ttl", "5", "--max-sessions", "3", "--max-variables", "7", "--max-pending-calls", "2", "--max-value-chars", "99"]
    expected = SessionLimits(ttl_s=5, max_sessions=3, max_variables=7, max_pending_calls=2, max_value_chars=99)
    assert session_limits(build_parser().parse_args(flags)) == expected
    assert session_limits(build_parser().parse_args(["serve"])) == SessionLimits()
    assert ServeAppConfig.from_args({"session_ttl": "5", "max_sessions": "3", "max_variables": "7", "max_pending_calls": "2",
                                     "max_value_chars": "99"}).resolve().session_limits == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-sessions", "0"])
