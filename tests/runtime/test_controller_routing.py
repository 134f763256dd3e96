"""The in-process Controller on Ray: pinned routes, request ids, external aborts (issue #3).

Every prefill tp×pp ∈ {1,2}² with every decode tp×pp ∈ {1,2}²: greedy tokens equal the colocated
engine's. One deployment holds all four layouts on each side; each request is pinned to one
prefill/decode pair, so the 16 resharded migrations run side by side."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from serving_util import ControllerRuntime, wait_until

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.errors import DistServeError, InvalidConfigError
from distserve.placement import InstanceSpec, Placement

PROMPTS = ["Hello, my name is", "The capital of France is", "a b c d e f g h i j k l m n o p", "1 2 3"]
SP = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
CACHE = CacheConfig(num_blocks=128, block_size=4)
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def runtime(ray_cluster: Any) -> Iterator[ControllerRuntime]:
    specs = tuple(InstanceSpec(tp, pp) for tp, pp in LAYOUTS)
    rt = ControllerRuntime(Placement(prefill=specs, decode=specs), CACHE, SP)
    try:
        yield rt
    finally:
        rt.close()


def test_all_16_tp_pp_pairs_match_colocated(runtime: ControllerRuntime) -> None:
    reference = [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS, SP)]
    pairs = list(itertools.product(range(len(LAYOUTS)), repeat=2))

    async def run_all() -> list[list[int]]:
        return list(await asyncio.gather(*(
            runtime._one(PROMPTS[k % len(PROMPTS)], (f"prefill-{p}", f"decode-{d}")) for k, (p, d) in enumerate(pairs)
        )))

    outputs = runtime.run(run_all(), timeout_s=300)
    for k, ((p, d), tokens) in enumerate(zip(pairs, outputs)):
        assert tokens == reference[k % len(PROMPTS)], f"prefill tp{LAYOUTS[p][0]}pp{LAYOUTS[p][1]} -> decode tp{LAYOUTS[d][0]}pp{LAYOUTS[d][1]}"
    stats = runtime.stats()
    assert stats["num_migrations"] == len(pairs) and stats["kv_migration_failures_total"] == 0
    steps = {i["instance"]: i["num_steps"] for i in stats["instances"]}
    assert all(steps[f"{phase}-{i}"] > 0 for phase in ("prefill", "decode") for i in range(len(LAYOUTS)))
    assert wait_until(runtime.all_freed), runtime.stats()


def test_pin_names_must_exist(runtime: ControllerRuntime) -> None:
    with pytest.raises(InvalidConfigError, match="no decode instance named 'prefill-0'"):
        runtime.controller.pin("x", decode="prefill-0")
    with pytest.raises(InvalidConfigError, match="no prefill/colocated instance named 'decode-9'"):
        runtime.controller.pin("x", prefill="decode-9")


def test_duplicate_request_id_is_refused_and_the_first_request_finishes(runtime: ControllerRuntime) -> None:
    async def both() -> tuple[list[int], str]:
        first = runtime.controller.generate(PROMPTS[0], SP, "dup")
        out = await first.__anext__()
        with pytest.raises(DistServeError, match="already in flight"):
            await runtime.controller.generate(PROMPTS[1], SP, "dup").__anext__()
        last = out
        async for last in first:
            pass
        return list(last.token_ids), str(last.finish_reason)

    tokens, reason = runtime.run(both())
    assert reason == "length" and len(tokens) == SP.max_tokens


def test_external_abort_ends_the_stream_and_frees_kv(runtime: ControllerRuntime) -> None:
    long = SamplingParams(max_tokens=200, min_tokens=200, temperature=0.0)

    async def aborted() -> tuple[str | None, int]:
        stream = runtime.controller.generate(PROMPTS[2], long, "to-abort")
        await stream.__anext__()
        await runtime.controller.abort("to-abort")
        outs = [o async for o in stream]
        return outs[-1].finish_reason, len(outs[-1].token_ids)

    reason, num_tokens = runtime.run(aborted(), timeout_s=30)
    assert reason == "abort" and 1 <= num_tokens < 200
    assert wait_until(runtime.all_freed), runtime.stats()
