"""The disaggregated runtime on Ray: TP/PP instances, resharded KV migration, placement, faults."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serving_util import wait_until

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.placement import InstanceSpec, Placement
from distserve.runtime.llm import DisaggLLM

PROMPTS = ["Hello, my name is", "The capital of France is", "a b c d e f g h i j k l m n o p", "1 2 3"]
SP = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
CACHE = CacheConfig(num_blocks=256, block_size=4)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS, SP)]


def deploy(placement: Placement, **kw: Any) -> DisaggLLM:
    return DisaggLLM("tiny", placement, dtype="float32", cache_config=CACHE, **kw)


@pytest.fixture(scope="module")
def resharded_1p1d(ray_cluster: Any) -> Iterator[DisaggLLM]:
    """One 1P1D deployment whose KV migration reshards across the two nodes (prefill TP=2 on node 0,
    decode PP=2 on node 1), for the tests that read counters as differences (prompts share no
    prefix across tests)."""
    placement = Placement(prefill=(InstanceSpec(2, 1, node=0),), decode=(InstanceSpec(1, 2, node=1),))
    with deploy(placement) as llm:
        yield llm


@pytest.fixture(scope="module")
def two_p_one_d(ray_cluster: Any) -> Iterator[DisaggLLM]:
    """One 2P1D deployment for prefix affinity, then the dead prefill instance: that test kills
    prefill-0, so it stays the last of this module's tests to use the deployment."""
    with deploy(Placement.disaggregated(num_prefill=2, num_decode=1)) as llm:
        yield llm


def counted(llm: DisaggLLM, before: dict[str, Any], key: str) -> int:
    """How much the controller's counter ``key`` grew since the stats ``before``."""
    return int(llm.stats()[key] - before[key])


# All 16 prefill x decode tp/pp pairs run in one deployment in test_controller_routing.py; this
# one checks the DisaggLLM path end to end with a resharding pair across the two nodes (the same
# pair on one node was a separate test: it exercised nothing this one does not).
def test_1p1d_resharded_across_the_named_nodes_matches_colocated(
    resharded_1p1d: DisaggLLM, reference: list[list[int]]
) -> None:
    import ray

    llm = resharded_1p1d
    node_of = {n["Resources"].get("distserve_node_1", 0) > 0: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    report = {r["instance"]: r["node_ids"] for r in llm.placement_report()}
    assert report["prefill-0"] == [node_of[False]] * 2
    assert report["decode-0"] == [node_of[True]] * 2
    before = llm.stats()
    assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == reference
    assert counted(llm, before, "num_migrations") == len(PROMPTS)
    assert wait_until(lambda: all(i["kv_cache_usage_perc"] == 0.0 for i in llm.stats()["instances"]))


def test_prefix_aware_migration_and_streaming(resharded_1p1d: DisaggLLM) -> None:
    llm = resharded_1p1d
    shared = "System: you are a helpful assistant. Answer briefly. " * 2
    before = llm.stats()
    llm.generate([shared + "Q: hi"], SP)
    streamed = list(llm.stream(shared + "Q: bye", SP))
    assert counted(llm, before, "kv_migration_blocks_skipped_total") >= 16
    # The second prompt's shared blocks came from the prefill instance's prefix cache, and the
    # controller sums what each instance counted.
    assert counted(llm, before, "prefix_cache_hit_tokens_total") >= 16 * 4
    assert counted(llm, before, "prefill_tokens_computed_total") > 0
    stats = llm.stats()
    assert stats["prefill_tokens_computed_total"] == sum(i["prefill_tokens_computed_total"] for i in stats["instances"])
    assert streamed[-1].finished and len(streamed[-1].token_ids) == 16
    assert "".join(o.new_text for o in streamed) == streamed[-1].text
    fresh = LLMEngine(load_model("tiny"), cache_config=CACHE).generate([shared + "Q: bye"], SP)[0]
    assert streamed[-1].token_ids == fresh.token_ids


def test_siblings_migrating_together_receive_a_shared_prompt_once(resharded_1p1d: DisaggLLM) -> None:
    """Siblings submitted at once: prefill computes their shared prompt once, and the decode
    instance receives it once (from its prefix cache, or — when a sibling's reservation comes while
    that KV is still arriving — by waiting for it: tests/simulator/test_prefix_sharing_sim.py makes
    that case happen), so cascade attention finds it shared there."""
    llm = resharded_1p1d
    shared = "Background: " + "the quick brown fox jumps over the lazy dog; " * 4  # 192 tokens = 48 blocks
    prompts = [shared + f"Q{i}: what next?" for i in range(4)]
    prefix_blocks = len(load_model("tiny").tokenizer.encode(shared)) // CACHE.block_size
    before = llm.stats()
    outs = llm.generate(prompts, SP)
    assert counted(llm, before, "kv_migration_blocks_skipped_total") >= 3 * prefix_blocks
    expected = LLMEngine(load_model("tiny"), cache_config=CACHE).generate(prompts, SP)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


def test_dead_decode_instance_requests_rerun_on_survivor(ray_cluster: Any, reference: list[list[int]]) -> None:
    import ray

    long = SamplingParams(max_tokens=48, min_tokens=48, temperature=0.0)
    expected = [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS, long)]
    with deploy(Placement.disaggregated(num_prefill=1, num_decode=2)) as llm:
        streams = [llm.stream(p, long) for p in PROMPTS]
        firsts = [next(s) for s in streams]  # every request has its first token
        time.sleep(0.2)
        ray.get(llm.controller.actor.kill_instance.remote("decode-0"))
        finals = []
        for first, stream in zip(firsts, streams):
            last = first
            for last in stream:
                pass
            finals.append(last)
        assert [o.token_ids for o in finals] == expected
        assert all(o.finish_reason == "length" for o in finals)


def test_prefix_affinity_routes_to_the_instance_with_the_cached_prefix(two_p_one_d: DisaggLLM) -> None:
    llm = two_p_one_d
    shared = "System: you are a helpful assistant. Answer briefly and politely. " * 2
    first = llm.generate([shared + "Q: hi"], SP)[0]
    second = llm.generate([shared + "Q: bye"], SP)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens >= 64  # served by the prefill instance that cached it


def test_dead_prefill_instance_requests_rerun_on_survivor(two_p_one_d: DisaggLLM) -> None:
    import ray

    llm = two_p_one_d
    long = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0)
    prompts = [p * 4 for p in PROMPTS] * 2
    expected = [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(prompts, long)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(lambda p: list(llm.stream(p, long))[-1], p) for p in prompts]
        time.sleep(0.3)
        # while prompts are queued, prefilling or migrating
        ray.get(llm.controller.actor.kill_instance.remote("prefill-0"))
        finals = [f.result(timeout=120) for f in futures]
    assert [o.token_ids for o in finals] == expected


def test_colocated_instances_on_ray(ray_cluster: Any, reference: list[list[int]]) -> None:
    with deploy(Placement.colocated_instances(2)) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == reference
        assert llm.stats()["num_migrations"] == 0
