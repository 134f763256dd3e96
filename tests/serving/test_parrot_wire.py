"""The exact requests Parrot's released frontend (``parrot.P``: ``VirtualMachine``, semantic
functions, ``SemanticVariable.get``) sends, replayed against our server, with its response models'
expectations checked.

Parrot's frontend is not on PyPI (the only registry this machine reaches), so it cannot be run
here; this test transcribes what it sends from microsoft/ParrotServe
``parrot/frontend/pfunc/vm.py``, ``function.py`` (``SemanticCall.to_request_payload``) and
``parrot/protocol/public/apis.py``:

* ``register_session``: ``POST /v1/session`` with ``{"api_key": ...}`` → ``session_id: int``,
  ``session_auth: str``;
* ``register_semantic_variable`` / ``set_semantic_variable``: ``session_id``, ``session_auth``,
  ``var_name`` / ``content``;
* ``submit_semantic_call``: ``session_id`` and the payload — the function's metadata (``models``,
  ``model_type``, ``remove_pure_fill``, ``cache_prefix``, ``output_criteria``, ``fuse_fill``),
  ``template``, ``parameters`` (inputs with ``var_id`` or ``value``; outputs with a full
  ``SamplingConfig``) and ``func_name`` — **without** ``session_auth``; it parses ``request_id``
  as an int and reads ``param_info[i]["parameter_name"]`` and ``["var_id"]``;
* ``get_semantic_variable``: a GET with a JSON body ``session_id``, ``session_auth``, ``criteria``
  → ``content: str``; ``remove_session``: a DELETE with ``session_auth`` in the body.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from distserve.config import CacheConfig
from distserve.dataflow.limits import SessionLimits
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api import build_fastapi_app

pytestmark = pytest.mark.timeout(300)

# Parrot's ``asdict(SamplingConfig(...))``: every field, greedy and fixed-length here.
SAMPLING_CONFIG = {
    "temperature": 0.0, "top_p": 1.0, "max_gen_length": 6, "ignore_tokenizer_eos": True, "stop_token_ids": [],
    "stop_str": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "n": 1, "best_of": 1, "logit_bias": None,
    "repetition_penalty": 0.0, "length_penalty": 0.0,
}
# ``SemanticCallMetadata.get_default_dict()``
METADATA = {"models": [], "model_type": "token_id", "remove_pure_fill": True, "cache_prefix": True, "output_criteria": None, "fuse_fill": False}


@pytest.fixture(scope="module")
def engine_client() -> Iterator[ThreadedEngineClient]:
    c = ThreadedEngineClient(LLMEngine(load_model("tiny"), cache_config=CacheConfig(num_blocks=256, block_size=16)))
    yield c
    c.close()


def _program(http: TestClient) -> tuple[dict[str, Any], Any]:
    """A Parrot program: a registered input variable set by the client, a call with it and a literal
    input, then a second call reading the first one's output; the second output is read."""
    s = http.post("/v1/session", json={"api_key": "1"}).json()
    assert isinstance(s["session_id"], int) and isinstance(s["session_auth"], str)
    auth = {"session_id": s["session_id"], "session_auth": s["session_auth"]}
    topic = http.post("/v1/semantic_var", json={**auth, "var_name": "topic"}).json()["var_id"]
    assert isinstance(topic, str)
    assert http.post(f"/v1/semantic_var/{topic}", json={**auth, "content": "bees"}).status_code == 200

    def submit(template: str, parameters: list[dict[str, Any]], name: str) -> Any:
        payload = {**METADATA, "template": template, "parameters": parameters, "func_name": name}
        return http.post("/v1/semantic_call", json={"session_id": s["session_id"], **payload})  # no session_auth

    return auth, (topic, submit)


def test_a_parrot_frontend_program_runs_when_unauthenticated_calls_are_allowed(engine_client: ThreadedEngineClient) -> None:
    app = build_fastapi_app(engine_client, "tiny", session_limits=SessionLimits(require_auth_on_calls=False))
    with TestClient(app) as http:
        auth, (topic, submit) = _program(http)
        r = submit("About {{topic}} in {{style}} style: {{idea}}", [
            {"name": "topic", "is_output": False, "var_id": topic},
            {"name": "style", "is_output": False, "value": "plain"},
            {"name": "idea", "is_output": True, "sampling_config": SAMPLING_CONFIG},
        ], "ideate")
        assert r.status_code == 200, r.text
        first = r.json()
        assert isinstance(first["request_id"], int)
        by_name = {p["parameter_name"]: p["var_id"] for p in first["param_info"]}
        assert set(by_name) == {"topic", "idea"} and by_name["topic"] == topic  # a literal has no variable
        r = submit("{{idea}} In short: {{short}}", [
            {"name": "idea", "is_output": False, "var_id": by_name["idea"]},
            {"name": "short", "is_output": True, "sampling_config": SAMPLING_CONFIG},
        ], "shorten")
        assert r.status_code == 200, r.text
        second = r.json()
        assert second["request_id"] != first["request_id"]
        short = {p["parameter_name"]: p["var_id"] for p in second["param_info"]}["short"]
        got = http.request("GET", f"/v1/semantic_var/{short}", json={**auth, "criteria": "latency"})
        assert got.status_code == 200 and isinstance(got.json()["content"], str) and got.json()["content"]
        info = http.request("GET", f"/v1/session/{auth['session_id']}", json={"session_auth": auth["session_auth"]})
        assert info.status_code == 200 and info.json()["calls"]["done"] == 2
        # A wrong token is still refused, on calls too; the token still guards every other route.
        r = http.post("/v1/semantic_call", json={**auth, "session_auth": "wrong", **METADATA, "template": "{{x}}",
                                                 "parameters": [{"name": "x", "is_output": True}]})
        assert r.status_code == 403 and r.json()["error"]["param"] == "session_auth"
        r = http.request("GET", f"/v1/semantic_var/{short}", json={"session_id": auth["session_id"], "criteria": "latency"})
        assert r.status_code == 403
        assert http.request("DELETE", f"/v1/session/{auth['session_id']}", json={"session_auth": auth["session_auth"]}).status_code == 200


def test_by_default_every_call_needs_the_session_token(engine_client: ThreadedEngineClient) -> None:
    with TestClient(build_fastapi_app(engine_client, "tiny")) as http:
        auth, (topic, submit) = _program(http)
        r = submit("About {{topic}}: {{idea}}", [
            {"name": "topic", "is_output": False, "var_id": topic},
            {"name": "idea", "is_output": True, "sampling_config": SAMPLING_CONFIG},
        ], "ideate")
        assert r.status_code == 403 and r.json()["error"]["param"] == "session_auth"
        assert "--parrot-unauthenticated-calls" in r.json()["error"]["message"]  # the way out, named
        r = http.post("/v1/semantic_call", json={**auth, **METADATA, "func_name": "ideate", "template": "About {{topic}}: {{idea}}",
                                                 "parameters": [{"name": "topic", "is_output": False, "var_id": topic},
                                                                {"name": "idea", "is_output": True, "sampling_config": SAMPLING_CONFIG}]})
        assert r.status_code == 200, r.text
