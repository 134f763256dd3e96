"""Sampling parameters and logprobs over HTTP with the official ``openai`` client, on the in-process
disaggregated engine: top_logprobs, echo, prompt_logprobs, logit_bias, penalties, and bad values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.threaded_client import ThreadedEngineClient
from test_api_http import LiveServer

pytestmark = pytest.mark.timeout(120)

CACHE = CacheConfig(num_blocks=512, block_size=16)
PROMPT = "Once upon a time, in a land far away"
CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[LiveServer]:
    srv = LiveServer(ThreadedEngineClient(LocalDisaggEngine(tiny, cache_config=CACHE)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> LLMEngine:
    return LLMEngine(tiny, cache_config=CACHE)


def test_chat_top_logprobs(server: LiveServer, reference: LLMEngine) -> None:
    oai = server.openai()
    resp = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,  # type: ignore[arg-type]
                                       extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    prompt = reference.tokenizer.apply_chat_template([dict(m) for m in CHAT])
    ref = reference.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3))[0]
    assert ref.logprobs is not None and ref.top_logprobs is not None
    for entry, token_id, lp, top in zip(content, ref.token_ids, ref.logprobs, ref.top_logprobs):
        assert entry.logprob == pytest.approx(lp, abs=1e-4)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [t.token for t in entry.top_logprobs] == [reference.tokenizer.decode([t], skip_special_tokens=False) for t, _ in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the top token
    streamed = [c.choices[0].logprobs.content for c in oai.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs is not None]
    flat = [e for chunk in streamed if chunk for e in chunk]
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in flat] == [(e.token, [t.token for t in e.top_logprobs]) for e in content]


def test_completion_logprobs_hold_the_top_tokens_and_the_chosen_one(server: LiveServer) -> None:
    oai = server.openai()
    resp = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=4, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.top_logprobs) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Up to 3 + 1 entries; fewer when tokens share a text (the tiny model's byte tokens all read "\ufffd").
        assert token in top and top[token] == logprob and 1 <= len(top) <= 4
        assert max(top.values()) >= logprob
    chunks = list(oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=4, logprobs=3, stream=True,
                                         extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs or []]
    assert streamed == lp.top_logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_echo_prepends_the_prompt_and_its_logprobs(server: LiveServer, reference: LLMEngine, stream: bool) -> None:
    oai = server.openai()
    kwargs: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    if stream:
        text, tokens, logprobs = "", [], []
        for c in oai.completions.create(stream=True, **kwargs):
            text += c.choices[0].text
            tokens += c.choices[0].logprobs.tokens or []  # type: ignore[union-attr]
            logprobs += c.choices[0].logprobs.token_logprobs or []  # type: ignore[union-attr]
    else:
        choice = oai.completions.create(**kwargs).choices[0]
        assert choice.logprobs is not None
        text, tokens, logprobs = choice.text, choice.logprobs.tokens or [], choice.logprobs.token_logprobs or []
    ref = reference.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True, prompt_logprobs=1))[0]
    assert text == PROMPT + ref.text
    assert len(tokens) == len(ref.prompt_token_ids) + 4 and logprobs[0] is None
    assert ref.prompt_logprobs is not None and ref.logprobs is not None
    assert logprobs[1:] == pytest.approx(ref.prompt_logprobs.logprobs + ref.logprobs, abs=1e-4)


def test_echo_with_n_and_without_logprobs(server: LiveServer) -> None:
    resp = server.openai().completions.create(model="tiny", prompt=PROMPT, max_tokens=3, n=2, seed=1, echo=True)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.text.startswith(PROMPT) and c.logprobs is None for c in resp.choices)


def test_prompt_logprobs_extension(server: LiveServer, reference: LLMEngine) -> None:
    ref = reference.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    assert ref.prompt_logprobs is not None
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                  "prompt_logprobs": 2}).json()
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}).json()
    positions = body["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(ref.prompt_token_ids) and positions[0] is None
    for token_id, position, lp, rank in zip(ref.prompt_token_ids[1:], positions[1:], ref.prompt_logprobs.logprobs, ref.prompt_logprobs.ranks):
        assert position[str(token_id)]["logprob"] == pytest.approx(lp, abs=1e-4) and position[str(token_id)]["rank"] == rank
        assert 2 <= len(position) <= 3 and {1, 2} <= {p["rank"] for p in position.values()}
    assert chat["prompt_logprobs"][0] is None and all(len(p) == 1 for p in chat["prompt_logprobs"][1:])
    assert chat["choices"][0]["logprobs"] is None


def test_logit_bias_forces_a_token(server: LiveServer, reference: LLMEngine) -> None:
    token_id = reference.tokenizer.encode("H", add_special_tokens=False)[0]
    resp = server.openai().completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=1.0, logit_bias={str(token_id): 100})
    assert resp.choices[0].text == "H" * 4


def test_penalties_reach_the_sampler(server: LiveServer, reference: LLMEngine) -> None:
    prompt = "1 2 3 4 5 6 7 8"
    extra = {"repetition_penalty": 1.5, "min_p": 0.02, "ignore_eos": True}
    resp = server.openai().completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, frequency_penalty=1.0,
                                              presence_penalty=0.5, logprobs=0, extra_body=extra)
    sp = SamplingParams(max_tokens=8, temperature=0, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5, min_p=0.02,
                        ignore_eos=True, logprobs=True)
    plain = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    penalised = reference.generate([prompt], sp)[0]
    assert penalised.token_ids != plain.token_ids
    assert resp.choices[0].text == penalised.text
    assert resp.choices[0].logprobs is not None  # the tokens' raw logprobs identify them (texts of byte tokens coincide)
    assert resp.choices[0].logprobs.token_logprobs == pytest.approx(penalised.logprobs, abs=1e-4)


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"1": 500}}, "logit_bias"),
    ("completions", {"logit_bias": {"100000": 1}}, "logit_bias"),  # beyond the vocabulary
    ("completions", {"logit_bias": {"1": "high"}}, "logit_bias"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("chat/completions", {"logit_bias": {"-5": 1}}, "logit_bias"),
]


def test_bad_values_are_400_naming_the_param(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for route, fields, param in BAD:
            base: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
            base.update({"prompt": PROMPT} if route == "completions" else {"messages": CHAT})
            resp = http.post(f"/v1/{route}", json={**base, **fields})
            assert resp.status_code == 400, (route, fields, resp.text)
            assert resp.json()["error"]["param"] == param, (route, fields, resp.text)
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).status_code == 200
