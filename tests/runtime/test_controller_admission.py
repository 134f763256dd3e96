"""The Controller's admission queue on Ray (issue 17): a flooding tenant does not starve a light one
under ``fair``, ``fcfs`` keeps arrival order, a tenant's bound refuses with a ``retry_after_s``, a
request past its ``timeout`` fails with error_kind "timeout", a queued request can be aborted, a
TPOT SLO holds new requests while decoding is slower, and every request still gets the colocated
engine's greedy tokens.

One 1P1D deployment of the tiny model; its prefill instance takes one prompt per step, so requests
queue (TNG's backpressure: at most 3 waiting in it). Each test installs a fresh admission queue of
the policy it checks, and submits its requests while the step loops are held between steps (as a
restart holds them), so what is queued or dispatched at submission does not depend on timing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from serving_util import ControllerRuntime, wait_until

from distserve.cluster.admission import TIMED_OUT, AdmissionConfig
from distserve.cluster.classes import RequestClass
from distserve.cluster.tenants import TenantSpec
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import load_model
from distserve.errors import QueueFullError
from distserve.placement import Placement
from distserve.runtime.controller import Controller, StepEvent

pytestmark = pytest.mark.timeout(240)

CACHE = CacheConfig(num_blocks=512, block_size=4)
HEAVY_SP = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, ignore_eos=True)
LIGHT_SP = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, ignore_eos=True)
NUM_HEAVY, NUM_LIGHT = 12, 3
# Costs (prompt + max tokens): heavy 64 + 24 = 88, light 8 + 8 = 16. With a quantum of 100 tokens,
# a heavy turn sends one request and a light turn all three.
QUANTUM = 100


def heavy_prompt(i: int) -> list[int]:
    return [2 + (5 * i + k) % 250 for k in range(64)]


def light_prompt(i: int) -> list[int]:
    return [2 + (31 * i + 3 * k) % 250 for k in range(8)]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy tokens of the colocated engine for every prompt the tests send, by prompt name."""
    engine = LLMEngine(load_model("tiny"), cache_config=CACHE)
    heavy = engine.generate([heavy_prompt(i) for i in range(NUM_HEAVY)], HEAVY_SP)
    light = engine.generate([light_prompt(i) for i in range(NUM_LIGHT)], LIGHT_SP)
    return {**{f"h{i}": list(o.token_ids) for i, o in enumerate(heavy)}, **{f"l{i}": list(o.token_ids) for i, o in enumerate(light)}}


@pytest.fixture(scope="module")
def runtime(ray_cluster: Any) -> Iterator[ControllerRuntime]:
    rt = ControllerRuntime(Placement.disaggregated(), CACHE, HEAVY_SP, prefill_scheduler_config=SchedulerConfig(max_num_seqs=1))
    try:
        yield rt
    finally:
        rt.close()


def use_admission(rt: ControllerRuntime, config: AdmissionConfig) -> Controller:
    """A fresh admission queue of ``config`` on the idle controller (what a deployment with it would hold)."""
    controller = rt.controller
    assert len(controller.admission) == 0 and not controller._seqs
    controller.admission = config.queue()
    return controller


@asynccontextmanager
async def held(controller: Controller) -> AsyncIterator[None]:
    """Hold every step loop between steps (as a restart does) inside the block."""
    controller._running.clear()
    try:
        yield
    finally:
        controller._running.set()


async def final(controller: Controller, name: str, timeout_s: float | None = None) -> RequestOutput:
    """Run request ``name`` (h<i>: heavy tenant, l<i>: light tenant) to its last output."""
    heavy = name.startswith("h")
    prompt = heavy_prompt(int(name[1:])) if heavy else light_prompt(int(name[1:]))
    last = None
    async for out in controller.generate(prompt, HEAVY_SP if heavy else LIGHT_SP, name,
                                         request_class=RequestClass(tenant="heavy" if heavy else "light"), timeout_s=timeout_s):
        last = out
    assert last is not None and last.finished
    return last


