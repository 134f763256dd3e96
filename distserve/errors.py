"""Errors raised for bad input. All are ``ValueError`` subclasses so callers can catch one type."""

from __future__ import annotations


class DistServeError(ValueError):
    """Base class of every user-facing input error (maps to CLI exit code 2 / HTTP 400)."""


class InvalidSamplingParamsError(DistServeError):
    """A sampling parameter is outside its valid range."""


class PromptTooLongError(DistServeError):
    """The prompt (plus requested output) does not fit the model's context."""


class ModelNotFoundError(DistServeError):
    """The model name is unknown, or its weights cannot be obtained or read."""


class InvalidConfigError(DistServeError):
    """An engine/cache/scheduler/parallel configuration value is invalid."""


class QueueFullError(DistServeError):
    """Admission refused: the request queue is at its bound (HTTP 429)."""
