"""Poison requests on the Ray runtime: a request whose every step kills its instance — by raising,
or by ending the process outright — is failed after the second death instead of being re-run on
every replacement; its batch mates finish with their exact tokens; the restarts it caused are not
charged to ``max_instance_restarts``; a suspect whose re-run reaches the replacement late, or whose
KV reaches a decode instance in the step that would run it alone, is not blamed for another's death;
an outage (a phase with no instance left) is a
``ServiceUnavailableError`` (HTTP 503), never a 4xx."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from serving_util import ControllerRuntime, wait_until

from distserve.cluster.recovery import MAX_CRASHES_PER_REQUEST
from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import load_model
from distserve.errors import ServiceUnavailableError
from distserve.placement import Placement

PROMPTS = {"a": "Hello, my name is", "b": "1 2 3 4 5 6"}
POISON_PROMPT = "The capital of France is"
SP = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
CACHE = CacheConfig(num_blocks=256, block_size=4)

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    outs = LLMEngine(load_model("tiny"), cache_config=CACHE).generate(list(PROMPTS.values()), SP)
    return {rid: o.token_ids for rid, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def runtime(ray_cluster: Any) -> Iterator[ControllerRuntime]:
    # One restart allowed: without refunds, one poison request (two deaths) would use it up.
    rt = ControllerRuntime(Placement.disaggregated(), CACHE, SP, max_instance_restarts=1)
    try:
        yield rt
    finally:
        rt.close()


def run_with_poison(rt: ControllerRuntime, poison_id: str, kind: str, phase: str | None = None, prefix: str = "") -> dict[str, RequestOutput]:
    """PROMPTS (as ``prefix`` + their ids) and a poison request, at once; the poison's steps fail on ``phase``'s instances
    (None: every instance)."""
    rt.run(rt.controller.inject_step_fault(poison_id, kind, phase))

    async def all_of() -> dict[str, RequestOutput]:
        ids = [*(prefix + rid for rid in PROMPTS), poison_id]
        prompts = [*PROMPTS.values(), POISON_PROMPT]
        outs = await asyncio.gather(*(rt.final_output(p, rid) for rid, p in zip(ids, prompts)))
        return dict(zip(ids, outs))

    return rt.run(all_of(), timeout_s=300)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_poison_request_fails_alone_and_costs_no_restart_budget(
    runtime: ControllerRuntime, reference: dict[str, list[int]], kind: str
) -> None:
    before = runtime.stats()
    final = run_with_poison(runtime, f"poison-{kind}", kind)
    poison = final[f"poison-{kind}"]
    assert poison.finish_reason == "error" and f"failed {MAX_CRASHES_PER_REQUEST} times" in (poison.error or "")
    for rid in PROMPTS:
        assert final[rid].error is None and final[rid].token_ids == reference[rid]
    after = runtime.stats()
    assert after["requests_failed_poison_total"] == before["requests_failed_poison_total"] + 1
    assert wait_until(lambda: runtime.stats()["instance_restarts_total"] == before["instance_restarts_total"] + 2, 120)
    assert all(i.charged_restarts == 0 for i in runtime.controller.instances)  # refunded
    assert runtime.generate(PROMPTS["a"]) == reference["a"]  # served on by the replacement
    assert wait_until(runtime.all_freed, 30), runtime.stats()


def test_a_suspect_whose_add_arrives_late_is_not_blamed_for_the_next_ones_death(
    runtime: ControllerRuntime, reference: dict[str, list[int]]
) -> None:
    # Instance actors are threaded: a re-run suspect's ``add`` can reach the replacement after a step
    # has run a younger suspect alone. Here "a" always arrives late: the first death (a batch of "b"
    # and the poison) is blamed on all three; on the replacement, "a" must still get its step alone
    # first, so that the poison's second death is blamed on the poison, not on "a", the oldest.
    runtime.run(runtime.controller.inject_step_fault("a", "late-add"))
    final = run_with_poison(runtime, "poison-late", "exit")
    assert final["poison-late"].finish_reason == "error"
    for rid in PROMPTS:
        assert final[rid].error is None and final[rid].token_ids == reference[rid]
    assert wait_until(runtime.all_freed, 30), runtime.stats()


def test_a_suspect_that_dies_decoding_is_blamed_alone_not_its_batch_mates(
    runtime: ControllerRuntime, reference: dict[str, list[int]]
) -> None:
    # The poison kills only decode instances. The first death (its decode batch with "d-a" and "d-b") is blamed on all
    # three; re-run, each suspect's first decode step on the replacement runs alone. The poison's KV arrives in some
    # step: were that step to run it alone too, the controller would not yet know it had arrived and would blame
    # everything the instance holds — "d-a" and "d-b" a second time, failing them as poison.
    before = runtime.stats()
    final = run_with_poison(runtime, "poison-decode", "exit", phase="decode", prefix="d-")
    assert final["poison-decode"].finish_reason == "error" and f"failed {MAX_CRASHES_PER_REQUEST} times" in (final["poison-decode"].error or "")
    for rid in PROMPTS:
        assert final[f"d-{rid}"].error is None and final[f"d-{rid}"].token_ids == reference[rid], final[f"d-{rid}"].error
    after = runtime.stats()
    assert after["requests_failed_poison_total"] == before["requests_failed_poison_total"] + 1
    assert wait_until(runtime.all_freed, 30), runtime.stats()


def test_a_lone_suspect_whose_kv_reaches_an_idle_decode_instance_still_gets_its_step(runtime: ControllerRuntime) -> None:
    # The suspect's KV arrives in a step that leaves the instance with nothing else to do: that step must still report
    # work, or the controller never steps the instance again and the suspect (here the poison, alone) hangs.
    before = runtime.stats()
    runtime.run(runtime.controller.inject_step_fault("poison-alone", "exit", "decode"))
    final = runtime.run(runtime.final_output(POISON_PROMPT, "poison-alone"), timeout_s=120)
    assert final.finish_reason == "error" and f"failed {MAX_CRASHES_PER_REQUEST} times" in (final.error or "")
    assert runtime.stats()["requests_failed_poison_total"] == before["requests_failed_poison_total"] + 1
    assert wait_until(runtime.all_freed, 30), runtime.stats()


def test_an_outage_is_service_unavailable(runtime: ControllerRuntime) -> None:
    runtime.controller.max_instance_restarts = 0  # the next death is final
    decode = next(i for i in runtime.controller.instances if i.phase == "decode")
    import ray

    ray.kill(decode.actor, no_restart=True)
    # The decode loop notices at its next step; a request makes it step.
    with pytest.raises(ServiceUnavailableError, match="no decode instance"):
        runtime.generate(PROMPTS["a"])
    assert wait_until(lambda: not decode.alive and not decode.restarting, 30)
    with pytest.raises(ServiceUnavailableError, match="no decode instance"):
        runtime.run(runtime.controller.check_health())
    with pytest.raises(ServiceUnavailableError):
        runtime.generate(PROMPTS["b"])