async def submitted(controller: Controller, names: list[str]) -> None:
    """Wait until the requests' tasks have submitted them (each in one loop turn)."""
    while not all(n in controller._seqs for n in names):
        await asyncio.sleep(0)


def record_prefill_order(controller: Controller) -> tuple[list[str], Callable[[], None]]:
    """The requests in the order their first token comes from a prefill instance, and the remover."""
    order: list[str] = []

    def listen(event: StepEvent) -> None:
        for up in event.result.updates:
            if event.phase == "prefill" and up.new_token_ids and up.seq_id not in order:
                order.append(up.seq_id)

    return order, controller.add_step_listener(listen)


def check_tokens(outs: list[RequestOutput], reference: dict[str, list[int]]) -> None:
    for out in outs:
        assert out.error is None and out.finish_reason == "length", (out.request_id, out.error)
        assert list(out.token_ids) == reference[out.request_id], out.request_id


@pytest.mark.parametrize("policy, unit", [("fair", "requests"), ("fcfs", "requests"), ("fair", "tokens")])
def test_a_flooding_tenant_does_not_starve_a_light_one_under_fair(
        runtime: ControllerRuntime, reference: dict[str, list[int]], policy: str, unit: str) -> None:
    controller = use_admission(runtime, AdmissionConfig(policy, quantum=QUANTUM, waiting_unit=unit))
    prefill_order, remove = record_prefill_order(controller)
    heavy = [f"h{i}" for i in range(NUM_HEAVY)]
    light = [f"l{i}" for i in range(NUM_LIGHT)]

    async def scenario() -> tuple[list[RequestOutput], dict[str, Any]]:
        async with held(controller):
            tasks = [asyncio.create_task(final(controller, n)) for n in heavy + light]  # the flood arrives first
            await submitted(controller, heavy + light)
            at_arrival = controller.admission.stats()
        return list(await asyncio.gather(*tasks)), at_arrival

    try:
        outs, at_arrival = runtime.run(scenario(), timeout_s=120)
    finally:
        remove()
    # TNG's rule: three fill the prefill instance's waiting queue. The token rule: one, what its next
    # step takes (max_num_seqs 1; the instance's step size comes from its scheduler config, the
    # pending prompt tokens from its step results). The rest wait in the admission queue.
    num_first = 3 if unit == "requests" else 1
    assert at_arrival["tenants"]["heavy"]["num_dispatched"] == num_first
    assert at_arrival["num_queued"] == NUM_HEAVY + NUM_LIGHT - num_first
    assert sorted(prefill_order) == sorted(heavy + light)
    positions = [prefill_order.index(n) for n in light]
    if unit == "tokens":
        # The light tenant is sparse (under its share): its requests go next, one per step.
        assert max(positions) <= 4, prefill_order
    elif policy == "fair":
        # Deficit round robin: h3 (the heavy tenant's turn), then the light tenant's three, then the
        # rest of the flood. (Requests dispatched in one batch may swap in the instance: hence <=.)
        assert max(positions) <= 7, prefill_order
    else:
        assert min(positions) >= NUM_HEAVY - 1, prefill_order  # behind the whole flood
    check_tokens(outs, reference)
    stats = runtime.stats()["admission"]
    assert stats["policy"] == policy and stats["num_queued"] == 0
    assert stats["tenants"]["light"]["num_dispatched"] == NUM_LIGHT and stats["tenants"]["heavy"]["num_dispatched"] == NUM_HEAVY
    assert wait_until(runtime.all_freed), runtime.stats()


