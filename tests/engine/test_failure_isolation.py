"""A request's failure is its own: a failing sampler row, a failing detokenizer or a poison request
(one that makes every step computing it fail) ends that request with an error and frees its KV,
while the requests it shared steps with finish with exactly the tokens they would have had."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from distserve.cluster.recovery import MAX_CRASHES_PER_REQUEST
from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.frontend import MAX_CONSECUTIVE_FAILED_STEPS, EngineBase
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import EngineDeadError
from distserve.runtime.local_disagg import LocalDisaggEngine

PROMPTS = {"a": "Hello, my name is", "poison": "The capital of France is", "b": "1 2 3 4 5 6"}
SP = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
CACHE = CacheConfig(num_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> dict[str, list[int]]:
    outs = LLMEngine(tiny, cache_config=CACHE).generate(list(PROMPTS.values()), SP)
    return {rid: o.token_ids for rid, o in zip(PROMPTS, outs)}


def run(engine: EngineBase, params: dict[str, SamplingParams] | None = None, max_steps: int = 500) -> dict[str, RequestOutput]:
    """Every prompt under its own id, stepped (with recovery) to the end; the final outputs."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(prompt, (params or {}).get(rid, SP), request_id=rid)
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        for out in engine.step_or_recover():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests():
            return final
    raise AssertionError("the requests did not finish")


def kv_freed(engine: EngineBase) -> bool:
    if isinstance(engine, LocalDisaggEngine):
        return all(i.core.block_manager.usage == 0.0 for i in engine.prefill + engine.decode)
    assert isinstance(engine, LLMEngine)
    return engine.block_manager.usage == 0.0


def test_a_failing_sampler_row_fails_only_its_request(tiny: LoadedModel, reference: dict[str, list[int]]) -> None:
    bad = SamplingParams(max_tokens=12, temperature=1.0, seed=1)
    object.__setattr__(bad, "seed", 2**70)  # past validation: what a missed check would let through
    engine = LLMEngine(tiny, cache_config=CACHE)
    final = run(engine, {"poison": bad})
    assert final["poison"].finish_reason == "error" and "sampling failed" in (final["poison"].error or "")
    assert final["a"].token_ids == reference["a"] and final["b"].token_ids == reference["b"]
    assert final["a"].error is None and engine.num_failed_steps == 0
    assert kv_freed(engine)


def test_a_failing_detokenizer_fails_only_its_request(tiny: LoadedModel, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(tiny, cache_config=CACHE)
    process: Callable[..., RequestOutput] = engine.outputs.process

    def flaky(seq, now, finish):  # type: ignore[no-untyped-def]
        if seq.seq_id == "poison" and seq.num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return process(seq, now, finish)

    monkeypatch.setattr(engine.outputs, "process", flaky)
    final = run(engine)
    assert final["poison"].finish_reason == "error" and "output processing failed" in (final["poison"].error or "")
    assert final["a"].token_ids == reference["a"] and final["b"].token_ids == reference["b"]
    assert kv_freed(engine) and not engine.has_unfinished_requests()


def make_engine(kind: str, tiny: LoadedModel) -> EngineBase:
    return LLMEngine(tiny, cache_config=CACHE) if kind == "colocated" else LocalDisaggEngine(tiny, cache_config=CACHE)


@pytest.mark.parametrize("kind,where", [("colocated", "runner"), ("disagg", "prefill"), ("disagg", "decode")])
def test_a_poison_request_fails_after_its_second_crash_and_spares_the_others(
    tiny: LoadedModel, reference: dict[str, list[int]], kind: str, where: str
) -> None:
    engine = make_engine(kind, tiny)
    if isinstance(engine, LLMEngine):
        engine.runner.inject_step_fault("poison")
    else:
        assert isinstance(engine, LocalDisaggEngine)
        (engine.prefill if where == "prefill" else engine.decode)[0].runner.inject_step_fault("poison")
    final = run(engine)
    poison = final["poison"]
    assert poison.finish_reason == "error" and "failed 2 times" in (poison.error or "")
    # Its batch mates were suspects of the first crash, then ran a step alone and were cleared.
    assert final["a"].token_ids == reference["a"] and final["b"].token_ids == reference["b"]
    assert final["a"].error is None and final["b"].error is None
    assert engine.num_failed_steps == MAX_CRASHES_PER_REQUEST
    assert kv_freed(engine)
    # The engine serves on.
    again = engine.generate([PROMPTS["a"]], SP)[0]
    assert again.token_ids == reference["a"]


def test_an_engine_whose_every_step_fails_is_declared_dead(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, cache_config=CACHE)

    def broken() -> list[RequestOutput]:
        raise RuntimeError("the model is broken")

    engine.step = broken  # type: ignore[method-assign]
    engine.add_request("x", SP, request_id="x")
    for _ in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        assert engine.step_or_recover() == []  # recovered: nobody blamed, the request re-runs
    with pytest.raises(EngineDeadError, match="the model is broken"):
        engine.step_or_recover()


@pytest.mark.interpreted  # patches BlockManager.can_allocate
def test_a_request_that_breaks_scheduling_fails_alone(
    tiny: LoadedModel, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from distserve.engine.block_manager import BlockManager

    can_allocate = BlockManager.can_allocate

    def broken_for_poison(self: BlockManager, seq: Any) -> bool:
        if seq.seq_id == "poison":
            raise IndexError("injected block-table bug")
        return can_allocate(self, seq)

    monkeypatch.setattr(BlockManager, "can_allocate", broken_for_poison)  # survives the engine's reset
    engine = LLMEngine(tiny, cache_config=CACHE)
    final = run(engine)
    assert final["poison"].finish_reason == "error"
    assert final["a"].token_ids == reference["a"] and final["b"].token_ids == reference["b"]
    assert engine.num_failed_steps == MAX_CRASHES_PER_REQUEST and kv_freed(engine)
