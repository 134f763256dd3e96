"""LLMEngine on the tiny model: greedy parity with HF transformers, batching, preemption, stops, errors."""

from __future__ import annotations

import pytest
import torch

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.tiny_model import build_tiny_hf_model
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import DistServeError, InvalidSamplingParamsError, PromptTooLongError

GREEDY32 = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0)  # = HF min_new_tokens
PROMPTS = [
    "Hello, my name is",
    "The capital of France is Paris and the capital of Italy is",
    "a",
    "Once upon a time, in a land far, far away, there lived a dragon who loved " * 3,
    "1 2 3 4 5 6",
]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    model, _ = build_tiny_hf_model()
    return model


def make_engine(tiny: LoadedModel, **kw: object) -> LLMEngine:
    cache = kw.pop("cache_config", CacheConfig(num_blocks=512, block_size=4))
    return LLMEngine(tiny, cache_config=cache, **kw)  # type: ignore[arg-type]


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits, 1)[0]


def test_greedy_parity_with_hf_transformers(tiny: LoadedModel, hf_model: torch.nn.Module) -> None:
    engine = make_engine(tiny)
    for prompt in PROMPTS:
        ids = tiny.tokenizer.encode(prompt)
        expected, _ = hf_greedy(hf_model, ids, 32)
        got = engine.generate([ids], GREEDY32)[0]
        assert got.token_ids == expected, prompt


def test_logits_match_hf_within_tolerance(tiny: LoadedModel, hf_model: torch.nn.Module) -> None:
    engine = make_engine(tiny)
    ids = tiny.tokenizer.encode(PROMPTS[1])
    expected_ids, hf_logits = hf_greedy(hf_model, ids, 8)
    runner = engine.runner
    captured: list[torch.Tensor] = []
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]  # type: ignore[method-assign]
    engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    ours = torch.cat(captured)  # [8, V]
    assert torch.allclose(ours, hf_logits.float(), atol=1e-4, rtol=1e-4)


def test_batch_invariance_mixed_lengths(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    alone = [engine.generate([p], GREEDY32)[0].token_ids for p in PROMPTS]
    batched = [o.token_ids for o in engine.generate(PROMPTS, GREEDY32)]
    assert batched == alone
    # Staggered arrivals: requests join while others decode (continuous batching).
    for p in PROMPTS:
        engine.add_request(p, GREEDY32, request_id=p)
        engine.step()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[p] for p in PROMPTS] == alone


def test_decode_attention_backends_same_tokens_and_logits(tiny: LoadedModel) -> None:
    """The split-K (exact) and default (cascade) decode attentions and the padded reference agree on a mixed batch."""
    results = {}
    for backend in ("padded", "exact", "cascade"):
        engine = make_engine(tiny)
        engine.runner.decode_attention = backend
        captured: list[torch.Tensor] = []
        original = engine.runner.model.compute_logits
        engine.runner.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]  # type: ignore[method-assign]
        tokens = [o.token_ids for o in engine.generate(PROMPTS, GREEDY32)]
        results[backend] = (tokens, torch.cat(captured))
    for backend in ("exact", "cascade"):
        assert results[backend][0] == results["padded"][0]
        torch.testing.assert_close(results[backend][1], results["padded"][1], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_same_output(tiny: LoadedModel) -> None:
    ref = make_engine(tiny).generate(PROMPTS, GREEDY32)
    chunked = make_engine(
        tiny, scheduler_config=SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=True)
    ).generate(PROMPTS, GREEDY32)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in ref]


def test_preemption_under_memory_pressure_same_output(tiny: LoadedModel) -> None:
    ref = make_engine(tiny).generate(PROMPTS, GREEDY32)
    # 64 blocks x 4 tokens cannot hold all five sequences at once: some get preempted and recomputed.
    small = make_engine(tiny, cache_config=CacheConfig(num_blocks=64, block_size=4))
    out = small.generate(PROMPTS, GREEDY32)
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert small.block_manager.num_free_blocks == 64


