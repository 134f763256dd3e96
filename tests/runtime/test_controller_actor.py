"""The Controller in its own Ray actor: parity, streaming, one multiplexed output stream per proxy,
early close, errors across the hop, teardown."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from serving_util import process_alive, wait_until

from distserve.cluster.classes import RequestClass
from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.outputs import RequestMetrics, RequestOutput
from distserve.engine.weights import load_model
from distserve.errors import DistServeError, InvalidConfigError, QueueFullError, ServiceUnavailableError
from distserve.runtime.config import DeploymentConfig
from distserve.placement import InstanceSpec, Placement
from distserve.runtime.controller_actor import ControllerActor
from distserve.runtime.remote_controller import RemoteController
from distserve.runtime.llm import DisaggLLM

PROMPTS = ["Hello, my name is", "The capital of France is", "a b c d e f g h i j k l m n o p", "1 2 3"]
SP = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
LONG = SamplingParams(max_tokens=400, min_tokens=400, temperature=0.0)
CACHE = CacheConfig(num_blocks=256, block_size=4)
RESTART_SP = SamplingParams(max_tokens=48, min_tokens=48, temperature=0.0)  # long enough to kill the controller mid-stream

pytestmark = pytest.mark.timeout(300)


def deploy() -> DisaggLLM:
    return DisaggLLM("tiny", Placement.disaggregated(), dtype="float32", cache_config=CACHE)


# The placement groups there were before the module's deployment.
_GROUPS_BEFORE: set[str] = set()


@pytest.fixture(scope="module")
def llm(ray_cluster: Any) -> Iterator[DisaggLLM]:
    """One deployment for the module's tests; the last of them to use it checks its shutdown
    (``test_shutdown_leaves_no_actor_and_no_placement_group``)."""
    _GROUPS_BEFORE.update(live_placement_groups())
    with deploy() as llm:  # (shutting down twice does nothing)
        yield llm


@pytest.fixture(scope="module")
def colocated_tokens() -> list[list[int]]:
    """Greedy tokens of ``PROMPTS`` under ``SP`` from the colocated engine."""
    return [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS, SP)]


def live_placement_groups() -> set[str]:
    import ray

    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def all_freed(llm: DisaggLLM) -> bool:
    return all(i["kv_cache_usage_perc"] == 0.0 and i["num_requests_running"] == 0 for i in llm.stats()["instances"])


def test_the_controller_is_a_separate_ray_actor(llm: DisaggLLM) -> None:
    import ray

    assert isinstance(llm.controller, RemoteController)
    pid = ray.get(llm.controller.actor.pid.remote())
    assert pid != os.getpid() and process_alive(pid)


def test_greedy_tokens_match_the_colocated_engine(llm: DisaggLLM, colocated_tokens: list[list[int]]) -> None:
    assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == colocated_tokens


def test_streaming_delivers_every_token_in_order(llm: DisaggLLM) -> None:
    streamed = list(llm.stream(PROMPTS[1], SP))
    assert len(streamed) > 1 and streamed[-1].finished and not any(o.finished for o in streamed[:-1])
    assert [t for o in streamed for t in o.new_token_ids] == streamed[-1].token_ids
    assert "".join(o.new_text for o in streamed) == streamed[-1].text


def test_concurrent_streams_of_one_proxy_interleave_and_match_the_colocated_engine(
    llm: DisaggLLM, colocated_tokens: list[list[int]]
) -> None:
    controller = llm.controller
    assert isinstance(controller, RemoteController)
    arrivals: list[tuple[str, bool]] = []  # (request id, finished) in the order outputs reached their streams

    async def consume(i: int) -> list[RequestOutput]:
        outs = []
        async for out in controller.generate(PROMPTS[i], SP, f"mux-{i}"):
            arrivals.append((out.request_id, out.finished))
            outs.append(out)
        return outs

    async def run_all() -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*(consume(i) for i in range(len(PROMPTS)))))

    streams = llm.run(run_all())
    for i, outs in enumerate(streams):
        assert all(o.request_id == f"mux-{i}" for o in outs)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == colocated_tokens[i]
        assert "".join(o.new_text for o in outs) == outs[-1].text
    # Interleaved: every stream had outputs before the first one finished.
    first_finish = next(k for k, (_, finished) in enumerate(arrivals) if finished)
    assert {rid for rid, _ in arrivals[:first_finish]} == {f"mux-{i}" for i in range(len(PROMPTS))}

    # The threaded bridge of ``DisaggLLM.stream``, from several threads at once.
    results: dict[int, list[int]] = {}

    def stream(i: int) -> None:
        results[i] = [t for o in llm.stream(PROMPTS[i], SP) for t in o.new_token_ids]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(len(PROMPTS))] == colocated_tokens


def test_an_error_for_one_request_leaves_the_proxys_other_streams_alone(
    llm: DisaggLLM, colocated_tokens: list[list[int]]
) -> None:
    import ray

    controller = llm.controller
    assert isinstance(controller, RemoteController)
    # A request the controller holds under an id this proxy does not know (as another proxy's
    # would be): submitting that id again is refused by the actor, not by the proxy.
    ids = controller.encode_prompt(PROMPTS[0])
    ray.get(controller.actor.submit.remote("elsewhere", ids, LONG, "taken"))

    async def scenario() -> tuple[list[list[int]], BaseException, BaseException]:
        streams = [controller.generate(PROMPTS[i], SP, f"ok-{i}") for i in range(len(PROMPTS))]
        firsts = [await s.__anext__() for s in streams]  # all in flight

        async def finish(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> list[int]:
            return [t for o in [first] + [o async for o in rest] for t in o.new_token_ids]

        async def refused(prompt: Any, request_id: str) -> BaseException:
            with pytest.raises(DistServeError) as err:
                async for _ in controller.generate(prompt, SP, request_id):
                    pass
            return err.value

        duplicate, bad_prompt, tokens = await asyncio.gather(
            refused(PROMPTS[1], "taken"), refused([10**9], "bad"), asyncio.gather(*map(finish, firsts, streams))
        )
        return list(tokens), duplicate, bad_prompt

    try:
        tokens, duplicate, bad_prompt = llm.run(scenario())
    finally:
        llm.run(controller.abort("taken"))
    assert type(duplicate) is DistServeError and "already in flight" in str(duplicate)
    assert type(bad_prompt) is DistServeError and "out of range" in str(bad_prompt)
    assert tokens == colocated_tokens
    assert wait_until(lambda: all_freed(llm), timeout_s=20)


def _output(request_id: str, i: int, finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id=request_id, prompt_token_ids=[1], token_ids=list(range(i + 1)), text="", new_token_ids=[i],
        new_text="", finished=finished, finish_reason="length" if finished else None,
        metrics=RequestMetrics(0.0, None, None, 1, 0, i + 1),
    )


class _ScriptedController:
    """Stands in for the ``Controller`` in a ``ControllerActor``: three outputs per request, except
    "refused" (refused on submission) and "failing" (fails after its first output)."""

    def __init__(self) -> None:
        self.classes: dict[str, object] = {}

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str, priority: int = 0,
                       request_class: RequestClass | None = None, timeout_s: float | None = None) -> AsyncIterator[RequestOutput]:
        self.classes[request_id] = request_class
        if request_id == "refused":
            raise QueueFullError("1 requests in flight (max 1)")
        for i in range(3):
            await asyncio.sleep(0)
            if request_id == "failing" and i == 1:
                raise InvalidConfigError("this request cannot run")
            yield _output(request_id, i, finished=i == 2)

    async def abort(self, request_id: str) -> None:
        pass


def test_the_actor_multiplexes_a_proxys_requests_and_keeps_errors_to_their_own() -> None:
    scripted = _ScriptedController()

    async def scenario() -> dict[str, list[Any]]:
        actor = ControllerActor(DeploymentConfig("tiny"))
        actor.controller = scripted  # type: ignore[assignment]
        outputs = actor.outputs("proxy")
        refused = await actor.submit("proxy", [1], SP, "refused")  # returned, not raised (no traceback formatted per refusal)
        assert isinstance(refused, QueueFullError) and refused.__traceback__ is None
        await actor.abort("early")  # before its submission: refused on arrival, its stream just ends
        for request_id in ("a", "failing", "b", "early"):
            await actor.submit("proxy", [1], SP, request_id, 0, RequestClass("latency", "g") if request_id == "b" else None)
        got: dict[str, list[Any]] = defaultdict(list)
        while sum(1 for items in got.values() for item in items if item is None or isinstance(item, Exception)) < 4:
            for request_id, item in await outputs.__anext__():
                got[request_id].append(item)
        await outputs.aclose()
        return got

    got = asyncio.run(scenario())
    assert set(got) == {"a", "failing", "b", "early"}
    for request_id in ("a", "b"):
        assert [(o.new_token_ids, o.finished) for o in got[request_id][:-1]] == [([0], False), ([1], False), ([2], True)]
        assert got[request_id][-1] is None
    assert [o.new_token_ids for o in got["failing"][:-1]] == [[0]]
    assert type(got["failing"][-1]) is InvalidConfigError
    assert got["early"] == [None]
    assert scripted.classes == {"refused": None, "a": None, "failing": None, "b": RequestClass("latency", "g")}  # passed on as given


def test_early_close_aborts_and_frees_kv_on_both_instances(llm: DisaggLLM) -> None:
    stream = llm.stream(PROMPTS[0], LONG)
    outs = [next(stream) for _ in range(5)]
    assert not outs[-1].finished
    assert any(i["kv_cache_usage_perc"] > 0 for i in llm.stats()["instances"])
    stream.close()
    assert wait_until(lambda: all_freed(llm), timeout_s=20)


def test_an_outbox_nobody_reads_is_dropped_and_its_requests_aborted(llm: DisaggLLM) -> None:
    """Issue 20 (soak): requests submitted for a proxy that never opens its stream (it left) must not run
    and keep their outputs for ever."""
    import ray

    actor = llm.controller.actor
    before = ray.get(actor.num_outboxes.remote())
    ray.get(actor.submit.remote("gone-proxy", llm.controller.encode_prompt(PROMPTS[0]), LONG, "orphan"))
    assert ray.get(actor.num_outboxes.remote()) == before + 1
    assert wait_until(lambda: any(i["kv_cache_usage_perc"] > 0 for i in llm.stats()["instances"]), timeout_s=20)
    assert "gone-proxy" not in ray.get(actor.sweep_orphans.remote(3600.0))  # read recently enough: kept
    assert "gone-proxy" in ray.get(actor.sweep_orphans.remote(0.0))  # (with any earlier test's idle outbox)
    assert ray.get(actor.num_outboxes.remote()) <= before
    assert wait_until(lambda: all_freed(llm), timeout_s=20)


def test_shutdown_leaves_no_actor_and_no_placement_group(llm: DisaggLLM) -> None:
    """The module's deployment (this is the last test to use it: it has served every test above) is shut down."""
    import ray

    try:
        assert len(llm.generate(PROMPTS[:1], SP)[0].token_ids) == 16
        ours = live_placement_groups() - _GROUPS_BEFORE
        pids = [ray.get(llm.controller.actor.pid.remote())]
        pids += [p for ranks in ray.get(llm.controller.actor.worker_pids.remote()).values() for p in ranks]
    finally:
        llm.shutdown()
    assert len(ours) == 2 and len(pids) == 3
    assert wait_until(lambda: not any(process_alive(p) for p in pids), timeout_s=30)
    assert wait_until(lambda: not (live_placement_groups() & ours), timeout_s=30)


