"""Sessions: a token per session checked in constant time, idle sessions ended, limits."""

from __future__ import annotations

import asyncio

import pytest

from distserve.dataflow.sessions import SessionForbidden, SessionManager, SessionNotFound
from distserve.dataflow.template import parse_call
from distserve.errors import DataflowError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tokens_ttl_and_limits() -> None:
    async def scenario() -> None:
        clock = Clock()
        mgr = SessionManager(client=None, ttl_s=10, max_sessions=2, max_pending_calls=1, clock=clock)  # type: ignore[arg-type]
        sid, token = await mgr.create()
        other, _ = await mgr.create()
        with pytest.raises(DataflowError, match="maximum of 2 sessions"):
            await mgr.create()
        with pytest.raises(SessionForbidden):
            await mgr.get(sid, "not-the-token")
        with pytest.raises(SessionNotFound):
            await mgr.get("404", token)
        session = await mgr.get(int(sid), token)  # Parrot sends numeric ids
        session.submit(parse_call("{{x}}", [{"name": "x", "is_output": True}]))  # not read: waits, not run
        with pytest.raises(DataflowError, match="unfinished calls"):
            mgr.check_pending(session)
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
