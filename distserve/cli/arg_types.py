"""argparse ``type``s for numeric flags: each refuses a bad value with a message argparse prefixes with
the flag's name (``argument --rate: must be a finite number > 0, got nan``), so a command line's bad
input is an error naming the flag, never a traceback or a silently odd run."""

from __future__ import annotations

import argparse
import math


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def at_least_one(text: str) -> float:
    """A finite number >= 1 (a factor such as a slowdown)."""
    value = _number(text)
    if not (value >= 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


__all__ = ["at_least_one", "fraction", "non_negative_float", "non_negative_int", "positive_float", "positive_int"]