def test_errors_keep_their_types_abort_ends_a_stream_and_a_dead_controller_fails_it(ray_cluster: Any) -> None:
    import ray

    async def scenario() -> tuple[list[int], set[str]]:
        # Raised inside the actor's start (deploying): node 7 is not in the cluster.
        unplaceable = Placement(prefill=(InstanceSpec(node=7),), decode=(InstanceSpec(),))
        bad = RemoteController(DeploymentConfig("tiny", unplaceable, dtype="float32", cache_config=CACHE))
        with pytest.raises(InvalidConfigError, match="node 7") as invalid:
            await bad.start()
        assert type(invalid.value) is InvalidConfigError
        with pytest.raises(ray.exceptions.RayActorError):
            await bad.actor.pid.remote()  # a failed start leaves no actor behind

        before = live_placement_groups()
        # No controller restarts allowed: its death is final (test_controller_restart.py redeploys it).
        rc = RemoteController(DeploymentConfig("tiny", Placement.disaggregated(), dtype="float32", cache_config=CACHE, max_queued_requests=1,
                                               max_controller_restarts=0))
        await rc.start()
        try:
            held = rc.generate(PROMPTS[0], LONG, "held")
            assert not (await held.__anext__()).finished
            with pytest.raises(QueueFullError) as full:
                await rc.generate(PROMPTS[1], SP, "refused").__anext__()
            assert type(full.value) is QueueFullError

            await rc.abort("held")  # as the HTTP layer may: the stream ends, the KV is freed
            assert [out async for out in held if out.finished] == []
            for _ in range(100):
                if all(i["kv_cache_usage_perc"] == 0.0 for i in (await rc.stats())["instances"]):
                    break
                await asyncio.sleep(0.1)
            assert all(i["kv_cache_usage_perc"] == 0.0 for i in (await rc.stats())["instances"])

            held = rc.generate(PROMPTS[0], LONG, "held-again")
            assert not (await held.__anext__()).finished
            pids = [await rc.actor.pid.remote()] + [p for ranks in (await rc.worker_pids()).values() for p in ranks]
            ours = live_placement_groups() - before

            ray.kill(rc.actor, no_restart=True)
            started = time.monotonic()
            with pytest.raises(ServiceUnavailableError) as died:  # an outage (HTTP 503), not the caller's fault
                async for _ in held:
                    pass
            assert "controller actor died" in str(died.value) and time.monotonic() - started < 10
            assert rc.is_dead  # distserve serve exits 1 on this, so that a supervisor starts it anew
        finally:
            await rc.shutdown()  # harmless on a dead actor
        return pids, ours

    pids, ours = asyncio.run(scenario())
    # Its instances and placement groups die with the controller.
    assert wait_until(lambda: not any(process_alive(p) for p in pids), timeout_s=30)
    assert wait_until(lambda: not (live_placement_groups() & ours), timeout_s=30)


