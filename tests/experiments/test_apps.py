"""The example applications of ``experiments/apps``: each app's dataflow program gives the same
outputs as its request-centric version (greedy, fixed lengths), on a real server of the tiny model,
with and without a simulated client delay.

"Same outputs" needs the same prompts: the dataflow programs here are sent with ``model_type``
``text`` (the rendered string, what the request-centric client sends). With ``token_id`` (the
default, what the benchmark runs) a generated variable reaches its readers as the ids it was
generated as, which need not be the ids its text re-tokenizes to (``"\n" + "\n"`` vs
``"\n\n"``), so outputs may legitimately differ at such boundaries; that recipe's own equality
with calls issued one by one is tested in ``tests/dataflow/test_executor.py``. One test here runs
the default mode and checks every output has its configured length."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from serving_util import HttpServer, colocated_server

from distserve.config import CacheConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)
CACHE = CacheConfig(num_blocks=512, block_size=16)


def _apps() -> ModuleType:
    """experiments/apps, imported by path as ``apps`` (the scripts import it from their own folder)."""
    if "apps" not in sys.modules:
        folder = ROOT / "experiments" / "apps"
        spec = importlib.util.spec_from_file_location("apps", folder / "__init__.py", submodule_search_locations=[str(folder)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["apps"] = module
        spec.loader.exec_module(module)
    return sys.modules["apps"]


apps = _apps()
APP_NAMES = [a.name for a in apps.make_apps(quick=True, seed=0)]


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    srv = colocated_server(CACHE)
    yield srv
    srv.stop()


async def _both_ways(url: str, app: object, delay_s: float, model_type: str = "text") -> tuple[object, object]:
    rc = apps.RequestClient(url, delay_s)
    try:
        baseline = await app.request_centric(rc)  # type: ignore[attr-defined]
        dataflow = await app.dataflow(apps.DataflowClient(url, delay_s, model_type), rc)  # type: ignore[attr-defined]
    finally:
        await rc.aclose()
    return baseline, dataflow


@pytest.mark.parametrize("name", APP_NAMES)
def test_dataflow_program_gives_the_request_centric_outputs(server: HttpServer, name: str) -> None:
    app = next(a for a in apps.make_apps(quick=True, seed=7) if a.name == name)
    baseline, dataflow = asyncio.run(_both_ways(server.url, app, 0.0))
    assert len(baseline.outputs) == len(dataflow.outputs) >= 1
    assert all(baseline.outputs), baseline.outputs  # every output generated (fixed length, EOS ignored)
    assert dataflow.outputs == baseline.outputs
    assert baseline.latency_s > 0 and dataflow.latency_s > 0


@pytest.mark.parametrize("name", APP_NAMES)
def test_the_default_token_id_prompts_run_every_app(server: HttpServer, name: str) -> None:
    app = next(a for a in apps.make_apps(quick=True, seed=3) if a.name == name)
    baseline, dataflow = asyncio.run(_both_ways(server.url, app, 0.0, model_type="token_id"))
    assert len(dataflow.outputs) == len(baseline.outputs) >= 1
    assert all(dataflow.outputs), dataflow.outputs


def test_the_simulated_delay_is_paid_per_request(server: HttpServer) -> None:
    """A chain of n calls request by request pays n round trips; the same app takes longer with a delay."""
    chain = next(a for a in apps.make_apps(quick=True, seed=11) if a.name == "chain")
    baseline, dataflow = asyncio.run(_both_ways(server.url, chain, 0.2))
    assert baseline.latency_s >= 0.2 * chain.num_chunks
    assert dataflow.latency_s >= 0.2 * 3  # two rounds of submissions and the final read
    assert dataflow.outputs == baseline.outputs


def test_a_deep_dag_is_submitted_in_two_rounds_of_concurrent_requests(server: HttpServer) -> None:
    """submit_dag: the sources and the variable creations at once, then every other call at once (a consumer may arrive first)."""
    spans: list[tuple[str, float, float]] = []

    class Logged(apps.clients.DelayedSession):
        def _call(self, method: str, path: str, payload: Any) -> Any:
            start = time.monotonic()
            try:
                return super()._call(method, path, payload)
            finally:
                spans.append((path, start, time.monotonic()))

    step = apps.template_function("step", "Say {{x}}:{{out}}", "out", max_tokens=2)
    calls = [(step, {"x": "go"})] + [(step, {"x": apps.OutputOf(i)}) for i in range(5)]  # a chain six calls deep
    with Logged(server.url, 0.2) as s:
        spans.clear()
        outs = asyncio.run(apps.DataflowClient(server.url, 0.2).submit_dag(s, "latency", calls))
        assert len(outs) == 6 and len({v.var_id for v in outs}) == 6 and outs[-1].get()
    spans.sort(key=lambda span: span[1])
    first_end = min(end for _, _, end in spans)
    round_a = [span for span in spans if span[1] < first_end]
    round_b = spans[len(round_a):10]  # then the read and the session's deletion
    assert sorted(path for path, _, _ in round_a) == ["/v1/semantic_call"] + ["/v1/semantic_var"] * 4  # the source, 4 passed variables
    assert [path for path, _, _ in round_b] == ["/v1/semantic_call"] * 5
    assert max(end for _, _, end in round_a) <= min(start for _, start, _ in round_b) < min(end for _, _, end in round_b)


def test_render_cuts_the_template_at_its_output() -> None:
    fn = apps.template_function("f", "A {{x}}\nB {{y}}:{{out}} tail", "out", max_tokens=5)
    prompt, sampling = apps.render(fn, {"x": "1", "y": "2"})
    assert prompt == "A 1\nB 2:"
    assert sampling == {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    assert set(fn.inputs) == {"x", "y"} and set(fn.outputs) == {"out"}
    with pytest.raises(ValueError, match="not in the template"):
        apps.template_function("g", "no output {{x}}", "out", max_tokens=1)
