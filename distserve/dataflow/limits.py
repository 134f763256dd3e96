"""What one owner of dataflow sessions may hold: ``SessionLimits``, and the two refusals a limit gives.

One ``SessionLimits`` belongs to the server (``distserve serve --max-sessions --session-ttl
--max-variables --max-pending-calls --max-value-chars``): ``max_sessions`` counts every tenant's
sessions, the other limits hold per session. A tenant's own share of the sessions is its
``TenantSpec.max_sessions`` (``serve --api-keys``), checked by the ``SessionManager``. A count reached is a
``LimitExceeded`` (HTTP 429: retry once something finished or was deleted); a value, literal or
template longer than ``max_value_chars`` is a ``ValueTooLarge`` (HTTP 413: retrying cannot help).
"""

from __future__ import annotations

from dataclasses import dataclass

from distserve.errors import DataflowError, InvalidConfigError


class LimitExceeded(DataflowError):
    """A count limit is reached (sessions, variables or unfinished calls): HTTP 429."""


class ValueTooLarge(DataflowError):
    """A value, literal input or template is longer than ``max_value_chars``: HTTP 413."""


@dataclass(frozen=True)
class SessionLimits:
    """Bounds on the sessions of one server."""

    ttl_s: float = 600.0  # a session idle this long (no request, no reader waiting) is ended
    max_sessions: int = 1024  # live sessions at once
    max_variables: int = 10_000  # per session, client-set and generated
    max_pending_calls: int = 1024  # per session: submitted and not finished
    max_value_chars: int = 1_000_000  # a set value, a literal input or a template
    # False (``serve --parrot-unauthenticated-calls``): a semantic call carrying a session id but no
    # ``session_auth`` is accepted, because Parrot's released frontend sends calls that way. Every
    # other route still checks the token, and a wrong token is still refused.
    require_auth_on_calls: bool = True

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise InvalidConfigError(f"session ttl must be > 0 seconds, got {self.ttl_s}")
        for name in ("max_sessions", "max_variables", "max_pending_calls", "max_value_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfigError(f"session limit {name} must be an integer >= 1, got {value!r}")

    @property
    def sweep_interval_s(self) -> float:
        """How often the background sweep looks for idle sessions: a quarter of the TTL, within [0.05, 30] s."""
        return min(30.0, max(0.05, self.ttl_s / 4))

    def check_chars(self, text: str, what: str, param: str) -> None:
        if len(text) > self.max_value_chars:
            raise ValueTooLarge(f"{what} may be at most {self.max_value_chars} characters, got {len(text)}", param)


DEFAULT_LIMITS = SessionLimits()
