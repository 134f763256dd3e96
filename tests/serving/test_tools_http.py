"""``tools`` / ``tool_choice`` over HTTP with the official ``openai`` client: the tools and earlier calls
go through the model's chat template, Hermes-style calls in the output come back as ``tool_calls``.

The tiny model's tokenizer gets a chat template that renders tools (as Hermes/Qwen templates do).
Its random weights never write a tool call, so the tests that need one script the sampled tokens:
the real engine runs the model on every step and the test picks the token (``ScriptedTokens``).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from distserve.config import CacheConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import InvalidConfigError
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api import build_fastapi_app
from distserve.serving.tool_parsers import HermesToolParser, ToolCallStream
from serving_util import ScriptedTokens

pytestmark = pytest.mark.timeout(120)

TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>\nYou may call these functions: <tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": <name>, "arguments": <args>}</tool_call></s>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|assistant|>\n"
    '{% for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}</s>\n"
    "{%- elif message.role == 'tool' %}<|tool|>\n<tool_response>{{ message.content }}</tool_response></s>\n"
    "{%- else %}<|{{ message.role }}|>\n{{ message.content }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TWO_CALLS = 'Checking both. ' + CALL + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
CACHE = CacheConfig(num_blocks=1024, block_size=16)


class Server:
    """The app (tool flags given) on uvicorn in a background thread, on a free loopback port."""

    def __init__(self, engine: LLMEngine, **app_kw: Any) -> None:
        self.client = ThreadedEngineClient(engine)
        app = build_fastapi_app(self.client, "tiny", **app_kw)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        self.openai = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.client.close()
        self.sock.close()


@pytest.fixture(scope="module")
def tools_model() -> LoadedModel:
    loaded = load_model("tiny")
    loaded.tokenizer.hf.chat_template = TOOLS_TEMPLATE
    return loaded


@pytest.fixture(scope="module")
def live(tools_model: LoadedModel) -> Iterator[tuple[Server, ScriptedTokens]]:
    engine = LLMEngine(tools_model, cache_config=CACHE)
    script = ScriptedTokens(engine)
    server = Server(engine, tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield server, script
    server.stop()


@pytest.fixture()
def oai(live: tuple[Server, ScriptedTokens]) -> Iterator[openai.OpenAI]:
    yield live[0].openai
    live[1].say(None)


def chat(oai: openai.OpenAI, **kw: Any) -> Any:
    return oai.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), max_completion_tokens=kw.pop("max_completion_tokens", 200), **kw)


def test_tools_and_earlier_calls_render_through_the_chat_template(live: tuple[Server, ScriptedTokens], oai: openai.OpenAI,
                                                                  tools_model: LoadedModel) -> None:
    tok = tools_model.tokenizer
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
    ]
    resp = chat(oai, messages=history, tools=[WEATHER], tool_choice="none", max_completion_tokens=3)
    rendered = tok.hf.apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"}],
        tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "<tools>" in rendered and '"city": "Paris"' in rendered and "<tool_response>sunny, 21 C</tool_response>" in rendered
    assert resp.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    without = chat(oai, max_completion_tokens=1)
    assert without.usage.prompt_tokens < chat(oai, tools=[WEATHER], max_completion_tokens=1).usage.prompt_tokens
    # tool_choice "none": a call the model writes is plain content.
    live[1].say(CALL)
    plain = chat(oai, tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def test_auto_returns_tool_calls(live: tuple[Server, ScriptedTokens], oai: openai.OpenAI) -> None:
    live[1].say("Let me check. " + CALL)
    resp = chat(oai, tools=[WEATHER])  # tool_choice defaults to "auto" when tools are given
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    live[1].say(TWO_CALLS)
    both = chat(oai, tools=[WEATHER, TIME], tool_choice="auto").choices[0]
    assert [c.function.name for c in both.message.tool_calls] == ["get_weather", "get_time"]
    one = chat(oai, tools=[WEATHER, TIME], parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]

    live[1].say('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>')  # not JSON: no call
    bad = chat(oai, tools=[WEATHER]).choices[0]
    assert bad.finish_reason == "stop" and not bad.message.tool_calls and bad.message.content.startswith("<tool_call>")
    live[1].say("It is sunny.")
    text = chat(oai, tools=[WEATHER]).choices[0]
    assert text.finish_reason == "stop" and text.message.content == "It is sunny." and not text.message.tool_calls


def test_streamed_tool_calls_match(live: tuple[Server, ScriptedTokens], oai: openai.OpenAI) -> None:
    live[1].say(TWO_CALLS)
    whole = chat(oai, tools=[WEATHER, TIME]).choices[0]
    content = ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chat(oai, tools=[WEATHER, TIME], stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == whole.message.content == "Checking both. "
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]
    live[1].say("No tools needed <tool")  # a partial tag held back, then sent as content
    streamed = "".join(c.delta.content or "" for chunk in chat(oai, tools=[WEATHER], stream=True) for c in chunk.choices)
    assert streamed == "No tools needed <tool"


def test_tool_requests_refused_with_the_param(live: tuple[Server, ScriptedTokens], oai: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": "auto"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            chat(oai, **body)
        assert exc.value.body["param"] == param, (body, exc.value.body)  # type: ignore[index]


def test_template_without_tools_and_auto_without_the_flags(tools_model: LoadedModel) -> None:
    plain = Server(LLMEngine(load_model("tiny"), cache_config=CACHE), tool_call_parser="hermes", enable_auto_tool_choice=True)
    no_auto = Server(LLMEngine(tools_model, cache_config=CACHE))
    try:
        resp = httpx.post(f"{plain.url}/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "tools" and "tiny" in error["message"]
        with pytest.raises(openai.BadRequestError) as exc:
            chat(no_auto.openai, tools=[WEATHER])
        assert exc.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in exc.value.body["message"]  # type: ignore[index]
        assert chat(no_auto.openai, tools=[WEATHER], tool_choice="none", max_completion_tokens=2).choices[0].finish_reason == "length"
    finally:
        plain.stop()
        no_auto.stop()
    with pytest.raises(InvalidConfigError):
        build_fastapi_app(ThreadedEngineClient(LLMEngine(tools_model, cache_config=CACHE)), "tiny", enable_auto_tool_choice=True)


@pytest.mark.parametrize("text", [TWO_CALLS, "plain text", "<tool_call>{bad", "a <tool_call>" + CALL[len("<tool_call>"):], "x <tool"])
def test_streaming_parser_equals_the_whole_text_parse(text: str) -> None:
    parser = HermesToolParser()
    whole = parser.extract(text)
    for step in (1, 3, 7):
        stream = ToolCallStream(parser)
        content = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
        rest, calls = stream.finish()
        assert (content + rest) == (whole.content or "" if whole.tool_calls else text)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]


@pytest.mark.parametrize("argv,needle", [
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--tool-call-parser", "nope"], "--tool-call-parser"),
])
def test_serve_tool_flags_are_checked(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    from distserve.cli import main

    try:
        code = main(["serve", "--model", "tiny", *argv])
    except SystemExit as exc:  # argparse's own refusal (an unknown choice)
        code = exc.code
    assert code == 2
    assert needle in capsys.readouterr().err