def test_a_tenant_over_its_bound_gets_queue_full_with_retry_after(runtime: ControllerRuntime, reference: dict[str, list[int]]) -> None:
    controller = use_admission(runtime, AdmissionConfig(tenants=(TenantSpec("heavy", max_queued_requests=2),), waiting_unit="requests"))
    first = [f"h{i}" for i in range(5)] + ["l0"]  # h0-h2 dispatched, h3 and h4 queued: the bound

    async def scenario() -> tuple[list[RequestOutput], QueueFullError | None]:
        refused = None
        async with held(controller):
            tasks = [asyncio.create_task(final(controller, n)) for n in first]
            await submitted(controller, first)
            try:
                await final(controller, "h5")
            except QueueFullError as exc:
                refused = exc
            assert "h5" not in controller._seqs  # refused before it got a stream: nothing left behind
        return list(await asyncio.gather(*tasks)), refused

    outs, refused = runtime.run(scenario(), timeout_s=60)
    assert refused is not None and "tenant 'heavy'" in str(refused)
    assert refused.retry_after_s is not None and refused.retry_after_s > 0
    check_tokens(outs, reference)
    tenants = runtime.stats()["admission"]["tenants"]
    assert tenants["heavy"]["num_rejected_full"] == 1 and tenants["heavy"]["num_dispatched"] == 5
    assert tenants["light"]["num_dispatched"] == 1 and tenants["light"]["num_rejected_full"] == 0


def test_a_queued_request_times_out_or_is_aborted(runtime: ControllerRuntime, reference: dict[str, list[int]]) -> None:
    controller = use_admission(runtime, AdmissionConfig(waiting_unit="requests"))
    running = ["h0", "h1", "h2"]  # fill the prefill instance's waiting queue (TNG's rule: 3)

    async def scenario() -> tuple[list[RequestOutput], RequestOutput, RequestOutput, int]:
        async with held(controller):  # nothing steps: only the deadline timer can fail "l0"
            tasks = [asyncio.create_task(final(controller, n)) for n in running]
            await submitted(controller, running)
            late = asyncio.create_task(final(controller, "l0", timeout_s=0.2))
            gone = asyncio.create_task(final(controller, "l1"))
            await submitted(controller, ["l0", "l1"])
            await controller.abort("l1")
            aborted = await gone
            queued_after_abort = len(controller.admission)
            timed_out = await asyncio.wait_for(late, 30)
        return list(await asyncio.gather(*tasks)), timed_out, aborted, queued_after_abort

    outs, timed_out, aborted, queued_after_abort = runtime.run(scenario(), timeout_s=60)
    assert aborted.finish_reason == "abort" and not aborted.token_ids
    assert queued_after_abort == 1  # "l0" alone
    assert timed_out.finish_reason == "error" and timed_out.error_kind == TIMED_OUT, timed_out
    assert "timeout of 0.2 s" in (timed_out.error or "") and not timed_out.token_ids
    check_tokens(outs, reference)
    stats = runtime.stats()["admission"]
    assert stats["num_queued"] == 0 and stats["tenants"]["light"]["num_expired"] == 1
    assert stats["tenants"]["light"]["num_dispatched"] == 0 and stats["tenants"]["heavy"]["num_dispatched"] == 3
    assert not controller._seqs and not controller._dispatched and not controller._deadline_timers
    assert wait_until(runtime.all_freed), runtime.stats()



def test_a_tpot_slo_holds_new_requests_while_decoding_is_slower(runtime: ControllerRuntime, reference: dict[str, list[int]]) -> None:
    # No queue rule, and an SLO no step meets: a request waits while anything decodes.
    controller = use_admission(runtime, AdmissionConfig(max_waiting=None, tpot_slo_s=1e-9))
    decode = next(i for i in controller.instances if i.phase == "decode")

    async def scenario() -> tuple[list[RequestOutput], list[RequestOutput]]:
        early = [asyncio.create_task(final(controller, n)) for n in ("h0", "h1")]
        while decode.last_step is None or decode.last_step.num_running == 0:
            await asyncio.sleep(0.001)
        late = await asyncio.gather(final(controller, "l0"), final(controller, "l1"))
        return list(await asyncio.gather(*early)), list(late)

    early, late = runtime.run(scenario(), timeout_s=120)
    check_tokens(early + late, reference)
    # Dispatched once the decode instance reported nothing running: after the early ones finished.
    last_finish = max(o.metrics.finish_time or 0.0 for o in early)
    assert all((o.metrics.first_token_time or 0.0) > last_finish for o in late), (early, late)
    assert runtime.stats()["admission"]["tenants"]["light"]["num_dispatched"] == 2


