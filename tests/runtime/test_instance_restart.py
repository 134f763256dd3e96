"""A crashed instance is restarted and its requests re-run; none is lost or hangs (issue #3).

Processes are killed with SIGKILL, as a crash would: an instance's rank-0 process (the instance
actor) or one of its other ranks (a worker actor). The controller re-runs the requests on a
survivor or parks them until the replacement is up, restarts the instance in its placement group
and forms the torch.distributed world anew; requests on the other instances carry on.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from serving_util import ControllerRuntime, wait_until

from distserve.cluster.admission import DEFAULT_MAX_WAITING
from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.errors import InvalidConfigError
from distserve.runtime.config import DeploymentConfig
from distserve.placement import InstanceSpec, Placement

PROMPTS = ["Hello, my name is", "The capital of France is", "a b c d e f g h i j k l m n o p", "1 2 3"]
SP = SamplingParams(max_tokens=64, min_tokens=64, temperature=0.0)
CACHE = CacheConfig(num_blocks=256, block_size=4)

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS, SP)]


@pytest.fixture(scope="module")
def runtime(ray_cluster: Any) -> Iterator[ControllerRuntime]:
    # The only prefill and the only decode instance: nobody to fail over to, so requests must wait
    # for the restart. Decode TP=2 has a worker actor besides its instance actor; prefill PP=2 has
    # plans on its second stage when the world is formed anew.
    placement = Placement(prefill=(InstanceSpec(1, 2),), decode=(InstanceSpec(2, 1),))
    rt = ControllerRuntime(placement, CACHE, SP, kv_transfer_timeout_s=5.0)
    try:
        yield rt
    finally:
        rt.close()


def restarted(rt: ControllerRuntime, count: int) -> bool:
    s = rt.stats()
    return s["instance_restarts_total"] == count and len(s["instances"]) == 2


def crash_and_collect(rt: ControllerRuntime, instance_id: str, rank: int, busy: str | None) -> list[list[int]]:
    """SIGKILL ``rank`` of ``instance_id`` once some request is ``busy`` there (None: before any
    request is submitted, so they all reach a dead instance) and collect the prompts' outputs."""
    async def all_of() -> list[list[int]]:
        return list(await asyncio.gather(*(rt._one(p, None) for p in PROMPTS)))

    pid = rt.run(rt.controller.worker_pids())[instance_id][rank]
    if busy is None:
        os.kill(pid, signal.SIGKILL)
    future = asyncio.run_coroutine_threadsafe(all_of(), rt.loop)
    if busy is not None:
        assert wait_until(
            lambda: any(i["instance"] == instance_id and i[busy] > 0 for i in rt.stats()["instances"]), 30
        ), rt.stats()
        os.kill(pid, signal.SIGKILL)
    return future.result(240)


def test_decode_worker_crash_restarts_the_instance(runtime: ControllerRuntime, reference: list[list[int]]) -> None:
    before = runtime.stats()
    assert crash_and_collect(runtime, "decode-0", 1, "num_requests_running") == reference
    assert wait_until(lambda: restarted(runtime, before["instance_restarts_total"] + 1), 60), runtime.stats()
    assert runtime.stats()["requests_rerun_total"] > before["requests_rerun_total"]
    assert runtime.generate(PROMPTS[1]) == reference[1]  # the new decode instance takes migrations
    assert wait_until(runtime.all_freed, 30), runtime.stats()


def test_only_prefill_instance_crash_parks_requests_until_restart(runtime: ControllerRuntime, reference: list[list[int]]) -> None:
    before = runtime.stats()
    # The requests reach a dead instance (as many as backpressure lets through; the others wait in
    # the admission queue); with no other prefill instance they wait for the replacement.
    assert crash_and_collect(runtime, "prefill-0", 0, None) == reference
    assert wait_until(lambda: restarted(runtime, before["instance_restarts_total"] + 1), 60), runtime.stats()
    reached = min(len(PROMPTS), DEFAULT_MAX_WAITING)
    assert runtime.stats()["requests_rerun_total"] >= before["requests_rerun_total"] + reached
    new_pid = runtime.run(runtime.controller.worker_pids())["prefill-0"][0]
    assert runtime.generate(PROMPTS[2]) == reference[2]
    assert runtime.run(runtime.controller.worker_pids())["prefill-0"][0] == new_pid
    assert wait_until(runtime.all_freed, 30), runtime.stats()


def test_max_instance_restarts_must_be_a_count() -> None:
    for bad in (-1, 1.5):
        with pytest.raises(InvalidConfigError, match="max_instance_restarts"):
            DeploymentConfig("tiny", Placement.disaggregated(), max_instance_restarts=bad)  # type: ignore[arg-type]


def test_two_instances_killed_at_once_are_restarted_together(runtime: ControllerRuntime, reference: list[list[int]]) -> None:
    """Issue 20: the world needs every rank, so the two replacements join one new world (one restart
    alone would wait for the other's ranks until the restart timeout)."""
    async def all_of() -> list[list[int]]:
        return list(await asyncio.gather(*(runtime._one(p, None) for p in PROMPTS)))

    before = runtime.stats()
    pids = runtime.run(runtime.controller.worker_pids())
    future = asyncio.run_coroutine_threadsafe(all_of(), runtime.loop)
    assert wait_until(lambda: any(i["num_requests_running"] > 0 for i in runtime.stats()["instances"] if i["instance"] == "decode-0"), 30)
    os.kill(pids["prefill-0"][0], signal.SIGKILL)
    os.kill(pids["decode-0"][1], signal.SIGKILL)
    assert future.result(240) == reference
    assert wait_until(lambda: restarted(runtime, before["instance_restarts_total"] + 2), 60), runtime.stats()

