"""KV migrations that fail or time out: the request is prefilled again and completes, never stuck (issue #3)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from serving_util import wait_until

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.errors import InvalidConfigError
from distserve.placement.placement import InstanceSpec, Placement
from distserve.serving.controller import Controller
from distserve.serving.local_disagg import LocalDisaggEngine

PROMPTS = ["Hello, my name is", "The capital of France is", "a b c d e f g h i j k l m n o p"]
SP = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
CACHE = CacheConfig(num_blocks=256, block_size=4)
TIMEOUT_S = 2.0  # kv_transfer_timeout_s of the deployment under test


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS, SP)]


class Runtime:
    """A Controller on a background event loop (``DisaggLLM`` has no ``kv_transfer_timeout_s`` to pass)."""

    def __init__(self, placement: Placement, kv_transfer_timeout_s: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.controller = Controller(
            "tiny", placement, dtype="float32", cache_config=CACHE, kv_transfer_timeout_s=kv_transfer_timeout_s
        )
        self.ids = itertools.count()
        self.run(self.controller.start())

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def generate(self, prompt: str) -> list[int]:
        async def one() -> list[int]:
            last = None
            async for out in self.controller.generate(prompt, SP, f"fault-{next(self.ids)}"):
                last = out
            assert last is not None and last.finished
            return list(last.token_ids)

        return self.run(one())  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        return self.run(self.controller.stats())  # type: ignore[no-any-return]

    def inject(self, instance_id: str, kind: str, rank: int = 0) -> None:
        import ray

        inst = next(i for i in self.controller.instances if i.spec.instance_id == instance_id)
        ray.get(inst.actor.inject_transfer_fault.remote(kind, rank))

    def all_freed(self) -> bool:
        """No KV held, reserved, awaiting migration or in flight anywhere."""
        s = self.stats()
        return s["num_requests_awaiting_migration"] == 0 and all(
            i["kv_cache_usage_perc"] == 0.0
            and i["num_kv_transfers_in_flight"] == 0
            and i.get("num_requests_migrating", 0) == 0
            and i.get("num_requests_awaiting_migration", 0) == 0
            for i in s["instances"]
        )

    def close(self) -> None:
        try:
            self.run(self.controller.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture(scope="module")
def runtime(ray_cluster: Any) -> Iterator[Runtime]:
    # Decode TP=2: one of its ranks is a separate worker actor, and the KV is resharded on the way.
    rt = Runtime(Placement(prefill=(InstanceSpec(1, 1),), decode=(InstanceSpec(2, 1),)), TIMEOUT_S)
    try:
        yield rt
    finally:
        rt.close()


def counters(stats: dict[str, Any]) -> tuple[int, int, int]:
    return stats["num_migrations"], stats["kv_migration_failures_total"], stats["kv_migration_timeouts_total"]


def check_fault(rt: Runtime, reference: list[list[int]], instance_id: str, kind: str, rank: int) -> float:
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
def test_dropped_send_times_out_and_the_request_is_prefilled_again(runtime: Runtime, reference: list[list[int]]) -> None:
    assert runtime.generate(PROMPTS[0]) == reference[0]  # warm: one normal migration first
    elapsed = check_fault(runtime, reference, "prefill-0", "drop_send", rank=0)
    assert elapsed >= TIMEOUT_S  # the decode side waited for the lost KV until its deadline


@pytest.mark.timeout(90)
def test_failed_receive_is_prefilled_again_and_frees_the_stuck_sender(runtime: Runtime, reference: list[list[int]]) -> None:
    elapsed = check_fault(runtime, reference, "decode-0", "fail_recv", rank=1)  # rank 0 receives its half fine
    # The sender was left waiting for a receiver that never posts. Requeueing cancels it; otherwise
    # it would hold the prefill worker's transfer thread, and so the retry, until its deadline.
    assert elapsed < TIMEOUT_S


@pytest.mark.timeout(30)
def test_inject_rejects_unknown_faults(runtime: Runtime) -> None:
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
        Controller("tiny", Placement.disaggregated(), kv_transfer_timeout_s=bad)
    with pytest.raises(InvalidConfigError, match="kv_transfer_timeout_s"):
        LocalDisaggEngine("tiny", kv_transfer_timeout_s=bad)
