"""vLLM's request fields and operational routes over HTTP: unsupported fields refused by name (their defaults
accepted), unknown fields logged once, ``truncate_prompt_tokens``, ``skip_special_tokens``, ``add_special_tokens``,
``chat_template_kwargs``, ``continue_final_message``, ``X-Request-Id``, ``/tokenize``, ``/detokenize``,
``/version``, ``/ping``, a server chat template and CORS."""

from __future__ import annotations

import importlib.metadata
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving_util import HttpServer, ScriptedTokens, colocated_server, wait_until

from distserve.config import CacheConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.cors import CorsOptions
from distserve.serving.request_fields import UNSUPPORTED
from distserve.serving.request_ids import MAX_REQUEST_ID_CHARS

pytestmark = pytest.mark.timeout(120)

CACHE = CacheConfig(num_blocks=256, block_size=16)
# The server's --chat-template: it reads a template variable (``shout``) that only chat_template_kwargs sets.
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ (m.content | upper) if shout else m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
ORIGIN = "http://app.example"
CHAT = [{"role": "user", "content": "hello there"}]
# A value that asks for something, for every field of the registry (a new entry needs one here).
ASKING: dict[str, Any] = {
    "suffix": "the end", "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "store": True, "metadata": {"k": "v"},
    "service_tier": "flex", "reasoning_effort": "low", "verbosity": "high", "functions": [{"name": "f"}],
    "function_call": "auto", "prompt_embeds": "AAAA", "use_beam_search": True, "length_penalty": 0.5,
    "allowed_token_ids": [1, 2], "bad_words": ["x"], "spaces_between_special_tokens": False, "include_reasoning": False,
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages }}", "mm_processor_kwargs": {"a": 1},
    "return_tokens_as_token_ids": True, "logits_processors": ["my.Proc"], "kv_transfer_params": {"do_remote_prefill": True},
    "vllm_xargs": {"a": 1}, "cache_salt": "salt", "stream_options.continuous_usage_stats": True,
}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="module")
def live(tiny: LoadedModel) -> Iterator[tuple[HttpServer, ScriptedTokens]]:
    engine = LLMEngine(tiny, cache_config=CACHE)
    script = ScriptedTokens(engine)

    async def make_client() -> ThreadedEngineClient:
        return ThreadedEngineClient(engine)

    server = HttpServer(make_client, chat_template=TEMPLATE, cors=CorsOptions((ORIGIN,)))
    yield server, script
    server.stop()


@pytest.fixture()
def http(live: tuple[HttpServer, ScriptedTokens]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live[0].url, timeout=60) as client:
        yield client
    live[1].say(None)


def body_with(field: str, value: Any, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": CHAT} if chat else {"prompt": "hello"}
    body["max_tokens"] = 2
    if field.startswith("stream_options."):
        body.update(stream=True, stream_options={field.split(".", 1)[1]: value})
    else:
        body[field] = value
    return body


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_unsupported_field_is_refused_naming_it(http: httpx.Client, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for field in UNSUPPORTED:
        r = http.post(path, json=body_with(field, ASKING[field], chat))
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_an_unsupported_field_at_its_default_is_accepted(http: httpx.Client, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for field, entry in UNSUPPORTED.items():
        for value in (None, *entry.defaults):
            r = http.post(path, json=body_with(field, value, chat))
            assert r.status_code == 200, (field, value, r.text)
    # A default's JSON type counts: 1 is not true, "false" is not false.
    assert http.post("/v1/completions", json=body_with("use_beam_search", 0, False)).status_code == 400
    assert http.post("/v1/completions", json=body_with("store", "false", False)).status_code == 400


def test_unknown_fields_are_accepted_and_logged_once_per_name(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="distserve.serving.request_fields")
    for _ in range(3):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "my_custom_key": 1, "temprature": 0.5})
        assert r.status_code == 200
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "distserve.serving.request_fields"]
    assert sum("'my_custom_key'" in m for m in logged) == 1 and sum("'temprature'" in m for m in logged) == 1


def test_truncate_prompt_tokens_keeps_the_last_tokens(http: httpx.Client, tiny: LoadedModel) -> None:
    prompt = "a long prompt that gets cut"
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5
    tail = tiny.tokenizer.encode(prompt)[-5:]
    same = http.post("/v1/completions", json={"prompt": tail, "max_tokens": 2, "temperature": 0})
    assert same.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "truncate_prompt_tokens": 4})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 4
    for bad, status in ((0, 400), (10**6, 400)):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": bad})
        assert r.status_code == status and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_add_special_tokens_false_sends_the_prompt_without_bos(http: httpx.Client, tiny: LoadedModel) -> None:
    prompt = "no bos please"
    with_bos = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    without = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "add_special_tokens": False}).json()
    assert with_bos == len(tiny.tokenizer.encode(prompt)) and without["usage"]["prompt_tokens"] == with_bos - 1