def test_a_killed_controller_is_redeployed_its_streams_continue_and_the_budget_is_kept(ray_cluster: Any) -> None:
    import ray

    reference = [o.token_ids for o in LLMEngine(load_model("tiny"), cache_config=CACHE).generate(PROMPTS[:3], RESTART_SP)]

    async def collect(rc: RemoteController, prompt: str, rid: str, started: asyncio.Event) -> list[int]:
        tokens: list[int] = []
        async for out in rc.generate(prompt, RESTART_SP, rid):
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
            events = [asyncio.Event() for _ in PROMPTS[:3]]
            runs = [asyncio.ensure_future(collect(rc, p, f"r{i}", e)) for i, (p, e) in enumerate(zip(PROMPTS[:3], events))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            os.kill(old_pids[0], signal.SIGKILL)  # the controller actor's process, as a crash
            assert await asyncio.wait_for(asyncio.gather(*runs), 180) == reference  # no token twice or missing
            assert rc.num_controller_restarts == 1 and not rc.is_dead
            assert all(i["kv_cache_usage_perc"] == 0.0 for i in (await rc.stats())["instances"])

            # Killed while idle: the health check notices and redeploys; a request arriving meanwhile waits for it.
            # (``ray.kill`` returns before the actor is gone: the checks start once its process has exited.)
            pid = await rc.actor.pid.remote()
            ray.kill(rc.actor, no_restart=True)
            assert wait_until(lambda: not process_alive(pid), timeout_s=30)
            with pytest.raises(ServiceUnavailableError, match="being deployed"):
                await rc.check_health()
            late = [t async for out in rc.generate(PROMPTS[0], RESTART_SP, "late") for t in out.new_token_ids]
            assert late == reference[0] and rc.num_controller_restarts == 2
            await rc.check_health()

            # The budget (2) is spent: the next death is final, as with max_controller_restarts=0.
            pid = await rc.actor.pid.remote()
            ray.kill(rc.actor, no_restart=True)
            assert wait_until(lambda: not process_alive(pid), timeout_s=30)
            with pytest.raises(ServiceUnavailableError):
                [out async for out in rc.generate(PROMPTS[1], RESTART_SP, "final")]
            assert rc.is_dead
        finally:
            await rc.shutdown()
        return old_pids, old_groups

    old_pids, old_groups = asyncio.run(scenario())
    # The first deployment's instances and placement groups are gone.
    assert wait_until(lambda: not any(process_alive(p) for p in old_pids), timeout_s=30)
    assert wait_until(lambda: not (live_placement_groups() & old_groups), timeout_s=30)
