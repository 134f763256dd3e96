"""Sessions: who owns which dataflow, checked on every call, and ended on delete or after an idle TTL.

Parrot's release accepts any ``session_auth``; here a session is created with a random token
(``secrets.token_urlsafe``) that every later call must present, compared in constant time. An
unknown session id is a ``SessionNotFound`` (HTTP 404), a wrong token a ``SessionForbidden``
(403) — so one session never sees another's variables.

A session belongs to the tenant that created it (``TenantSpec``; the anonymous tenant without API
keys): another tenant's request for it is a ``SessionNotFound``, exactly as for an id never
created — never a 403, which would tell it the session exists — so a tenant can neither read nor
end (which cancels the calls of) another tenant's sessions. A tenant holds at most its
``max_sessions`` sessions at once, and the server at most ``SessionLimits.max_sessions`` in all.
Its calls' requests carry the tenant and its tier (``DataflowSession.tenant``).

A session is idle when no request touched it for ``SessionLimits.ttl_s`` and no reader is
waiting on it. Idle sessions are ended by ``sweep``, run in the background every
``SessionLimits.sweep_interval_s`` (``sweep_forever``, started with the HTTP app); an access
between two sweeps finds an expired session gone too.
Ending a session cancels its calls in flight, which aborts their requests and frees their KV,
fails its waiting readers, and drops its variables. How many sessions a server holds, and what
each may hold, is its ``SessionLimits``.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from distserve.cluster.tenants import ANONYMOUS_TENANT, TenantSpec
from distserve.dataflow.executor import DataflowSession
from distserve.dataflow.limits import DEFAULT_LIMITS, LimitExceeded, SessionLimits
from distserve.errors import DataflowError
from distserve.runtime.client import EngineClient

logger = logging.getLogger(__name__)


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

    @property
    def tenant(self) -> str:
        return self.session.tenant.name


class SessionManager:
    """The live sessions of one server, over the engine client that runs their calls."""

    def __init__(self, client: EngineClient, limits: SessionLimits = DEFAULT_LIMITS, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.limits = limits
        self._clock = clock
        self._sessions: dict[str, _Entry] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    def num_sessions_of(self, tenant: str) -> int:
        return sum(1 for entry in self._sessions.values() if entry.tenant == tenant)

    async def create(self, tenant: TenantSpec = ANONYMOUS_TENANT) -> tuple[str, str]:
        """A new session of ``tenant``: its id and its token."""
        tenant_max = tenant.max_sessions
        if len(self._sessions) >= self.limits.max_sessions or (tenant_max is not None and self.num_sessions_of(tenant.name) >= tenant_max):
            await self.sweep()  # expired sessions the background sweep has not reached yet free their slots
        if len(self._sessions) >= self.limits.max_sessions:
            raise LimitExceeded(f"the server holds its maximum of {self.limits.max_sessions} sessions; delete one first", "session_id")
        if tenant_max is not None and self.num_sessions_of(tenant.name) >= tenant_max:
            raise LimitExceeded(f"tenant {tenant.name!r} holds its maximum of {tenant_max} sessions; delete one first", "session_id")
        session_id = str(next(self._ids))
        token = secrets.token_urlsafe(24)
        now = self._clock()
        self._sessions[session_id] = _Entry(DataflowSession(f"s{session_id}", self.client, self.limits, tenant), token, now, now)
        return session_id, token

    async def get(self, session_id: object, token: object, require_token: bool = True, tenant: str = ANONYMOUS_TENANT.name) -> DataflowSession:
        """The session, if it is ``tenant``'s and ``token`` is its token (or, with ``require_token``
        False, no token at all); its idle clock restarts."""
        entry = self._sessions.get(str(session_id)) if isinstance(session_id, (str, int)) and not isinstance(session_id, bool) else None
        if entry is not None and entry.tenant != tenant:
            entry = None  # another tenant's session: answered as if it did not exist (its idle clock untouched)
        if entry is not None and self._expired(entry, self._clock()):  # between two sweeps
            await self._end(str(session_id))
            entry = None
        if entry is None:
            raise SessionNotFound(f"no live session {session_id!r} (never created, deleted or expired)", "session_id")
        if token is None and not require_token:
            pass  # Parrot's released frontend omits the token on semantic calls (opt-in, see SessionLimits)
        elif not isinstance(token, str) or not hmac.compare_digest(token.encode(), entry.token.encode()):
            raise SessionForbidden(f"session_auth does not match session {session_id!r}", "session_auth")
        entry.last_access = self._clock()
        return entry.session

    async def delete(self, session_id: object, token: object, tenant: str = ANONYMOUS_TENANT.name) -> None:
        await self.get(session_id, token, tenant=tenant)
        entry = self._sessions.pop(str(session_id))
        await entry.session.close()

    async def sweep(self) -> None:
        """End the sessions idle for longer than the TTL (a session with a reader waiting is not idle)."""
        now = self._clock()
        for sid in [sid for sid, entry in self._sessions.items() if self._expired(entry, now)]:
            await self._end(sid)

    def _expired(self, entry: _Entry, now: float) -> bool:
        if entry.session.num_readers > 0:
            entry.last_access = now
            return False
        return now - entry.last_access > self.limits.ttl_s

    async def _end(self, session_id: str) -> None:
        entry = self._sessions.pop(session_id, None)
        if entry is not None:
            logger.info("dataflow session %s was idle for over %g s: ended", session_id, self.limits.ttl_s)
            await entry.session.close()

    async def sweep_forever(self) -> None:
        """``sweep`` every ``limits.sweep_interval_s`` until cancelled (the app's lifespan runs it)."""
        while True:
            await asyncio.sleep(self.limits.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - a failed sweep must not stop the next ones
                logger.exception("sweeping idle dataflow sessions failed")

    async def close(self) -> None:
        entries = list(self._sessions.values())
        self._sessions.clear()
        for entry in entries:
            await entry.session.close()