@pytest.fixture(scope="module")
def roomy_runtime(ray_cluster: Any) -> Iterator[ControllerRuntime]:
    """1P1D whose prefill steps take one heavy prompt (64 tokens) but up to four sequences: a
    preempting plan runs next to a suspended one (each counts against ``max_num_seqs``)."""
    rt = ControllerRuntime(Placement.disaggregated(), CACHE, HEAVY_SP,
                           prefill_scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    try:
        yield rt
    finally:
        rt.close()


def test_a_light_request_preempts_a_backlogged_prefill_between_layers(roomy_runtime: ControllerRuntime, reference: dict[str, list[int]]) -> None:
    """The prefill instance (one worker) runs a backlogged tenant's plan a layer at a time: a light
    request added while it runs stops it at the next layer, goes first, and nothing changes a token
    (``engine.preemptible``). The test hook makes h11's prefill slow (0.3 s per layer) so the light
    request surely arrives while it runs."""
    import ray

    runtime = roomy_runtime
    controller = use_admission(runtime, AdmissionConfig("fair", quantum=QUANTUM))
    prefill = next(i for i in controller.instances if i.phase == "prefill")
    ray.get(prefill.actor.inject_step_fault.remote("h11", "slow"))
    order, remove = record_prefill_order(controller)
    first = ["h8", "h9", "h10", "h11", "l1"]  # both tenants active: the heavy one is backlogged

    async def scenario() -> list[RequestOutput]:
        async with held(controller):
            tasks = [asyncio.create_task(final(controller, n)) for n in first]
            await submitted(controller, first)
        while "h10" not in order:  # h11 is dispatched next and starts its slow prefill
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        light = await final(controller, "l0")
        return [*await asyncio.gather(*tasks), light]

    try:
        outs = runtime.run(scenario(), timeout_s=120)
    finally:
        remove()
    assert order.index("l0") < order.index("h11"), order
    check_tokens(outs, reference)
    stats = next(i for i in runtime.stats()["instances"] if i["phase"] == "prefill")
    assert stats["layer_preemptions_total"] >= 1 and stats["layer_yields_total"] >= 1, stats
    assert wait_until(runtime.all_freed), runtime.stats()


def test_latency_breakdown_adds_up_on_ray(runtime: ControllerRuntime, reference: dict[str, list[int]]) -> None:
    """The controller's timestamps come in phase order and their breakdown adds up to E2E (within 1 ms),
    with a migration; requests queue behind the one-prompt prefill steps."""
    controller = use_admission(runtime, AdmissionConfig())
    names = [f"h{i}" for i in range(4)]

    async def scenario() -> list[RequestOutput]:
        return list(await asyncio.gather(*(final(controller, n) for n in names)))

    start = time.monotonic()
    outs = runtime.run(scenario(), timeout_s=120)
    end = time.monotonic()
    check_tokens(outs, reference)
    queued = []
    for out in outs:
        m = out.metrics
        points = [m.arrival_time, m.dispatch_time, m.prefill_start_time, m.first_token_time, m.migration_start_time,
                  m.migration_end_time, m.finish_time]
        assert None not in points, points
        assert start <= points[0] and points[-1] <= end
        assert points == sorted(points), points  # type: ignore[type-var]
        bd = m.breakdown
        assert bd is not None and m.e2e_s is not None and abs(bd.total_s - m.e2e_s) <= 1e-3
        assert bd.prefill_s > 0 and bd.decode_s > 0 and bd.migration_s is not None and bd.migration_s > 0
        queued.append(bd.queue_s)
    assert max(queued) > min(b.metrics.breakdown.prefill_s for b in outs)  # type: ignore[union-attr]  # the last waited for a prefill