def test_tokenize_counts_what_a_completion_is_prefilled_with(http: httpx.Client, tiny: LoadedModel) -> None:
    tok = http.post("/tokenize", json={"prompt": "count me", "return_token_strs": True}).json()
    assert tok["tokens"] == tiny.tokenizer.encode("count me") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 1024 and tok["token_strs"][0] == "<s>"
    usage = http.post("/v1/completions", json={"prompt": "count me", "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == tok["count"]
    no_bos = http.post("/tokenize", json={"prompt": "count me", "add_special_tokens": False}).json()
    assert no_bos["tokens"] == tok["tokens"][1:] and no_bos["token_strs"] is None
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == tiny.tokenizer.encode("[user]hello there\n[assistant]", add_special_tokens=False)  # the server's template
    assert http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()["usage"]["prompt_tokens"] == chat["count"]
    no_prompt = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert chat["tokens"][: no_prompt["count"]] == no_prompt["tokens"] and no_prompt["count"] < chat["count"]
    assert http.post("/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404
    assert http.post("/tokenize", json={"nothing": 1}).json()["error"]["param"] == "prompt"
    assert http.post("/tokenize", content=b"[1, 2]").status_code == 400


def test_chat_template_kwargs_and_continue_final_message(http: httpx.Client, tiny: LoadedModel) -> None:
    def rendered(**fields: Any) -> str:
        r = http.post("/tokenize", json={"messages": fields.pop("messages", CHAT), **fields})
        assert r.status_code == 200, r.text
        return tiny.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)

    assert rendered() == "[user]hello there\n[assistant]"
    assert rendered(chat_template_kwargs={"shout": True}) == "[user]HELLO THERE\n[assistant]"
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"shout": True}})
    assert r.status_code == 200
    reserved = http.post("/v1/chat/completions", json={"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"
    open_turn = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    assert rendered(messages=open_turn, continue_final_message=True, add_generation_prompt=False).endswith("[assistant]The answer is")
    both = http.post("/v1/chat/completions", json={"messages": open_turn, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_skip_special_tokens_false_keeps_their_text_but_not_the_eos(live: tuple[HttpServer, ScriptedTokens], http: httpx.Client) -> None:
    live[1].say("a<pad>b")
    body = {"prompt": "hi", "max_tokens": 10, "temperature": 0}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == "ab"
    kept = http.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()["choices"][0]
    assert kept["text"] == "a<pad>b" and kept["finish_reason"] == "stop"
    with http.stream("POST", "/v1/completions", json={**body, "skip_special_tokens": False, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events) == "a<pad>b"


def test_x_request_id_names_the_request_and_is_echoed(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}, headers={"X-Request-Id": "a b#c/d"})
    assert r.headers["x-request-id"] == "a_b_c_d" and r.json()["id"] == "chatcmpl-a_b_c_d"
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "x" * 1000})
    assert r.headers["x-request-id"] == "x" * MAX_REQUEST_ID_CHARS
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "request_id": "from-body"})
    assert r.json()["id"] == "cmpl-from-body" and r.headers["x-request-id"] == "cmpl-from-body"
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-")
    bad = http.post("/v1/completions", json={"prompt": "hi", "suffix": "x"}, headers={"X-Request-Id": "failing"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "failing"


def test_a_repeated_request_id_in_flight_gets_a_suffix(live: tuple[HttpServer, ScriptedTokens], http: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 600, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "dup"}
    ids = []
    with http.stream("POST", "/v1/completions", json=body, headers=headers) as a, \
            http.stream("POST", "/v1/completions", json=body, headers=headers) as b:
        for r in (a, b):
            first = next(line for line in r.iter_lines() if line.startswith("data: {"))
            ids.append(json.loads(first.removeprefix("data: "))["id"])
            assert r.headers["x-request-id"] == "dup"
    assert sorted(ids) == ["cmpl-dup", "cmpl-dup-1"]
    in_flight = live[0].app.state.server.request_ids
    assert wait_until(lambda: len(in_flight) == 0)  # both streams closed: the ids are free again
    again = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
    assert again.json()["id"] == "cmpl-dup"


def test_detokenize_version_and_ping(http: httpx.Client, tiny: LoadedModel) -> None:
    ids = tiny.tokenizer.encode("round trip 日本")
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "<s>round trip 日本"}
    bad = http.post("/detokenize", json={"tokens": [1, tiny.tokenizer.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/detokenize", json={"tokens": [-1]}).json()["error"]["param"] == "tokens"
    assert http.get("/version").json() == {"version": importlib.metadata.version("distserve")}
    assert http.get("/ping").status_code == http.post("/ping").status_code == 200


def test_prompts_longer_than_the_context_name_the_prompt(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "x" * 1100, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 1100}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_cors_answers_allowed_origins_only(http: httpx.Client) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    r = http.options("/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = http.options("/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_no_cors_headers_by_default() -> None:
    server = colocated_server(CACHE)
    try:
        r = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
        r = httpx.options(f"{server.url}/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert r.status_code == 405 and not any(h.startswith("access-control-") for h in r.headers)
    finally:
        server.stop()
