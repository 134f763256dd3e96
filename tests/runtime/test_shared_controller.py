"""A named controller shared by several handles (a Ray Serve app's replicas): deployed once, kept while
any holder is attached, torn down by the last one to leave or, when its holders died, by itself."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from typing import Any

import pytest

from distserve.config import CacheConfig, SamplingParams
from distserve.placement import Placement
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.remote_controller import SHARED_NAMESPACE, RemoteController

pytestmark = pytest.mark.timeout(300)

CONFIG = DeploymentConfig("tiny", Placement.disaggregated(), dtype="float32", cache_config=CacheConfig(num_blocks=128, block_size=16))
SP = SamplingParams(max_tokens=6, temperature=0.0)


async def complete(controller: RemoteController, prompt: str) -> list[int]:
    last = None
    async for out in controller.generate(prompt, SP, uuid.uuid4().hex):
        last = out
    assert last is not None and last.finished
    return last.token_ids


def ghost_class() -> Any:
    """A bare actor to stand for a holder process (a Serve replica) that dies; Ray ships it by value (workers cannot import tests)."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class Ghost:
        def ping(self) -> int:
            return 1

    return Ghost


def live_groups() -> set[str]:
    import ray

    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def wait_gone(name: str, timeout_s: float = 30.0) -> bool:
    """Until the named actor is dead and its name free; whether it is."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=SHARED_NAMESPACE)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


def test_holders_share_one_deployment_until_the_last_leaves(ray_cluster: Any) -> None:
    import ray

    name = f"test-{uuid.uuid4().hex[:8]}"
    before = live_groups()
    ghost = ray.remote(ghost_class()).options(num_cpus=0.01).remote()

    async def run() -> None:
        first = RemoteController(CONFIG, shared_name=name)
        await first.start()
        groups = live_groups() - before
        assert len(groups) == 2  # one per instance
        second = RemoteController(CONFIG, shared_name=name)
        await second.start()
        assert live_groups() - before == groups  # attached: nothing deployed again
        assert await first.actor.pid.remote() == await second.actor.pid.remote()
        assert await second.actor.attach.remote("ghost", ghost)

        expected = await complete(first, "Hello, my name is")
        assert await complete(second, "Hello, my name is") == expected
        await first.publish({"requests": 1})
        await second.publish({"requests": 2})
        assert await first.published() == [({"requests": 2}, True)]  # the other holders' latest

        await first.shutdown()  # not the last holder: detaches only
        assert live_groups() - before == groups
        assert await second.published() == [({"requests": 1}, False)]  # a holder gone: its figures stay, marked so
        assert len(await complete(second, "The capital of France is")) == SP.max_tokens

        ray.kill(ghost, no_restart=True)
        assert await second.actor.check_holders.remote() == 1  # the dead one is forgotten; the deployment stays
        assert len(await complete(second, "1 2 3")) == SP.max_tokens
        await second.shutdown()  # the last holder: tears the deployment down
        assert not live_groups() & groups

    asyncio.run(run())
    assert wait_gone(name)


def test_a_shared_controller_whose_holders_all_died_tears_itself_down(ray_cluster: Any) -> None:
    """(Not started: what the watch does, not what tearing down a deployment does, which the test above covers.)"""
    import ray

    name = f"test-{uuid.uuid4().hex[:8]}"
    ghost = ray.remote(ghost_class()).options(num_cpus=0.01).remote()
    actor = RemoteController(CONFIG, shared_name=name).actor
    assert ray.get(actor.attach.remote("ghost", ghost))
    assert ray.get(actor.check_holders.remote()) == 1
    ray.kill(ghost, no_restart=True)
    # ray.kill is asynchronous: a ping sent before the kill lands is answered, so the holder counts as alive until a
    # later check (the watch repeats every HOLDER_CHECK_INTERVAL_S). Check again until the death is seen.
    left, deadline = 1, time.monotonic() + 60
    while left and time.monotonic() < deadline:
        try:
            left = ray.get(actor.check_holders.remote(), timeout=60)
        except ray.exceptions.RayActorError:  # it killed itself before answering
            left = 0
        if left:
            time.sleep(0.5)
    assert left == 0 and wait_gone(name)
