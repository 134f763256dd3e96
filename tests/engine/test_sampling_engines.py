"""Penalties, logit_bias, min_p and logprobs on the tiny model: the colocated engine and the in-process
disaggregated one (first token on the prefill instance, the rest after migration) agree exactly."""

from __future__ import annotations

import pytest

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.frontend import EngineBase
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.local_disagg import LocalDisaggEngine

pytestmark = pytest.mark.timeout(180)

CACHE = CacheConfig(num_blocks=256, block_size=4)
PROMPTS = ["Once upon a time, in a land far away, there lived", "1 2 3 4 5 6 7 8"]
FEATURES = {
    "greedy+penalties": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.4,
                                       frequency_penalty=0.6, presence_penalty=0.4),
    "seeded+penalties+min_p+bias": SamplingParams(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True, repetition_penalty=1.2,
                                                  frequency_penalty=-0.5, min_p=0.05, top_k=40, logit_bias={5: 2.0, 9: -3.0}),
    "seeded+logprobs": SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, logprobs=True, top_logprobs=4,
                                      prompt_logprobs=2),
}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def disagg(tiny: LoadedModel) -> LocalDisaggEngine:
    # Prompts chunked over several prefill steps: prompt logprobs are gathered chunk by chunk.
    return LocalDisaggEngine(tiny, cache_config=CACHE,
                             prefill_scheduler_config=SchedulerConfig(max_num_batched_tokens=6, enable_chunked_prefill=True))


def assert_same(a: RequestOutput, b: RequestOutput) -> None:
    assert a.token_ids == b.token_ids
    if a.logprobs is not None:
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert (a.top_logprobs is None) == (b.top_logprobs is None)
    if a.top_logprobs is not None and b.top_logprobs is not None:
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
    assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
    if a.prompt_logprobs is not None and b.prompt_logprobs is not None:
        assert b.prompt_logprobs.logprobs == pytest.approx(a.prompt_logprobs.logprobs, abs=1e-4)
        assert b.prompt_logprobs.ranks == a.prompt_logprobs.ranks


def test_colocated_and_disaggregated_agree(tiny: LoadedModel) -> None:
    # Every feature set on every prompt, in one batch: each row is processed with its own parameters.
    prompts = [p for p in PROMPTS for _ in FEATURES]
    params = [sp for _ in PROMPTS for sp in FEATURES.values()]
    colocated = LLMEngine(tiny, cache_config=CACHE).generate(prompts, params)
    split = disagg(tiny).generate(prompts, params)
    for a, b in zip(colocated, split):
        assert_same(a, b)
    alone = LLMEngine(tiny, cache_config=CACHE).generate(prompts[:len(FEATURES)], params[:len(FEATURES)])
    assert [o.token_ids for o in alone] == [o.token_ids for o in colocated[:len(FEATURES)]]  # whatever the batch


def test_logprob_shapes(tiny: LoadedModel) -> None:
    out = LLMEngine(tiny, cache_config=CACHE).generate([PROMPTS[0]], FEATURES["seeded+logprobs"])[0]
    assert out.logprobs is not None and out.top_logprobs is not None and out.prompt_logprobs is not None
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    assert all(len(top) == 4 and top[0][1] >= top[-1][1] for top in out.top_logprobs)
    pl = out.prompt_logprobs
    assert len(pl) == len(pl.ranks) == len(pl.top) == len(out.prompt_token_ids) - 1
    assert all(len(top) == 2 for top in pl.top)
    for lp, rank, top in zip(pl.logprobs, pl.ranks, pl.top):  # the prompt token's rank agrees with the top list
        assert (rank == 1) == (lp >= top[0][1] - 1e-6)


def test_penalties_change_greedy_output(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, cache_config=CACHE)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = engine.generate([PROMPTS[1]], plain)[0].token_ids
    assert len(set(base)) < len(base)  # the tiny model repeats itself
    # The strongest repetition penalty makes every token already seen (prompt or output) a last resort.
    fresh = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=100.0))[0]
    prompt = set(fresh.prompt_token_ids)
    assert len(set(fresh.token_ids)) == len(fresh.token_ids) and not prompt & set(fresh.token_ids)


def test_prompt_logprobs_skip_the_prefix_cache_and_match_generated_logprobs(tiny: LoadedModel) -> None:
    """A prompt of (prompt + generated tokens) has, at the generated tokens' positions, the logprobs
    they were generated with: the alignment echo relies on. A cached prefix is computed again."""
    engine = LLMEngine(tiny, cache_config=CACHE)
    gen = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True))[0]
    full = list(gen.prompt_token_ids) + list(gen.token_ids)
    echo = engine.generate([full], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    assert echo.prompt_logprobs is not None and len(echo.prompt_logprobs) == len(full) - 1
    assert echo.metrics.num_cached_tokens == 0  # its prefix was cached by the first request
    num_prompt = len(gen.prompt_token_ids)
    assert gen.logprobs is not None
    assert echo.prompt_logprobs.logprobs[num_prompt - 1 :] == pytest.approx(gen.logprobs, abs=1e-4)
    assert all(rank == 1 for rank in echo.prompt_logprobs.ranks[num_prompt - 1 :])  # greedy picks rank 1
    plain = engine.generate([full], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert plain.metrics.num_cached_tokens > 0 and plain.prompt_logprobs is None  # others still hit the cache


@pytest.mark.parametrize("kind", ["colocated", "disagg"])
def test_n_completions_share_prompt_logprobs_and_each_gets_its_own(tiny: LoadedModel, kind: str) -> None:
    engine: EngineBase = LLMEngine(tiny, cache_config=CACHE) if kind == "colocated" else disagg(tiny)
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=2, ignore_eos=True, n=3, logprobs=True, top_logprobs=2,
                        prompt_logprobs=1, presence_penalty=1.0)
    engine.add_request(PROMPTS[0], sp, request_id="r")
    last: dict[int, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.index] = out
    one = LLMEngine(tiny, cache_config=CACHE).generate([PROMPTS[0]], SamplingParams(
        max_tokens=6, temperature=1.0, seed=2, ignore_eos=True, logprobs=True, top_logprobs=2, prompt_logprobs=1, presence_penalty=1.0))[0]
    assert sorted(last) == [0, 1, 2]
    assert_same(one, last[0])  # completion 0 is the n = 1 answer, penalties and logprobs included
    for out in last.values():
        assert out.prompt_logprobs is not None and out.prompt_logprobs.logprobs == pytest.approx(one.prompt_logprobs.logprobs, abs=1e-4)  # type: ignore[union-attr]
        assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids) == 6
