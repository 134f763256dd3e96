"""Helpers shared by the serving tests (importable as ``serving_util``: pytest puts this folder on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.outputs import RequestOutput
from distserve.engine.step_plan import SampledToken, StepPlan
from distserve.measure.benchserve import default_sigint
from distserve.runtime.config import DeploymentConfig
from distserve.placement import Placement
from distserve.serving.api import build_fastapi_app
from distserve.serving.api_keys import ApiKeys
from distserve.serving.limits import DEFAULT_HTTP_LIMITS, uvicorn_config
from distserve.runtime.client import EngineClient
from distserve.runtime.controller import Controller
from distserve.ports import free_port


async def drain(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A stream's last output (it must finish)."""
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    return last


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric_samples(url: str) -> Samples:
    """The server's ``/metrics`` samples by (name, sorted labels), ``model_name`` left out of the labels
    once checked: every sample must carry it."""
    text = httpx.get(f"{url}/metrics").text  # no key: /metrics stays open
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name"), f"{s.name}{s.labels} has no model_name"
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


class ControllerRuntime:
    """A ``Controller`` of the tiny model on a background event loop in this process, so a test can
    reach its instances (inject faults, pin routes, find worker pids)."""

    def __init__(self, placement: Placement, cache: CacheConfig, sampling: SamplingParams, **controller_kw: Any) -> None:
        self.sampling = sampling
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.controller = Controller(DeploymentConfig("tiny", placement, dtype="float32", cache_config=cache, **controller_kw))
        self.ids = itertools.count()
        try:
            self.run(self.controller.start(), timeout_s=180.0)
        except BaseException:
            self.close()
            raise

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _one(self, prompt: str, pin: tuple[str | None, str | None] | None) -> list[int]:
        request_id = f"rt-{next(self.ids)}"
        if pin is not None:
            self.controller.pin(request_id, *pin)
        last = await self.final_output(prompt, request_id)
        assert last.error is None, last.error
        return list(last.token_ids)

    async def final_output(self, prompt: str, request_id: str) -> RequestOutput:
        last = None
        async for out in self.controller.generate(prompt, self.sampling, request_id):
            last = out
        assert last is not None and last.finished
        return last

    def generate(self, prompt: str, pin: tuple[str | None, str | None] | None = None, timeout_s: float = 60.0) -> list[int]:
        return self.run(self._one(prompt, pin), timeout_s)  # type: ignore[no-any-return]

    def generate_many(self, prompts: list[str], timeout_s: float = 120.0) -> list[list[int]]:
        async def all_of() -> list[list[int]]:
            return list(await asyncio.gather(*(self._one(p, None) for p in prompts)))

        return self.run(all_of(), timeout_s)  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        return self.run(self.controller.stats())  # type: ignore[no-any-return]

    def inject(self, instance_id: str, kind: str, rank: int = 0) -> None:
        import ray

        inst = next(i for i in self.controller.instances if i.spec.instance_id == instance_id)
        ray.get(inst.actor.inject_transfer_fault.remote(kind, rank))

    def all_freed(self) -> bool:
        """No KV held, reserved, awaiting migration or in flight anywhere."""
        s = self.stats()
        return s["num_requests_awaiting_migration"] == 0 and all(
            i["kv_cache_usage_perc"] == 0.0
            and i["num_kv_transfers_in_flight"] == 0
            and i.get("num_requests_migrating", 0) == 0
            and i.get("num_requests_awaiting_migration", 0) == 0
            for i in s["instances"]
        )

    def close(self) -> None:
        try:
            self.run(self.controller.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


class HttpServer:
    """The HTTP app (``build_fastapi_app`` with ``app_kw``) over the client ``make_client`` builds, on uvicorn
    on a free loopback port, in a thread with its own event loop (where the client lives, as in ``distserve serve``)."""

    def __init__(self, make_client: Callable[[], Awaitable[EngineClient]], start_timeout_s: float = 180.0, api_keys: ApiKeys | None = None,
                 **app_kw: Any) -> None:
        import uvicorn

        from distserve.serving.server import open_listen_socket

        self.sock = open_listen_socket("127.0.0.1", 0)  # as `distserve serve` binds it (TCP_NODELAY on its connections)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.client: EngineClient | None = None
        self.app: Any = None
        self.server: uvicorn.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.failure: BaseException | None = None

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            try:
                self.client = await make_client()
            except BaseException as exc:  # noqa: BLE001 - reported by the constructor
                self.failure = exc
                return
            app = self.app = build_fastapi_app(self.client, "tiny", api_keys=api_keys, **app_kw)
            limits = app_kw.get("http_limits", DEFAULT_HTTP_LIMITS)  # the connections' side too, as in `distserve serve`
            self.server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning", access_log=False, timeout_graceful_shutdown=1))
            try:
                await self.server.serve(sockets=[self.sock])
            finally:
                await self.client.shutdown()

        self.thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while self.server is None or not self.server.started:
            if self.failure is not None:
                raise self.failure
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    def call(self, coro: Awaitable[Any], timeout_s: float = 30.0) -> Any:
        """Run ``coro`` (e.g. a client method) on the server's event loop."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


def colocated_server(cache: CacheConfig, model: str = "tiny") -> HttpServer:
    """The HTTP app over one in-process colocated engine (no Ray) of ``model`` (the tiny one by default)."""
    from distserve.engine.llm_engine import LLMEngine
    from distserve.engine.weights import load_model
    from distserve.runtime.threaded_client import ThreadedEngineClient

    loaded = load_model(model)

    async def make_client() -> ThreadedEngineClient:
        return ThreadedEngineClient(LLMEngine(loaded, cache_config=cache))

    return HttpServer(make_client)


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not count)."""
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


def descendants(root: int) -> dict[int, str]:
    """The processes started from ``root`` (children, their children, ...), by pid, with their command lines."""
    parents = {int(p.name): _ppid(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    ours = {root}
    grew = True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in ours and pid not in ours}
        ours |= new
        grew = bool(new)
    ours.discard(root)
    return {pid: _cmdline(pid) for pid in ours}


class ServeRun:
    """``serve run CONFIG`` (Ray Serve's CLI) in a process of its own, which starts a private Ray on loopback.

    ``config`` is a Serve config (the mapping a YAML file holds): it is written to ``workdir`` with the
    proxy moved to a free port (``url``). ``stop`` sends Ctrl-C, as a user would, and returns the
    processes that were running then and are still alive afterwards (which it then kills).
    """

    READY_TIMEOUT_S = 240.0

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        import yaml

        self.port = free_port()
        config = {**config, "http_options": {**config.get("http_options", {}), "host": "127.0.0.1", "port": self.port}}
        self.url = f"http://127.0.0.1:{self.port}"
        self.path = workdir / "serve_config.yaml"
        self.path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / "serve_run.log"
        ray_tmp = tempfile.mkdtemp(prefix="sr", dir="/tmp")  # Ray's socket paths must stay short
        env = {
            **os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": ray_tmp,
            "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 8}),  # ray.init(num_cpus=8): the actors ask 0.1 CPU each
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        env.pop("RAY_ADDRESS", None)
        serve_cli = Path(sys.executable).parent / "serve"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(serve_cli), "run", str(self.path)], cwd=workdir, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=default_sigint)
        self.ray_tmp = ray_tmp

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until ``GET /v1/models`` answers 200 (the app is deployed), or fail with the log's tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve run exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise AssertionError(f"serve run not ready after {timeout_s:g} s:\n{self.log()[-4000:]}")

    def stop(self, timeout_s: float = 150.0) -> dict[int, str]:
        """Ctrl-C; the processes it had started that are still alive once it exited (killed then). Serve's
        shutdown took over 60 s on a loaded 2-core machine; killed instead, it left Ray's agents behind."""
        import shutil
        import signal

        running = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 30
        while any(process_alive(pid) for pid in running) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: cmd for pid, cmd in running.items() if process_alive(pid)}
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return left


