"""The Ray Serve application: deploy ``build_app({"model": "tiny"})``, answer over HTTP, leave no Ray process behind."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from distserve.config import SamplingParams
from distserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.integration  # starts Ray and Ray Serve

PROMPT = "Hello, my name is"


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ray_descendants() -> dict[int, str]:
    """Ray processes started from this test process (workers, raylet, GCS), by pid."""
    parents = {int(p.name): _ppid(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    ours = {os.getpid()}
    grew = True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in ours and pid not in ours}
        ours |= new
        grew = bool(new)
    ours.discard(os.getpid())
    return {pid: cmd for pid in ours if "ray" in (cmd := _cmdline(pid))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_session() -> Iterator[Callable[[], dict[int, str]]]:
    """A private loopback Ray; the callable tears it down and returns the Ray processes that were running."""
    import ray
    from ray import serve

    from distserve.runtime.ray_env import init_ray_local

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process; this test needs an instance of its own")
    previous = os.environ.get("RAY_AUTH_MODE")
    temp_dir = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # Ray's socket paths must stay short
    assert init_ray_local(temp_dir)  # ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", ...)
    state: dict[str, dict[int, str] | None] = {"procs": None}

    def teardown() -> dict[int, str]:
        procs = state["procs"]
        if procs is None:
            procs = state["procs"] = ray_descendants()
            serve.shutdown()
            ray.shutdown()
        return procs

    try:
        yield teardown
    finally:
        teardown()
        if previous is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = previous
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.timeout(300)
def test_ray_serve_app_completes_and_shuts_down(ray_session: Callable[[], dict[int, str]]) -> None:
    import ray
    from ray import serve

    from distserve.errors import InvalidConfigError
    from distserve.serving.app import ServeOptions, build_app

    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    options = ServeOptions.from_args({"model": "tiny", "colocated": "2", "kv_cache_gb": "0.25"})
    assert (options.colocated, options.kv_cache_gb, options.prefill) == (2, 0.25, 1)
    with pytest.raises(InvalidConfigError, match="modle"):
        ServeOptions.from_args({"modle": "tiny"})
    with pytest.raises(InvalidConfigError, match="prefill"):
        ServeOptions.from_args({"prefill": "two"})

    expected = LLMEngine("tiny").generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": "tiny"}), name="distserve", route_prefix="/")
    url = f"http://127.0.0.1:{port}"

    resp = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)

    body_stream = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body_stream, timeout=60) as stream:
        events = [line[len("data: ") :] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected.text
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200

    procs = ray_session()
    assert any("ray::" in cmd for cmd in procs.values()), "expected Ray worker processes while serving"
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: cmd for pid, cmd in procs.items() if _alive(pid)}
    assert not left, f"Ray processes left behind: {left}"
    assert not {pid for pid, cmd in ray_descendants().items() if "ray::" in cmd}
