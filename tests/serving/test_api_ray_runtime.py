"""The HTTP API over the Ray runtime (1P1D actors, KV over gloo): parity, streaming, disconnect, metrics."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.placement.placement import Placement
from distserve.serving.api import build_fastapi_app
from distserve.serving.ray_client import ControllerClient

pytestmark = pytest.mark.timeout(300)
CACHE = CacheConfig(num_blocks=1024, block_size=16)
PROMPT = "Hello, my name is"


class RayServer:
    """``ControllerClient`` + the app on uvicorn, in a thread with its own event loop."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.client: ControllerClient | None = None
        self.server: uvicorn.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while self.server is None or not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.client = await ControllerClient.create(
            "tiny", Placement.disaggregated(), dtype="float32", cache_config=CACHE, kv_transfer_timeout_s=20.0
        )
        assert self.client.controller.kv_transfer_timeout_s == 20.0
        app = build_fastapi_app(self.client, "tiny")
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            await self.client.shutdown()

    def stats(self) -> dict[str, Any]:
        assert self.client is not None and self.loop is not None
        return asyncio.run_coroutine_threadsafe(self.client.stats(), self.loop).result(30)  # type: ignore[return-value]

    def stop(self) -> None:
        assert self.server is not None
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


@pytest.fixture(scope="module")
def server(ray_cluster: Any) -> Iterator[RayServer]:
    srv = RayServer()
    try:
        yield srv
    finally:
        srv.stop()


def test_openai_client_greedy_matches_engine(server: RayServer) -> None:
    expected = LLMEngine(load_model("tiny"), cache_config=CACHE).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.0)
    )[0].text
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices
    )
    assert streamed == expected
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'distserve:kv_migration_bytes_total{instance="all",phase="decode"}' in metrics


def test_disconnect_frees_kv_on_both_instances(server: RayServer) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i > 6:
                    break  # leave mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        instances = server.stats()["instances"]
        if all(i["kv_cache_usage_perc"] == 0.0 and i["num_requests_running"] == 0 for i in instances):
            break
        time.sleep(0.1)
    assert all(i["kv_cache_usage_perc"] == 0.0 for i in server.stats()["instances"])