class ScriptedTokens:
    """Wraps an engine's runner: the model runs as usual, then each sampled token is replaced by the
    script's token at that output position (the script ends with EOS), while a script is set."""

    def __init__(self, engine: LLMEngine) -> None:
        self.ids: list[int] | None = None
        self.tokenizer = engine.tokenizer
        self.eos = engine.eos_token_ids[0]
        real = engine.runner.execute

        def execute(plan: StepPlan) -> list[SampledToken]:
            sampled = real(plan)
            if self.ids is None:
                return sampled
            position = {c.seq_id: c.num_output_tokens for c in plan.chunks if c.sample}
            return [SampledToken(s.seq_id, self.ids[min(position[s.seq_id], len(self.ids) - 1)], s.logprob) for s in sampled]

        engine.runner.execute = execute  # type: ignore[method-assign]

    def say(self, text: str | None) -> None:
        self.ids = None if text is None else self.tokenizer.encode(text, add_special_tokens=False) + [self.eos]


@contextlib.contextmanager
def serve_process(*flags: str, startup_timeout_s: float = 90.0) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`distserve serve --model tiny FLAGS` as a process on a free loopback port, once ``/health`` answers:
    the process and its base URL. Killed on the way out if still running (``stop_process`` ends it cleanly)."""
    import httpx

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "distserve.cli", "serve", "--model", "tiny", "--port", str(port), "--log-level", "warning", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_timeout_s
        while True:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def stop_process(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> tuple[str, str]:
    """SIGINT, as Ctrl-C: the process's stdout and stderr once it has exited."""
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=timeout_s)
