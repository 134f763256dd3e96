"""Sessions: a token per session checked in constant time, idle sessions ended in the background (their requests aborted), limits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest

from distserve.config import CacheConfig
from distserve.dataflow.executor import DataflowSession, VariableFailed
from distserve.dataflow.limits import LimitExceeded, SessionLimits, ValueTooLarge
from distserve.dataflow.sessions import SessionForbidden, SessionManager, SessionNotFound
from distserve.dataflow.template import parse_call
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.errors import InvalidConfigError
from distserve.runtime.threaded_client import ThreadedEngineClient

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def client() -> Iterator[ThreadedEngineClient]:
    c = ThreadedEngineClient(LLMEngine(load_model("tiny"), cache_config=CacheConfig(num_blocks=256, block_size=16)))
    yield c
    c.close()


def test_tokens_ttl_and_limits() -> None:
    async def scenario() -> None:
        clock = Clock()
        limits = SessionLimits(ttl_s=10, max_sessions=2, max_pending_calls=1, max_variables=3, max_value_chars=8)
        mgr = SessionManager(None, limits, clock=clock)  # type: ignore[arg-type]  # no call runs here
        sid, token = await mgr.create()
        other, _ = await mgr.create()
        with pytest.raises(LimitExceeded, match="maximum of 2 sessions"):
            await mgr.create()
        with pytest.raises(SessionForbidden):
            await mgr.get(sid, "not-the-token")
        with pytest.raises(SessionNotFound):
            await mgr.get("404", token)
        session = await mgr.get(int(sid), token)  # Parrot sends numeric ids
        session.submit(parse_call("{{x}}", [{"name": "x", "is_output": True}]))  # not read: waits, not run
        with pytest.raises(LimitExceeded, match="unfinished calls"):
            session.submit(parse_call("{{y}}", [{"name": "y", "is_output": True}]))
        v = session.graph.new_variable("a")
        with pytest.raises(ValueTooLarge, match="at most 8 characters"):
            await session.set(v.var_id, "123456789")
        session.graph.new_variable("b")
        with pytest.raises(LimitExceeded, match="maximum of 3 variables"):
            session.graph.new_variable("c")
        with pytest.raises(ValueTooLarge, match="template may be at most 8"):
            parse_call("a long template {{x}}", [{"name": "x", "is_output": True}], limits=limits)
        clock.now = 8.0
        await mgr.get(sid, token)  # an access restarts the idle clock
        clock.now = 15.0
        await mgr.sweep()
        assert len(mgr) == 1  # ``other`` was idle for 15 s > 10 s
        with pytest.raises(SessionNotFound):
            await mgr.get(other, "")
        await mgr.delete(sid, token)
        assert len(mgr) == 0

    asyncio.run(scenario())
    with pytest.raises(InvalidConfigError, match="max_sessions"):
        SessionLimits(max_sessions=0)
    with pytest.raises(InvalidConfigError, match="ttl"):
        SessionLimits(ttl_s=0)


@contextlib.asynccontextmanager
async def swept_session(client: ThreadedEngineClient, ttl_s: float) -> AsyncIterator[tuple[SessionManager, str, str, DataflowSession]]:
    """A manager sweeping in the background (as the app's lifespan runs it) and one new session of it."""
    mgr = SessionManager(client, SessionLimits(ttl_s=ttl_s))
    sweeper = asyncio.create_task(mgr.sweep_forever())
    try:
        sid, token = await mgr.create()
        yield mgr, sid, token, await mgr.get(sid, token)
    finally:
        sweeper.cancel()
        await mgr.close()


def test_the_background_sweep_ends_an_idle_session_and_aborts_its_calls(client: ThreadedEngineClient) -> None:
    async def scenario() -> None:
        async with swept_session(client, ttl_s=0.2) as (mgr, sid, token, session):
            long = {"temperature": 0, "max_gen_length": 900, "ignore_tokenizer_eos": True}
            a = session.submit(parse_call("Go: {{x}}", [{"name": "x", "is_output": True, "sampling_config": long}]), criteria="throughput")
            doc = session.graph.new_variable("doc")  # never set: the session ending fails it
            await asyncio.sleep(0.05)
            assert client.num_outstanding == 1  # generating, and nobody touches the session
            for _ in range(100):
                if len(mgr) == 0:
                    break
                await asyncio.sleep(0.02)
            assert len(mgr) == 0, "the idle session was not ended in the background"
            assert client.num_outstanding == 0  # its request was aborted, not left to finish 900 tokens
            assert "the session was ended" in (a.outputs["x"].error or "") and "the session was ended" in (doc.error or "")
            for _ in range(100):  # the engine thread frees the KV once it sees the abort
                if all(i["kv_cache_usage_perc"] == 0.0 and i["num_requests_running"] == 0 for i in (await client.stats())["instances"]):
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the aborted request still holds KV")
            with pytest.raises(SessionNotFound):
                await mgr.get(sid, token)

    asyncio.run(scenario())


def test_a_session_with_a_reader_waiting_is_not_idle_and_ending_it_releases_the_reader(client: ThreadedEngineClient) -> None:
    async def scenario() -> None:
        async with swept_session(client, ttl_s=0.1) as (mgr, sid, token, session):
            pending = session.graph.new_variable("never")
            with pytest.raises(TimeoutError):
                await session.get(pending.var_id, "latency", timeout_s=0.4)  # four TTLs long
            assert len(mgr) == 1  # kept alive while read
            reading = asyncio.ensure_future(session.get(pending.var_id, "latency", timeout_s=30))
            await asyncio.sleep(0.05)
            await mgr.delete(sid, token)
            with pytest.raises(VariableFailed, match="the session was ended"):
                await asyncio.wait_for(reading, 5)  # returns at once, not after its 30 s timeout

    asyncio.run(scenario())
