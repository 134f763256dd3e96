"""In-flight prefix sharing in the real engines on the tiny model: siblings submitted together compute
their shared prefix once (counters and plans say so), their greedy outputs equal those of each
prompt run alone, and a held sibling never starves when its holder is aborted or preempted."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.step_plan import StepPlan
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.stats import normalize_stats
from distserve.serving.metrics import ServingMetrics

BS = 4
PREFIX = [(7 * i) % 250 + 3 for i in range(4 * BS)]  # 4 full blocks shared by every sibling
SUFFIXES = [[100 + 10 * i + j for j in range(3 + i % 3)] for i in range(6)]
PROMPTS = [PREFIX + s for s in SUFFIXES]
NUM_UNSHARED = sum(len(s) for s in SUFFIXES)
GREEDY = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="module")
def alone(tiny: LoadedModel) -> list[list[int]]:
    """Each prompt's greedy output, one request at a time and no prefix cache at all."""
    engine = LLMEngine(tiny, cache_config=CacheConfig(num_blocks=64, block_size=BS, enable_prefix_caching=False))
    return [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def colocated(tiny: LoadedModel, num_blocks: int = 256, **sched: object) -> LLMEngine:
    return LLMEngine(tiny, cache_config=CacheConfig(num_blocks=num_blocks, block_size=BS),
                     scheduler_config=SchedulerConfig(**sched))  # type: ignore[arg-type]


def run(engine: LLMEngine | LocalDisaggEngine, ids: list[str]) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert set(done) == set(ids), "a request never finished: starved or deadlocked"
    return done


def test_colocated_siblings_compute_the_prefix_once(tiny: LoadedModel, alone: list[list[int]]) -> None:
    engine = colocated(tiny)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == alone
    stats = engine.stats()
    assert stats["prefill_tokens_computed_total"] == len(PREFIX) + NUM_UNSHARED
    assert stats["prefix_cache_hit_tokens_total"] == 5 * len(PREFIX)
    snap = normalize_stats(stats)
    assert snap["prefill_tokens_computed_total"] == len(PREFIX) + NUM_UNSHARED
    assert snap["instances"][0]["prefix_cache_hit_tokens_total"] == 5 * len(PREFIX)  # type: ignore[typeddict-item]


def test_colocated_without_sharing_computes_it_per_sibling(tiny: LoadedModel, alone: list[list[int]]) -> None:
    engine = colocated(tiny, enable_inflight_prefix_sharing=False)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == alone
    stats = engine.stats()
    assert (stats["prefill_tokens_computed_total"], stats["prefix_cache_hit_tokens_total"]) == (6 * len(PREFIX) + NUM_UNSHARED, 0)


def test_aborting_the_holder_mid_prefix_does_not_starve_its_siblings(tiny: LoadedModel, alone: list[list[int]]) -> None:
    engine = colocated(tiny, enable_chunked_prefill=True, max_num_batched_tokens=12)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()  # the holder computed 3 of the 4 shared blocks; its siblings wait for the fourth
    assert engine.scheduler.num_waiting == 5
    assert all(engine.block_manager.num_blocks_in_flight(engine.core.seqs[i]) == 1 for i in ids[1:])
    engine.abort_request(ids[0])
    done = run(engine, ids[1:])
    assert [done[i] for i in ids[1:]] == alone[1:]


def test_preemption_under_memory_pressure_still_finishes_every_sibling(tiny: LoadedModel, alone: list[list[int]]) -> None:
    engine = colocated(tiny, num_blocks=14)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    done = run(engine, ids)
    assert engine.scheduler.num_preemptions > 0
    assert [done[i] for i in ids] == alone


def test_disaggregated_prefill_computes_the_prefix_once(tiny: LoadedModel, alone: list[list[int]]) -> None:
    engine = LocalDisaggEngine(tiny, num_prefill=1, num_decode=1, cache_config=CacheConfig(num_blocks=256, block_size=BS))
    plans: list[tuple[str, StepPlan]] = []
    engine.on_plan = lambda instance, plan: plans.append((instance, plan))
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == alone
    prefilled = sum(c.num_tokens for inst, p in plans if inst == "prefill-0" for c in p.chunks)
    assert prefilled == len(PREFIX) + NUM_UNSHARED
    stats = engine.stats()
    assert stats["prefill_tokens_computed_total"] == len(PREFIX) + NUM_UNSHARED
    assert stats["prefix_cache_hit_tokens_total"] == 5 * len(PREFIX)
    assert stats["prefill"]["prefill-0"]["prefix_cache_hit_tokens_total"] == 5 * len(PREFIX)  # type: ignore[index]
    assert stats["decode"]["decode-0"]["prefill_tokens_computed_total"] == 0  # type: ignore[index]

    metrics = ServingMetrics(model_name="tiny")
    metrics.update_engine_stats(stats)
    text = metrics.render().decode()
    computed = float(len(PREFIX) + NUM_UNSHARED)
    prefill, decode = 'engine="prefill-0",model_name="tiny",phase="prefill"', 'engine="decode-0",model_name="tiny",phase="decode"'
    assert f"distserve:prefill_tokens_computed_total{{{prefill}}} {computed}" in text
    assert f"distserve:prefill_tokens_computed_total{{{decode}}} 0.0" in text
    engines = {s.labels["engine"] for f in text_string_to_metric_families(text) if f.name == "distserve:prefill_tokens_computed" for s in f.samples}
    assert engines == {"prefill-0", "decode-0"}  # per instance only: their sum() is the total
    assert f"distserve:prefix_cache_hits_total{{{prefill}}} {5.0 * len(PREFIX)}" in text
    assert f"distserve:prefix_cache_queries_total{{{prefill}}} {float(sum(len(p) for p in PROMPTS))}" in text
