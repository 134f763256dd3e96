"""The fast tier's promise (tests/conftest.py): tests that start Ray or a process are ``integration``,
by fixture, by marker or by hand, and a fast-tier test that starts one fails loudly."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import subprocess

import pytest


def test_uses_the_ray_cluster(ray_cluster):
    pass


@pytest.mark.slow
def test_loads_the_real_model():
    pass


@pytest.mark.parametrize("runtime", ["local", pytest.param("ray", marks=pytest.mark.integration)])
def test_by_runtime(runtime):
    pass


def test_starts_a_process():
    subprocess.run(["true"])


def test_starts_nothing():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: the real model\n    integration: Ray or processes\n")
    pytester.makepyfile(test_tier_examples=TESTS)
    return pytester


def test_ray_slow_and_marked_tests_are_integration(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-m", "integration", "--collect-only", "-q")
    result.stdout.fnmatch_lines([
        "*::test_uses_the_ray_cluster", "*::test_loads_the_real_model", "*::test_by_runtime[[]ray[]]", "3/6 tests collected*",
    ])


def test_a_fast_test_that_starts_a_process_fails_loudly(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-m", "not integration", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1, errors=1, deselected=3)
    result.stdout.fnmatch_lines(["*test_starts_a_process is in the fast tier but tried to start a subprocess*"])
