"""``ThreadedEngineClient``'s admission queue in front of colocated ``LLMEngine``s (tiny model, in
process): a light tenant is dispatched among a heavy tenant's flood under ``fair`` (behind it under
``fcfs``), bounds refuse with ``QueueFullError``, a request past its timeout ends with
``error_kind`` timeout, an aborted queued request never reaches an engine, the outputs are the
engine's own greedy tokens, and the counters reach ``stats()["admission"]``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from distserve.cluster.admission import AT_ONCE, TIMED_OUT, AdmissionConfig
from distserve.cluster.classes import RequestClass
from distserve.cluster.tenants import TenantSpec
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.outputs import RequestOutput
from distserve.engine.sequence import Sequence
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import InvalidConfigError, QueueFullError
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.threaded_client import ThreadedEngineClient
from serving_util import drain

pytestmark = pytest.mark.timeout(120)

CACHE = CacheConfig(num_blocks=1024, block_size=4)
PROMPT = list(range(1, 181))  # 180 tokens: with 20 output tokens each request costs 200 in fair queueing
SP = SamplingParams(max_tokens=20, min_tokens=20, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=800, min_tokens=800, temperature=0.0, ignore_eos=True)
HEAVY, LIGHT, OTHER = RequestClass(tenant="heavy"), RequestClass(tenant="light"), RequestClass(tenant="other")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


class RecordingEngine(LLMEngine):
    """The real engine; it records in ``log`` the order requests reach it, and its steps wait while ``gate`` is clear."""

    def __init__(self, *args: Any, log: list[str] | None = None, gate: threading.Event | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.order: list[str] = [] if log is None else log
        self.gate = gate or threading.Event()
        self.gate.set()

    def _submit(self, seq: Sequence) -> None:
        self.order.append(seq.seq_id)
        super()._submit(seq)

    def step(self) -> list[RequestOutput]:
        assert self.gate.wait(60)
        return super().step()


def run(client: ThreadedEngineClient, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    try:
        asyncio.run(body())
    finally:
        client.close()


async def eventually(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def admission(client: ThreadedEngineClient) -> dict[str, Any]:
    stats = await client.stats()
    assert isinstance(stats["admission"], dict)
    return stats["admission"]


@pytest.mark.parametrize("policy, unit", [("fcfs", "requests"), ("fair", "requests"), ("fair", "tokens")])
def test_a_light_tenant_is_dispatched_among_a_flood_with_the_engines_own_tokens(tiny: LoadedModel, policy: str, unit: str) -> None:
    log: list[str] = []  # dispatch order over both engines
    gate = threading.Event()
    engines = [RecordingEngine(tiny, cache_config=CACHE, log=log, gate=gate) for _ in range(2)]
    client = ThreadedEngineClient(engines, admission=AdmissionConfig(policy, waiting_unit=unit))
    light_prompt = [p + 1 for p in PROMPT]
    reference = LLMEngine(tiny, cache_config=CACHE).generate([PROMPT, light_prompt], SP)
    rids = [f"h{i}" for i in range(10)] + [f"l{i}" for i in range(3)]

    async def body() -> None:
        gate.clear()
        blocker = asyncio.create_task(drain(client.generate(PROMPT, SHORT, "b", request_class=OTHER)))
        await eventually(lambda: log == ["b"])  # the engine thread is held in the blocker's step
        tasks = [asyncio.create_task(drain(client.generate(
            PROMPT if rid[0] == "h" else light_prompt, SP, rid, request_class=HEAVY if rid[0] == "h" else LIGHT))) for rid in rids]
        await eventually(lambda: client._commands.qsize() == len(rids))  # all queued before any dispatch
        gate.set()
        outs = dict(zip(rids, await asyncio.gather(*tasks)))
        await blocker
        for rid, out in outs.items():
            assert out.token_ids == reference[0 if rid[0] == "h" else 1].token_ids, rid
        stats = await admission(client)
        assert stats["policy"] == policy and stats["num_queued"] == 0
        assert stats["tenants"]["light"]["num_dispatched"] == 3 and stats["tenants"]["heavy"]["num_dispatched"] == 10
        assert stats["tenants"]["heavy"]["wait_s_total"] > 0

    run(client, body)
    assert sorted(log[1:]) == sorted(rids) and all(e.order is log for e in engines)
    positions = [log[1:].index(f"l{i}") for i in range(3)]
    if policy == "fcfs":
        assert positions == [10, 11, 12]  # behind the whole backlog
    else:
        # Fair: the light tenant, under its share of the recent tokens (sparse), goes ahead of the
        # backlogged flood: no later than deficit round robin would send it (positions 2, 3, 7).
        assert positions[0] <= 2 and max(positions) <= 7, log


def busy_engine(tiny: LoadedModel) -> RecordingEngine:
    # One running request at a time: behind a long one, three wait in the scheduler (TNG's rule) and the rest in the client.
    return RecordingEngine(tiny, cache_config=CACHE, scheduler_config=SchedulerConfig(max_num_seqs=1))


async def fill(client: ThreadedEngineClient, engine: RecordingEngine) -> tuple[AsyncIterator[RequestOutput], list[asyncio.Task[RequestOutput]]]:
    """A long request running and three short ones waiting in ``engine``: the backpressure holds what comes next."""
    long = client.generate(PROMPT, LONG, "long", request_class=OTHER)
    await anext(long)
    fillers = [asyncio.create_task(drain(client.generate(PROMPT, SHORT, f"f{i}", request_class=OTHER))) for i in range(3)]
    await eventually(lambda: len(engine.order) == 4)
    return long, fillers


def test_bounds_refuse_with_queue_full_and_the_refusal_is_that_requests_alone(tiny: LoadedModel) -> None:
    engine = busy_engine(tiny)
    client = ThreadedEngineClient(engine, admission=AdmissionConfig(tenants=(TenantSpec("heavy", max_queued_requests=2),), waiting_unit="requests"))

    async def body() -> None:
        long, fillers = await fill(client, engine)
        queued = [asyncio.create_task(drain(client.generate(PROMPT, SHORT, f"h{i}", request_class=HEAVY))) for i in range(2)]
        await eventually(lambda: len(client._admission or ()) == 2)
        with pytest.raises(QueueFullError, match="tenant 'heavy'") as info:
            await anext(client.generate(PROMPT, SHORT, "h-over", request_class=HEAVY))
        assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
        light = asyncio.create_task(drain(client.generate(PROMPT, SHORT, "l0", request_class=LIGHT)))  # another tenant still gets in
        await long.aclose()
        for out in await asyncio.gather(*fillers, *queued, light):
            assert out.finish_reason == "length" and len(out.token_ids) == 4
        stats = await admission(client)
        assert stats["tenants"]["heavy"]["num_rejected_full"] == 1 and stats["tenants"]["heavy"]["num_dispatched"] == 2
        assert "h-over" not in engine.order

    run(client, body)


def test_a_request_past_its_timeout_ends_with_error_kind_timeout(tiny: LoadedModel) -> None:
    engine = busy_engine(tiny)
    client = ThreadedEngineClient(engine, admission=AdmissionConfig(waiting_unit="requests"))

    async def body() -> None:
        long, fillers = await fill(client, engine)
        t0 = time.monotonic()
        out = await drain(client.generate(PROMPT, SHORT, "late", request_class=LIGHT, timeout_s=0.2))
        assert out.finish_reason == "error" and out.error_kind == TIMED_OUT and out.token_ids == []
        assert "timeout of 0.2 s" in (out.error or "") and 0.2 <= time.monotonic() - t0 < 5
        assert "late" not in engine.order
        await long.aclose()
        await asyncio.gather(*fillers)
        stats = await admission(client)
        assert stats["tenants"]["light"]["num_expired"] == 1 and stats["num_queued"] == 0

    run(client, body)


def test_an_aborted_queued_request_never_reaches_an_engine(tiny: LoadedModel) -> None:
    engine = busy_engine(tiny)
    client = ThreadedEngineClient(engine, admission=AdmissionConfig(waiting_unit="requests"))

    async def body() -> None:
        long, fillers = await fill(client, engine)
        waiting = asyncio.create_task(drain(client.generate(PROMPT, SHORT, "gone", request_class=LIGHT)))
        await eventually(lambda: "gone" in (client._admission or ()))
        waiting.cancel()  # the caller went away: its stream closes, which aborts the request
        await eventually(lambda: "gone" not in (client._admission or ()))
        await long.aclose()
        await asyncio.gather(*fillers)
        again = await drain(client.generate(PROMPT, SHORT, "gone", request_class=LIGHT))  # its id is free again
        assert again.finish_reason == "length"
        assert engine.order.count("gone") == 1
        stats = await admission(client)
        assert stats["tenants"]["light"]["num_admitted"] == 2 and stats["tenants"]["light"]["num_dispatched"] == 1
        assert stats["num_queued"] == 0

    run(client, body)


def test_at_once_dispatches_on_arrival_and_bad_input_goes_to_its_request(tiny: LoadedModel) -> None:
    engine = busy_engine(tiny)
    client = ThreadedEngineClient(engine, admission=AT_ONCE)

    async def body() -> None:
        long, fillers = await fill(client, engine)
        extra = [asyncio.create_task(drain(client.generate(PROMPT, SHORT, f"x{i}"))) for i in range(3)]
        await eventually(lambda: len(engine.order) == 7)  # no backpressure: straight to the engine
        with pytest.raises(Exception, match="out of range"):
            await anext(client.generate([10**9], SHORT, "bad"))
        await long.aclose()
        await asyncio.gather(*fillers, *extra)

    run(client, body)


def test_local_disagg_engines_queue_themselves(tiny: LoadedModel) -> None:
    engine = LocalDisaggEngine(tiny, cache_config=CACHE)
    client = ThreadedEngineClient(engine)

    async def body() -> None:
        out = await drain(client.generate(PROMPT, SHORT, "r0", request_class=LIGHT))
        assert out.finish_reason == "length"
        assert client._admission is None
        stats = await admission(client)
        assert stats == engine.admission.stats() and stats["tenants"]["light"]["num_dispatched"] == 1

    run(client, body)
    with pytest.raises(InvalidConfigError, match="not both"):
        ThreadedEngineClient([engine, LLMEngine(tiny, cache_config=CACHE)])
