"""Shared test machinery: the fast/integration tiers and one 2-node Ray cluster on loopback for the
whole session (started on first use).

Tiers: a test is ``integration`` when it starts Ray, spawns a process or loads the real SmolLM2
(``slow``). Modules that are integration as a whole say so with ``pytestmark``; tests that use the
``ray_cluster`` fixture (directly or through another fixture) or carry ``slow`` are marked here at
collection time, so new ones land in the right tier by themselves. ``pytest -m "not integration"``
is the fast tier (``make test-fast``); every test not marked ``integration`` runs under
:func:`fast_tier_guard`, which makes starting a process or Ray fail the test, so the tier stays fast
and Ray-free.
"""

from __future__ import annotations

import multiprocessing.process
import os
import platform
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest

from distserve import compiled

# The stdlib runs `uname -p` in a subprocess the first time anyone asks for the processor (the
# openai client does, per request) and caches the answer: ask once here, before any guard is up.
platform.processor()

# Fixtures whose use makes a test integration (they start Ray).
INTEGRATION_FIXTURES = frozenset({"ray_cluster"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") is not None:
            continue
        if item.get_closest_marker("slow") is not None or INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        elif item.get_closest_marker("interpreted") is not None and compiled.active():
            item.add_marker(pytest.mark.integration)  # it runs in a subprocess (``pytest_pyfunc_call``)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A test marked ``interpreted`` patches functions or classes of the modules ``distserve.compiled``
    compiles, which compiled callers do not see: where this process runs them compiled, the test runs
    in a pytest of its own with them interpreted (``DISTSERVE_COMPILED=0``)."""
    if pyfuncitem.get_closest_marker("interpreted") is None or not compiled.active():
        return None
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
        cwd=pyfuncitem.config.rootpath, env={**os.environ, compiled.ENV: "0"}, capture_output=True, text=True, timeout=600,
    )
    if run.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid}, run interpreted, failed:\n{run.stdout[-4000:]}{run.stderr[-2000:]}")
    return True


@pytest.fixture(autouse=True)
def fast_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Outside ``integration``, starting a subprocess, a multiprocessing child, a fork or Ray fails the test.

    Ray starts its own processes through ``subprocess``, so ``ray.init`` is caught even when ``ray``
    is first imported inside the test; when it is already imported, ``ray.init`` itself raises.
    Attempts are also recorded, so one swallowed in a background thread still fails the test.
    """
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    attempts: list[str] = []  # what was started, and from where

    def refuse(what: str) -> NoReturn:
        attempts.append(f"{what}, from:\n{''.join(traceback.format_stack(limit=12)[:-1])}")
        raise RuntimeError(
            f"{request.node.nodeid} is in the fast tier but tried to start {what}; "
            "mark it (or its module) with pytest.mark.integration"
        )

    monkeypatch.setattr(subprocess.Popen, "_execute_child", lambda *a, **k: refuse("a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda *a, **k: refuse("a multiprocessing process"))
    monkeypatch.setattr(os, "fork", lambda *a, **k: refuse("a fork"))
    monkeypatch.setattr(os, "system", lambda *a, **k: refuse("a shell command"))
    if "ray" in sys.modules:
        monkeypatch.setattr(sys.modules["ray"], "init", lambda *a, **k: refuse("Ray"))
    yield
    if attempts:
        pytest.fail(f"{request.node.nodeid} is in the fast tier but tried to start {attempts[0]}(mark it integration)")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """Ray on this machine as two nodes (``distserve_node_0`` / ``distserve_node_1`` resources)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Keep every Ray address on loopback: otherwise Ray swaps 127.0.0.1 for the host's IP.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Ray prestarts idle Python workers the tests never use (actors get workers of their own); on a
    # 2-core machine starting them takes CPU from the tests' own actors.
    os.environ["RAY_enable_worker_prestart"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    from distserve.runtime.ray_env import keep_ray_on_loopback

    keep_ray_on_loopback()  # also when ray was imported before this fixture ran

    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length limit
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 8, "resources": {"distserve_node_0": 100}, "include_dashboard": False,
            "node_ip_address": "127.0.0.1", "temp_dir": temp_dir,
        },
    )
    cluster.add_node(num_cpus=8, resources={"distserve_node_1": 100}, node_ip_address="127.0.0.1", temp_dir=temp_dir)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
