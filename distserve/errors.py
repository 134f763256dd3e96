"""Errors that cross module boundaries, by who is at fault.

- ``DistServeError`` (a ``ValueError``): the caller's input is bad (CLI exit 2 / HTTP 4xx). It
  may name the request field at fault (``param``), which the HTTP API reports as OpenAI's ``param``.
- ``ServiceUnavailableError``: the service cannot take the request now (no live instance of a
  phase, the engine or controller gone): HTTP 503 with ``Retry-After``, never a 4xx.
- ``StepFailedError``: one engine step raised; it names the requests that step computed, which is
  what crash attribution (``distserve.cluster.recovery``) blames.
"""

from __future__ import annotations


class DistServeError(ValueError):
    """Base class of every user-facing input error (maps to CLI exit code 2 / HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, as the API names it (``max_tokens``, ``seed``)

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:  # crosses Ray with its param
        return (type(self), (str(self), self.param))


class InvalidSamplingParamsError(DistServeError):
    """A sampling parameter is outside its valid range."""


class PromptTooLongError(DistServeError):
    """The prompt (plus requested output) does not fit the model's context."""


class ModelNotFoundError(DistServeError):
    """The model name is unknown, or its weights cannot be obtained or read."""


class InvalidConfigError(DistServeError):
    """An engine/cache/scheduler/parallel configuration value is invalid."""


class QueueFullError(DistServeError):
    """Admission refused: the request queue (or the tenant's share of it, or its token rate) is at
    its bound (HTTP 429). ``retry_after_s``: when to retry, from the measured drain rate (None: unknown).
    ``shared``: the bound is the whole server's (requests in flight, the queue's length or predicted
    wait), so any request arriving before ``retry_after_s`` would be refused alike — not one tenant's
    share, rate or grammar (``serving.overload_gate`` refuses those at the door)."""

    def __init__(self, message: str, param: str | None = None, retry_after_s: float | None = None, shared: bool = False) -> None:
        super().__init__(message, param)
        self.retry_after_s = retry_after_s
        self.shared = shared

    def __reduce__(self) -> tuple[type, tuple[str, str | None, float | None, bool]]:  # type: ignore[override]
        return (type(self), (str(self), self.param, self.retry_after_s, self.shared))


class RequestTimeoutError(DistServeError):
    """The request waited in the admission queue longer than its ``timeout`` and was dropped (HTTP 408)."""


class ServiceUnavailableError(RuntimeError):
    """The service cannot serve now — an outage, not the request's fault (HTTP 503, ``Retry-After``)."""


class EngineDeadError(ServiceUnavailableError):
    """The engine stopped (its steps kept failing, or it was shut down): requests fail with this."""


class StepFailedError(RuntimeError):
    """An engine step raised; ``seq_ids`` are the requests its plan computed (the suspects)."""

    def __init__(self, message: str, seq_ids: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.seq_ids = tuple(seq_ids)

    def __reduce__(self) -> tuple[type, tuple[str, tuple[str, ...]]]:
        return (type(self), (str(self), self.seq_ids))


class DataflowError(DistServeError):
    """A semantic call, variable or session request is malformed or refers to what it may not (HTTP 4xx)."""