def test_prefix_cache_hit_same_output(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    shared = "System: you are a helpful assistant. Answer briefly. " * 2
    first = engine.generate([shared + "Q: hi"], GREEDY32)[0]
    second = engine.generate([shared + "Q: bye"], GREEDY32)[0]
    assert second.metrics.num_cached_tokens >= 64
    fresh = make_engine(tiny).generate([shared + "Q: bye"], GREEDY32)[0]
    assert second.token_ids == fresh.token_ids
    assert first.metrics.num_cached_tokens == 0


def test_streaming_matches_generate(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    full = engine.generate([PROMPTS[0]], GREEDY32)[0]
    pieces, ids = [], []
    for out in engine.stream(PROMPTS[0], GREEDY32):
        pieces.append(out.new_text)
        ids.extend(out.new_token_ids)
    assert ids == full.token_ids
    assert "".join(pieces) == full.text == out.text
    assert out.finished and out.metrics.ttft_s is not None and out.metrics.tpot_s is not None


def test_stop_string_truncates_and_finishes(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    full = engine.generate([PROMPTS[1]], GREEDY32)[0].text
    stop = full[5:8]
    assert len(stop) == 3
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
    inc = engine.generate(
        [PROMPTS[1]],
        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert inc.text == full[: full.index(stop) + 3]
    streamed = "".join(o.new_text for o in engine.stream(PROMPTS[1], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[stop])))
    assert streamed == out.text


def test_stop_token_ids_and_eos(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    full = engine.generate([PROMPTS[0]], GREEDY32)[0]
    target = full.token_ids[3]
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: full.token_ids.index(target) + 1]
    # min_tokens suppresses the stop token until reached
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[target], min_tokens=10))[0]
    assert len(out.token_ids) >= 10


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    sp = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234)
    a = engine.generate([PROMPTS[0]], sp)[0].token_ids
    b = engine.generate([PROMPTS[0]], sp)[0].token_ids
    mixed = engine.generate(PROMPTS, [sp] + [SamplingParams(max_tokens=24, temperature=1.0)] * 4)[0].token_ids
    assert a == b == mixed
    c = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=99))[0].token_ids
    assert c != a


def test_logprobs_returned(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0, logprobs=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert all(lp <= 0 for lp in out.logprobs)


def test_bad_input_errors_keep_engine_usable(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, scheduler_config=SchedulerConfig(max_model_len=64))
    engine.add_request(PROMPTS[0], GREEDY32, request_id="inflight")
    with pytest.raises(PromptTooLongError):
        engine.add_request("x" * 200)
    with pytest.raises(PromptTooLongError, match="cannot fit"):  # refused by its length alone, before tokenizing
        engine.add_request("x" * (64 * engine.tokenizer.max_token_chars + 1))
    with pytest.raises(DistServeError):
        engine.add_request([])
    with pytest.raises(DistServeError):
        engine.add_request([10**9])
    with pytest.raises(DistServeError):
        engine.add_request("hi", request_id="inflight")
    with pytest.raises(DistServeError):
        engine.generate(["ok", "y" * 500])  # nothing from this call is queued
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0)):
        with pytest.raises(InvalidSamplingParamsError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert isinstance(PromptTooLongError("x"), ValueError)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["inflight"] and len(done[0].token_ids) == 32


def test_abort_frees_blocks(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    rid = engine.add_request(PROMPTS[3], GREEDY32)
    engine.step()
    assert engine.block_manager.num_free_blocks < 512
    engine.abort_request(rid)
    assert engine.block_manager.num_free_blocks == 512
    assert not engine.has_unfinished_requests()
    engine.step()  # an empty step is harmless


def test_context_length_finishes_with_length(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, scheduler_config=SchedulerConfig(max_model_len=40))
    ids = tiny.tokenizer.encode("abcdefghij" * 3)
    room = 40 - len(ids)
    out = engine.generate([ids], SamplingParams(max_tokens=room, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == 40
    # Asking for more than fits is refused up front, naming the field (as vLLM's server does).
    with pytest.raises(PromptTooLongError, match="max_tokens") as info:
        engine.generate([ids], SamplingParams(max_tokens=room + 1, temperature=0))
    assert info.value.param == "max_tokens"
    assert not engine.has_unfinished_requests()
