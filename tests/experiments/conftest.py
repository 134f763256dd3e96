"""The experiments' quick runs share one fork server (``script_runner``), stopped when the session ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from script_runner import RUNNER


@pytest.fixture(scope="session", autouse=True)
def _stop_the_script_runner() -> Iterator[None]:
    yield
    RUNNER.close()
