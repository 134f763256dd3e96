"""In-process xPyD: identical greedy output to the colocated engine, pull-based migration, prefix dedup."""

from __future__ import annotations

import pytest

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import InvalidConfigError
from distserve.runtime.local_disagg import LocalDisaggEngine

PROMPTS = [
    "Hello, my name is",
    "The capital of France is Paris and the capital of Italy is",
    "a",
    "Once upon a time, in a land far, far away, there lived a dragon who loved " * 3,
    "1 2 3 4 5 6",
]
SP = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> list[list[int]]:
    return [o.token_ids for o in LLMEngine(tiny, cache_config=CacheConfig(num_blocks=512, block_size=4)).generate(PROMPTS, SP)]


@pytest.mark.parametrize("num_prefill,num_decode", [(1, 1), (2, 1), (1, 2)])
def test_xpyd_matches_colocated(tiny: LoadedModel, reference: list[list[int]], num_prefill: int, num_decode: int) -> None:
    engine = LocalDisaggEngine(tiny, num_prefill=num_prefill, num_decode=num_decode, cache_config=CacheConfig(num_blocks=512, block_size=4))
    outs = engine.generate(PROMPTS, SP)
    assert [o.token_ids for o in outs] == reference
    assert engine.counters.num_migrations == len(PROMPTS)
    for inst in engine.prefill + engine.decode:
        assert inst.core.block_manager.usage == 0.0  # everything released after the acknowledgement
    assert all(o.metrics.ttft_s is not None and o.metrics.ttft_s > 0 for o in outs)


def test_decode_memory_pressure_waits_then_completes(tiny: LoadedModel, reference: list[list[int]]) -> None:
    # The decode instance holds only a few requests at once: the rest wait, KV held, on the prefill side.
    engine = LocalDisaggEngine(tiny, cache_config=CacheConfig(num_blocks=72, block_size=4))
    outs = engine.generate(PROMPTS, SP)
    assert [o.token_ids for o in outs] == reference


def test_prefix_aware_migration_skips_held_blocks(tiny: LoadedModel) -> None:
    engine = LocalDisaggEngine(tiny, cache_config=CacheConfig(num_blocks=512, block_size=4))
    shared = "System: you are a helpful assistant. Answer briefly. " * 2
    engine.generate([shared + "Q: hi"], SP)
    assert engine.counters.num_blocks_skipped == 0
    second = engine.generate([shared + "Q: bye"], SP)[0]
    assert engine.counters.num_blocks_skipped >= 16  # the shared prefix stayed in the decode cache
    fresh = LLMEngine(tiny, cache_config=CacheConfig(num_blocks=512, block_size=4)).generate([shared + "Q: bye"], SP)[0]
    assert second.token_ids == fresh.token_ids


def test_stop_string_and_abort_free_both_sides(tiny: LoadedModel) -> None:
    engine = LocalDisaggEngine(tiny, cache_config=CacheConfig(num_blocks=512, block_size=4))
    full = engine.generate([PROMPTS[1]], SP)[0].text
    stop = full[6:9]
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=24, min_tokens=0, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
    rid = engine.add_request(PROMPTS[3], SP)
    engine.step()  # prefilled, maybe migrated
    engine.step()
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    for inst in engine.prefill + engine.decode:
        assert inst.core.block_manager.usage == 0.0


def test_single_token_requests_finish_on_prefill(tiny: LoadedModel) -> None:
    engine = LocalDisaggEngine(tiny, cache_config=CacheConfig(num_blocks=512, block_size=4))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0))
    assert all(len(o.token_ids) == 1 and o.finish_reason == "length" for o in outs)
    assert engine.counters.num_migrations == 0


def test_first_tokens_go_out_before_the_rounds_decode_step(tiny: LoadedModel) -> None:
    """With a listener (the in-process server's), a prefill's first token is handed over as its
    plan ends — not after the KV copies and the decode step of the same round (a decode batch
    of another tier's requests would add its step time to every TTFT)."""
    engine = LocalDisaggEngine(tiny, cache_config=CacheConfig(num_blocks=512, block_size=4))
    events: list[tuple[str, object]] = []
    engine.on_plan = lambda instance_id, plan: events.append(("plan", instance_id))
    engine.on_prefill_outputs = lambda outs: events.append(("outputs", [(o.request_id, len(o.token_ids)) for o in outs]))
    engine.add_request(PROMPTS[0], SP, request_id="a")
    for _ in range(3):
        returned = engine.step()
        events.append(("returned", [(o.request_id, len(o.token_ids)) for o in returned]))
    engine.add_request(PROMPTS[1], SP, request_id="b")  # "a" decodes in this round while "b" is prefilled
    events.append(("returned", [(o.request_id, len(o.token_ids)) for o in engine.step()]))
    assert events[:4] == [("plan", "prefill-0"), ("outputs", [("a", 1)]), ("plan", "decode-0"), ("returned", [("a", 2)])]
    # "b"'s first token leaves before "a"'s decode step, and is not returned again by the step.
    assert events[-4:] == [("plan", "prefill-0"), ("outputs", [("b", 1)]), ("plan", "decode-0"), ("returned", [("a", 5), ("b", 2)])]


def test_bad_configuration() -> None:
    with pytest.raises(InvalidConfigError):
        LocalDisaggEngine("tiny", num_prefill=0)
    with pytest.raises(InvalidConfigError):
        LocalDisaggEngine("tiny", kv_transfer_timeout_s=0)


def test_chunked_prefill_instance(tiny: LoadedModel, reference: list[list[int]]) -> None:
    engine = LocalDisaggEngine(
        tiny,
        cache_config=CacheConfig(num_blocks=512, block_size=4),
        prefill_scheduler_config=SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=True),
    )
    assert [o.token_ids for o in engine.generate(PROMPTS, SP)] == reference
