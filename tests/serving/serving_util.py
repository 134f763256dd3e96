"""Helpers shared by the serving tests (importable as ``serving_util``: pytest puts this folder on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())
