"""A dead controller actor is redeployed and its requests re-run: their streams continue with the
tokens they would have had, and nothing of the dead deployment is left (issue 20)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
from serving_util import wait_until

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.errors import ServiceUnavailableError
from distserve.placement import Placement
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.remote_controller import RemoteController

PROMPTS = ["Hello, my name is", "The capital of France is", "a b c d e f g h i j k l m n o p"]
SP = SamplingParams(max_tokens=48, min_tokens=48, temperature=0.0)
CACHE = CacheConfig(num_blocks=256, block_size=4)

pytestmark = pytest.mark.timeout(300)


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def live_placement_groups() -> set[str]:
    import ray

    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def test_a_killed_controller_is_redeployed_its_streams_continue_and_the_budget_is_kept(ray_cluster: Any) -> None:
    import ray

    reference = [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS, SP)]

    async def collect(rc: RemoteController, prompt: str, rid: str, started: asyncio.Event) -> list[int]:
        tokens: list[int] = []
        async for out in rc.generate(prompt, SP, rid):
            tokens += out.new_token_ids
            started.set()
        return tokens

    async def scenario() -> tuple[list[int], set[str]]:
        before = live_placement_groups()
        rc = RemoteController(DeploymentConfig("tiny", Placement.disaggregated(), dtype="float32", cache_config=CACHE,
                                               max_controller_restarts=2))
        await rc.start()
        try:
            old_pids = [await rc.actor.pid.remote()] + [p for ranks in (await rc.worker_pids()).values() for p in ranks]
            old_groups = live_placement_groups() - before
            # Killed while every request streams: each is re-run and its stream continues where its client is.
            events = [asyncio.Event() for _ in PROMPTS]
            runs = [asyncio.ensure_future(collect(rc, p, f"r{i}", e)) for i, (p, e) in enumerate(zip(PROMPTS, events))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            os.kill(old_pids[0], signal.SIGKILL)  # the controller actor's process, as a crash
            assert await asyncio.wait_for(asyncio.gather(*runs), 180) == reference  # no token twice or missing
            assert rc.num_controller_restarts == 1 and not rc.is_dead
            assert all(i["kv_cache_usage_perc"] == 0.0 for i in (await rc.stats())["instances"])

            # Killed while idle: the health check notices and redeploys; a request arriving meanwhile waits for it.
            ray.kill(rc.actor, no_restart=True)
            with pytest.raises(ServiceUnavailableError, match="being deployed"):
                await rc.check_health()
            late = [t async for out in rc.generate(PROMPTS[0], SP, "late") for t in out.new_token_ids]
            assert late == reference[0] and rc.num_controller_restarts == 2
            await rc.check_health()

            # The budget (2) is spent: the next death is final, as with max_controller_restarts=0.
            ray.kill(rc.actor, no_restart=True)
            with pytest.raises(ServiceUnavailableError):
                [out async for out in rc.generate(PROMPTS[1], SP, "final")]
            assert rc.is_dead
        finally:
            await rc.shutdown()
        return old_pids, old_groups

    old_pids, old_groups = asyncio.run(scenario())
    # The first deployment's instances and placement groups are gone.
    assert wait_until(lambda: not any(process_alive(p) for p in old_pids), timeout_s=30)
    assert wait_until(lambda: not (live_placement_groups() & old_groups), timeout_s=30)
