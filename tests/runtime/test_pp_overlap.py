"""Pipeline-parallel instances on Ray keep several micro-batches in flight, with exact outputs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from serving_util import wait_until

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.placement import InstanceSpec, Placement
from distserve.runtime.llm import DisaggLLM

PROMPTS = [
    "Hello, my name is", "The capital of France is", "a b c d e f g h i j k l m n o p", "1 2 3",
    "Once upon a time", "The quick brown fox", "x y z", "In the beginning there was",
    "To be or not to be", "0 9 8 7 6 5",
]
SP = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
CACHE = CacheConfig(num_blocks=256, block_size=4)
# Small batches so that concurrent requests form several micro-batches.
SMALL_BATCHES = SchedulerConfig(max_num_seqs=3)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS, SP)]


def deploy(placement: Placement, **kw: Any) -> DisaggLLM:
    return DisaggLLM("tiny", placement, dtype="float32", cache_config=CACHE, **kw)


def instance_stats(llm: DisaggLLM) -> dict[str, dict[str, Any]]:
    return {i["instance"]: i for i in llm.stats()["instances"]}  # type: ignore[union-attr]


def all_freed(llm: DisaggLLM) -> bool:
    return all(
        i["kv_cache_usage_perc"] == 0.0 and i["num_plans_in_flight"] == 0 and i["num_requests_running"] == 0
        for i in instance_stats(llm).values()
    )


@pytest.fixture(scope="module")
def pp2_1p1d(ray_cluster: Any) -> Iterator[DisaggLLM]:
    """PP=2 prefill and decode instances with small batches (at most 3 sequences per micro-batch,
    2 micro-batches in flight: 6 running), shared by the tests that need a pipelined 1P1D."""
    placement = Placement(prefill=(InstanceSpec(1, 2, node=0),), decode=(InstanceSpec(1, 2, node=0),))
    with deploy(placement, scheduler_config=SMALL_BATCHES, prefill_scheduler_config=SMALL_BATCHES) as llm:
        yield llm


def test_pp2_prefill_and_decode_overlap_and_match_colocated(pp2_1p1d: DisaggLLM, reference: list[list[int]]) -> None:
    llm = pp2_1p1d
    assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == reference
    stats = instance_stats(llm)
    for name in ("prefill-0", "decode-0"):
        assert stats[name]["pp"] == 2
        assert stats[name]["max_plans_in_flight"] == 2, stats[name]
        assert stats[name]["num_overlapped_launches"] > 0, stats[name]
    assert wait_until(lambda: all_freed(llm))


def test_pp2_colocated_overlaps_and_matches(ray_cluster: Any, reference: list[list[int]]) -> None:
    with deploy(Placement.colocated_instances(1, pp=2), scheduler_config=SMALL_BATCHES) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == reference
        (stats,) = instance_stats(llm).values()
        assert stats["pp"] == 2 and stats["max_plans_in_flight"] == 2, stats
        assert stats["num_overlapped_launches"] > 0, stats
        assert llm.stats()["num_migrations"] == 0
        assert wait_until(lambda: all_freed(llm))


def test_abort_mid_generation_on_pp2_decode_frees_every_block(pp2_1p1d: DisaggLLM, reference: list[list[int]]) -> None:
    llm = pp2_1p1d
    long = SamplingParams(max_tokens=100, min_tokens=100, temperature=0.0)
    # As many requests as the decode instance runs at once: all of them decoding, in both micro-batches.
    running = SMALL_BATCHES.max_num_seqs * 2
    streams = [llm.stream(p, long) for p in PROMPTS[:running]]
    for s in streams:
        next(s)  # the first token, from the prefill instance
    decoding = [next(s) for s in streams]  # a token from the decode instance
    assert all(not o.finished for o in decoding)
    assert instance_stats(llm)["decode-0"]["kv_cache_usage_perc"] > 0.0
    for s in streams:
        s.close()  # aborts the request, typically while a plan in flight computes it
    assert wait_until(lambda: all_freed(llm), timeout_s=30.0)
    # The instance still serves requests exactly after the aborts.
    assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == reference
    assert wait_until(lambda: all_freed(llm))
