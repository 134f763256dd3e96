"""Structured output over HTTP with the official ``openai`` client on the tiny random model: ``response_format``
(json_schema, json_object), vLLM's ``guided_*`` and ``structured_outputs``, forced tool calls (``tool_choice``
"required" or a named function) returned as ``tool_calls``, and 400s naming the field for bad specs.

The tiny model's weights are random, so every output here is what constrained decoding made of noise:
schemas keep their strings bounded (enums) so the noise ends within ``max_tokens``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from distserve.config import CacheConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.runtime.threaded_client import ThreadedEngineClient
from serving_util import HttpServer

pytestmark = pytest.mark.timeout(120)
CACHE = CacheConfig(num_blocks=1024, block_size=16)
# A chat template that renders tools (as Hermes/Qwen templates do), so requests with tools are accepted.
TEMPLATE = (
    "{%- if tools %}<|system|>\nTools: {% for tool in tools %}{{ tool | tojson }}{% endfor %}</s>\n{% endif %}"
    "{%- for message in messages %}<|{{ message.role }}|>\n{{ message.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["Paris", "Rome", "Lyon"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "confidence"], "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    loaded = load_model("tiny")
    loaded.tokenizer.hf.chat_template = TEMPLATE

    async def make_client() -> ThreadedEngineClient:
        return ThreadedEngineClient(LLMEngine(loaded, cache_config=CACHE))

    srv = HttpServer(make_client)
    yield srv
    srv.stop()


@pytest.fixture()
def oai(server: HttpServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def chat(oai: openai.OpenAI, **kw: Any) -> Any:
    return oai.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), max_completion_tokens=kw.pop("max_completion_tokens", 64),
                                       temperature=kw.pop("temperature", 0), **kw)


def test_json_schema_output_validates_and_streams_the_same(oai: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True}}
    resp = chat(oai, response_format=response_format)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(oai, response_format=response_format, stream=True) if c.choices)
    assert streamed == choice.message.content
    # Sampled, n = 2: each completion has its own matcher and is valid on its own.
    two = chat(oai, response_format=response_format, temperature=1.0, seed=5, n=2).choices
    assert len(two) == 2
    for c in two:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    obj = chat(oai, response_format={"type": "json_object"}, max_completion_tokens=24).choices[0]
    assert obj.message.content.startswith("{")  # any object; noise rarely closes one within 24 tokens
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)


def test_guided_choice_regex_grammar_on_both_endpoints(oai: openai.OpenAI) -> None:
    choices = ["yes", "no", "it depends"]
    got = chat(oai, extra_body={"guided_choice": choices}).choices[0]
    assert got.message.content in choices and got.finish_reason == "stop"
    regex = r"[A-Z][a-z]{1,6} [0-9]{1,3}"
    text = oai.completions.create(model="tiny", prompt="Room", max_tokens=16, temperature=0, extra_body={"guided_regex": regex}).choices[0].text
    assert re.fullmatch(regex, text), text
    text = oai.completions.create(model="tiny", prompt="Room", max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"regex": regex}}).choices[0].text
    assert re.fullmatch(regex, text), text
    grammar = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    text = oai.completions.create(model="tiny", prompt="Pairs", max_tokens=24, temperature=0.7, seed=1,
                                  extra_body={"guided_grammar": grammar}).choices[0]
    assert text.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", text.text), text.text
    cmpl = oai.completions.create(model="tiny", prompt="Answer:", max_tokens=48, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(cmpl.choices[0].text), SCHEMA)


def test_forced_tool_calls_come_back_as_tool_calls(oai: openai.OpenAI) -> None:
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for parallel in (None, False):
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        resp = chat(oai, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=3, max_completion_tokens=96, **kw).choices[0]
        assert resp.finish_reason == "tool_calls", resp.message.content
        assert resp.message.tool_calls and (parallel is None or len(resp.message.tool_calls) == 1)
        for call in resp.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"])
    # Noise may list calls until max_tokens (seed 0 does): the unfinished JSON is content, with no call.
    cut = chat(oai, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=0, max_completion_tokens=96).choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls and cut.message.content.startswith('[{"name": "get_')
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = chat(oai, tools=[WEATHER, TIME], tool_choice=named).choices[0]
    assert resp.finish_reason == "tool_calls" and not resp.message.content
    (call,) = resp.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    deltas = [c.choices[0] for c in chat(oai, tools=[WEATHER, TIME], tool_choice=named, stream=True) if c.choices]
    streamed = [d for c in deltas for d in c.delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in streamed] == [("get_weather", call.function.arguments)]
    assert deltas[-1].finish_reason == "tool_calls" and not "".join(c.delta.content or "" for c in deltas)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"regex": "[", "structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_structured_requests_are_400_naming_the_field(oai: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=ASK, max_completion_tokens=4, extra_body=body)  # type: ignore[call-overload]
    assert exc.value.body["param"] == param, exc.value.body  # type: ignore[index]


@pytest.mark.parametrize("argv", [["--structured-output-backend", "outlines"], ["--structured-output-backend", "outlines", "--ray-serve"]])
def test_serve_backend_flag_is_checked(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    from distserve.cli import main

    try:
        code = main(["serve", "--model", "tiny", *argv])
    except SystemExit as exc:  # argparse's own refusal (an unknown choice)
        code = exc.code
    assert code == 2 and "--structured-output-backend" in capsys.readouterr().err
