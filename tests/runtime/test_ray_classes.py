"""Scheduling classes on the Ray runtime: the Controller routes by class and task group as the
in-process engine and the simulator do (``tests/cluster/test_classes.py``), with the class carried
to the instance actors inside the request."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from serving_util import ControllerRuntime, wait_until

from distserve.cluster.classes import RequestClass
from distserve.config import CacheConfig, SamplingParams
from distserve.placement import Placement
from distserve.runtime.controller import StepEvent

pytestmark = pytest.mark.timeout(300)

SHORT = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
LONG = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
LATENCY, THROUGHPUT, GROUP = RequestClass("latency"), RequestClass("throughput"), RequestClass("throughput", "g")


@pytest.fixture(scope="module")
def runtime(ray_cluster: Any) -> Iterator[ControllerRuntime]:
    rt = ControllerRuntime(Placement.disaggregated(num_prefill=2, num_decode=2), CacheConfig(num_blocks=256, block_size=4), SHORT)
    try:
        yield rt
    finally:
        rt.close()


def test_the_controller_routes_by_class_and_task_group(runtime: ControllerRuntime) -> None:
    served: dict[str, set[str]] = defaultdict(set)  # request id -> instances that gave it tokens

    def listen(event: StepEvent) -> None:
        for up in event.result.updates:
            if up.new_token_ids:
                served[up.seq_id].add(event.instance_id)

    remove = runtime.controller.add_step_listener(listen)

    async def one(request_id: str, sampling: SamplingParams, request_class: RequestClass, first: asyncio.Event | None = None) -> None:
        async for out in runtime.controller.generate(f"request {request_id} says hello", sampling, request_id, request_class=request_class):
            if first is not None and len(out.token_ids) >= 2:
                first.set()  # decoding on its decode instance
            assert out.error is None, out.error

    async def scenario() -> None:
        decoding = asyncio.Event()
        latency = asyncio.create_task(one("lat", LONG, LATENCY, decoding))
        await asyncio.wait_for(decoding.wait(), 60)
        # While the latency request decodes: a task group arriving one by one, and throughput strangers.
        members = []
        for k in range(3):
            members.append(asyncio.create_task(one(f"g{k}", SHORT, GROUP)))
            await one(f"t{k}", SHORT, THROUGHPUT)
        await asyncio.gather(latency, *members)

    try:
        runtime.run(scenario(), timeout_s=180)
    finally:
        runtime.run(asyncio.sleep(0))
        remove()
    latency_decode = served["lat"] - {i for i in served["lat"] if i.startswith("prefill")}
    assert len(latency_decode) == 1
    for k in range(3):  # throughput work stays off the decode instance running latency work
        assert not (served[f"t{k}"] & latency_decode) and not (served[f"g{k}"] & latency_decode)
    assert len(set.union(*(served[f"g{k}"] for k in range(3)))) == 2  # the group: one prefill and one decode instance
    assert wait_until(runtime.all_freed), runtime.stats()
