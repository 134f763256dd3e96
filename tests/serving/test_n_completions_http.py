"""``n`` > 1 over HTTP with the official ``openai`` client: n choices from one prefill, streaming and not."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from distserve.config import CacheConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.frontend import EngineBase
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.threaded_client import ThreadedEngineClient
from serving_util import wait_until
from test_api_http import LiveServer

pytestmark = pytest.mark.timeout(120)

CACHE = CacheConfig(num_blocks=1024, block_size=16)
PROMPT = "Once upon a time, in a land far away"


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="module", params=["colocated", "disagg"])
def live(request: pytest.FixtureRequest, tiny: LoadedModel) -> Iterator[tuple[LiveServer, EngineBase]]:
    engine: EngineBase = LLMEngine(tiny, cache_config=CACHE) if request.param == "colocated" else LocalDisaggEngine(tiny, cache_config=CACHE)
    server = LiveServer(ThreadedEngineClient(engine))
    yield server, engine
    server.stop()


def prefill_tokens(engine: EngineBase) -> int:
    return int(engine.stats()["prefill_tokens_computed_total"])  # type: ignore[arg-type]


def test_completions_n(live: tuple[LiveServer, EngineBase]) -> None:
    server, engine = live
    oai = server.openai()
    num_prompt = len(engine.tokenizer.encode(PROMPT))
    before = prefill_tokens(engine)
    resp = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=4, seed=11, extra_body={"ignore_eos": True})
    assert prefill_tokens(engine) - before == num_prompt  # the prompt was prefilled once for the four
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert len({c.text for c in resp.choices}) > 1
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == num_prompt and resp.usage.completion_tokens == 4 * 6
    again = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=4, seed=11, best_of=4, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded: deterministic
    one = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, seed=11, extra_body={"ignore_eos": True})
    assert one.choices[0].text == resp.choices[0].text  # completion 0 is the n = 1 answer

    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=4, seed=11, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in resp.choices}
    assert finish == {i: "length" for i in range(4)}
    assert usage is not None and usage.prompt_tokens == num_prompt and usage.completion_tokens == 24
    assert wait_until(lambda: engine.num_requests == 0 and not engine.has_unfinished_requests())


def test_chat_n(live: tuple[LiveServer, EngineBase]) -> None:
    server, engine = live
    oai = server.openai()
    messages = [{"role": "user", "content": "Tell me a story."}]
    resp = oai.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5, n=3, seed=5,  # type: ignore[arg-type]
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 15
    content: dict[int, str] = {}
    roles: dict[int, int] = {}
    for chunk in oai.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5, n=3, seed=5,  # type: ignore[arg-type]
                                             stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            roles[c.index] = roles.get(c.index, 0) + (c.delta.role == "assistant")
    assert content == {c.index: c.message.content for c in resp.choices}
    assert roles == {0: 1, 1: 1, 2: 1}


def test_bad_n_and_best_of(live: tuple[LiveServer, EngineBase]) -> None:
    oai = live[0].openai()
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="tiny", prompt="hi", n=2, best_of=3)
    assert exc.value.body["param"] == "best_of"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="tiny", prompt="hi", n=100)  # more than a batch holds (max_num_seqs 64)
    assert exc.value.body["param"] == "n"  # type: ignore[index]
