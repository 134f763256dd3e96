"""Sessions: who owns which dataflow, checked on every call, and ended on delete or after an idle TTL.

Parrot's release accepts any ``session_auth``; here a session is created with a random token
(``secrets.token_urlsafe``) that every later call must present, compared in constant time. An
unknown session id is a ``SessionNotFound`` (HTTP 404), a wrong token a ``SessionForbidden``
(403) — so one session never sees another's variables. A session idle for ``ttl_s`` is ended on
the next sweep (``sweep``, run on every access): its calls in flight are cancelled, which aborts
their requests and frees their KV.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from distserve.dataflow.executor import DataflowSession
from distserve.dataflow.graph import CallState
from distserve.errors import DataflowError
from distserve.runtime.client import EngineClient

DEFAULT_SESSION_TTL_S = 600.0
DEFAULT_MAX_SESSIONS = 1024
DEFAULT_MAX_PENDING_CALLS = 1024  # per session: calls submitted and not finished


class SessionNotFound(DataflowError):
    """No live session with this id (never created, deleted or expired)."""


class SessionForbidden(DataflowError):
    """The session exists, but the token presented is not its token."""


@dataclass
class _Entry:
    session: DataflowSession
    token: str
    last_access: float
    created: float = field(default_factory=time.monotonic)


class SessionManager:
    """The live sessions of one server, over the engine client that runs their calls."""

    def __init__(
        self, client: EngineClient, *, ttl_s: float = DEFAULT_SESSION_TTL_S, max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_pending_calls: int = DEFAULT_MAX_PENDING_CALLS, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl_s > 0:
            raise DataflowError(f"session ttl must be > 0 seconds, got {ttl_s}")
        self.client = client
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_pending_calls = max_pending_calls
        self._clock = clock
        self._sessions: dict[str, _Entry] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    async def create(self) -> tuple[str, str]:
        """A new session: its id and its token."""
        await self.sweep()
        if len(self._sessions) >= self.max_sessions:
            raise DataflowError(f"the server holds its maximum of {self.max_sessions} sessions; delete one first", "session_id")
        session_id = str(next(self._ids))
        token = secrets.token_urlsafe(24)
        now = self._clock()
        self._sessions[session_id] = _Entry(DataflowSession(f"s{session_id}", self.client), token, now, now)
        return session_id, token

    async def get(self, session_id: object, token: object) -> DataflowSession:
        """The session, if ``token`` is its token; its idle clock restarts."""
        await self.sweep()
        entry = self._sessions.get(str(session_id)) if isinstance(session_id, (str, int)) and not isinstance(session_id, bool) else None
        if entry is None:
            raise SessionNotFound(f"no live session {session_id!r} (never created, deleted or expired)", "session_id")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), entry.token.encode()):
            raise SessionForbidden(f"session_auth does not match session {session_id!r}", "session_auth")
        entry.last_access = self._clock()
        return entry.session

    def check_pending(self, session: DataflowSession) -> None:
        pending = sum(1 for n in session.graph.calls.values() if n.state in (CallState.WAITING, CallState.RUNNING))
        if pending >= self.max_pending_calls:
            raise DataflowError(f"the session has {pending} unfinished calls (max {self.max_pending_calls})", "session_id")

    async def delete(self, session_id: object, token: object) -> None:
        await self.get(session_id, token)
        entry = self._sessions.pop(str(session_id))
        await entry.session.close()

    async def sweep(self) -> None:
        """End the sessions idle for longer than the TTL."""
        now = self._clock()
        expired = [sid for sid, e in self._sessions.items() if now - e.last_access > self.ttl_s]
        for sid in expired:
            await self._sessions.pop(sid).session.close()

    async def close(self) -> None:
        for entry in list(self._sessions.values()):
            await entry.session.close()
        self._sessions.clear()
