"""KV migrations that fail or time out: the request is prefilled again and completes, never stuck (issue #3)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from serving_util import ControllerRuntime, wait_until

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.errors import InvalidConfigError
from distserve.runtime.config import DeploymentConfig
from distserve.placement import InstanceSpec, Placement
from distserve.runtime.local_disagg import LocalDisaggEngine

PROMPTS = ["Hello, my name is", "The capital of France is", "a b c d e f g h i j k l m n o p"]
SP = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
CACHE = CacheConfig(num_blocks=256, block_size=4)
TIMEOUT_S = 2.0  # kv_transfer_timeout_s of the deployment under test


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS, SP)]


@pytest.fixture(scope="module")
def runtime(ray_cluster: Any) -> Iterator[ControllerRuntime]:
    # Decode TP=2: one of its ranks is a separate worker actor, and the KV is resharded on the way.
    placement = Placement(prefill=(InstanceSpec(1, 1),), decode=(InstanceSpec(2, 1),))
    rt = ControllerRuntime(placement, CACHE, SP, kv_transfer_timeout_s=TIMEOUT_S)
    try:
        yield rt
    finally:
        rt.close()


def counters(stats: dict[str, Any]) -> tuple[int, int, int]:
    return stats["num_migrations"], stats["kv_migration_failures_total"], stats["kv_migration_timeouts_total"]


def check_fault(rt: ControllerRuntime, reference: list[list[int]], instance_id: str, kind: str, rank: int) -> float:
    """Inject ``kind`` on ``rank`` of ``instance_id``; the faulted request and the next one both finish
    with the colocated engine's greedy tokens and everything is freed. Returns the faulted request's seconds."""
    migrations, failures, timeouts = counters(rt.stats())
    rt.inject(instance_id, kind, rank)
    start = time.monotonic()
    assert rt.generate(PROMPTS[1]) == reference[1]  # one first token, no duplicate from the re-prefill
    elapsed = time.monotonic() - start
    timed_out = int(kind == "drop_send")
    assert counters(rt.stats()) == (migrations + 2, failures + 1, timeouts + timed_out)  # failed attempt + retry
    assert wait_until(rt.all_freed), rt.stats()
    assert rt.generate(PROMPTS[2]) == reference[2]  # the workers still migrate normally
    assert counters(rt.stats()) == (migrations + 3, failures + 1, timeouts + timed_out)
    assert wait_until(rt.all_freed), rt.stats()
    return elapsed


@pytest.mark.timeout(120)
def test_dropped_send_times_out_and_the_request_is_prefilled_again(runtime: ControllerRuntime, reference: list[list[int]]) -> None:
    assert runtime.generate(PROMPTS[0]) == reference[0]  # warm: one normal migration first
    elapsed = check_fault(runtime, reference, "prefill-0", "drop_send", rank=0)
    assert elapsed >= TIMEOUT_S  # the decode side waited for the lost KV until its deadline


@pytest.mark.timeout(90)
def test_failed_receive_is_prefilled_again_and_frees_the_stuck_sender(runtime: ControllerRuntime, reference: list[list[int]]) -> None:
    elapsed = check_fault(runtime, reference, "decode-0", "fail_recv", rank=1)  # rank 0 receives its half fine
    # The sender was left waiting for a receiver that never posts. Requeueing cancels it; otherwise
    # it would hold the prefill worker's transfer thread, and so the retry, until its deadline.
    assert elapsed < TIMEOUT_S


@pytest.mark.timeout(30)
def test_inject_rejects_unknown_faults(runtime: ControllerRuntime) -> None:
    import ray

    with pytest.raises(ray.exceptions.RayTaskError, match="unknown transfer fault"):
        runtime.inject("decode-0", "melt")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["drop_send", "fail_recv"])
def test_local_disagg_failed_migration_is_prefilled_again(reference: list[list[int]], kind: str) -> None:
    engine = LocalDisaggEngine(load_model("tiny"), cache_config=CACHE)
    engine.inject_transfer_fault(kind)
    assert [o.token_ids for o in engine.generate(PROMPTS, SP)] == reference
    stats = engine.stats()
    assert (stats["kv_migration_failures_total"], stats["kv_migration_timeouts_total"]) == (1, int(kind == "drop_send"))
    assert all(s["kv_cache_usage_perc"] == 0.0 for phase in ("prefill", "decode") for s in stats[phase].values())  # type: ignore[attr-defined]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_kv_transfer_timeout_must_be_positive(bad: float) -> None:
    with pytest.raises(InvalidConfigError, match="kv_transfer_timeout_s"):
        DeploymentConfig("tiny", Placement.disaggregated(), kv_transfer_timeout_s=bad)
    with pytest.raises(InvalidConfigError, match="kv_transfer_timeout_s"):
        LocalDisaggEngine("tiny", kv_transfer_timeout_s=bad)


def test_periodic_transfer_faults_from_the_environment() -> None:
    """``DISTSERVE_TRANSFER_FAULTS`` (the chaos suite's dropped-transfer row): every n-th transfer of a kind
    fails, on top of a one-shot injected fault; a malformed value stops the worker at start, naming the variable."""
    from distserve.runtime.worker import TRANSFER_FAULTS, Worker, periodic_transfer_faults

    assert periodic_transfer_faults(None) == {} and periodic_transfer_faults("") == {}
    assert periodic_transfer_faults("drop_send:5, fail_recv:2") == {"drop_send": 5, "fail_recv": 2}
    for bad in ("drop_send", "drop_send:0", "melt:3", "drop_send:x"):
        with pytest.raises(ValueError, match="DISTSERVE_TRANSFER_FAULTS"):
            periodic_transfer_faults(bad)
    w = Worker.__new__(Worker)  # only the fault bookkeeping
    w._fault, w._periodic_faults, w._transfers_seen = None, {"drop_send": 3}, dict.fromkeys(TRANSFER_FAULTS, 0)
    assert [w._take_fault("drop_send") for _ in range(6)] == [False, False, True, False, False, True]
    w._fault = "fail_recv"
    assert [w._take_fault("fail_recv") for _ in range(3)] == [True, False, False]  # the one-shot fault
