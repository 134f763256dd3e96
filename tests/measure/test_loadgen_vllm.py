"""The load generator as a drop-in for ``vllm bench serve``: chat and completions endpoints, inter-token
latency, gamma arrivals (``--burstiness``), ``--max-concurrency`` (counted on the server), vLLM's result keys."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from scipy import stats

from distserve.config import CacheConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.dtypes import resolve_dtype
from distserve.engine.weights import load_model
from distserve.measure import loadgen
from distserve.measure.loadgen import run_load
from distserve.measure.stream_client import completion_body
from distserve.measure.workload import Workload, build_requests, poisson_arrivals
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api import build_fastapi_app
from distserve.slo import SLO

pytestmark = pytest.mark.timeout(120)

VLLM_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput",
             *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")))


# ---- gamma arrivals: no server needed -----------------------------------------------------------
@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 8.0])
def test_burstiness_is_vllms_gamma(burstiness: float) -> None:
    rate = 4.0
    w = Workload(num_requests=4000, rate=rate, input_len=8, output_len=4, seed=11, burstiness=burstiness)
    arrivals = [r.arrival_s for r in build_requests(w)]
    assert arrivals == [r.arrival_s for r in build_requests(w)] and arrivals[0] == 0.0  # seeded
    gaps = np.diff(arrivals)
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.06)  # the rate is kept
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)  # CV = 1/sqrt(shape)
    assert stats.kstest(gaps, "gamma", args=(burstiness, 0, 1 / (rate * burstiness))).pvalue > 0.01
    # A wrong shape is told apart: the test has power.
    assert stats.kstest(gaps, "gamma", args=(burstiness * 2, 0, 1 / (rate * burstiness * 2))).pvalue < 0.01


def test_burstiness_one_is_the_poisson_process_and_inf_is_even() -> None:
    poisson = build_requests(Workload(500, 5.0, 8, 4, seed=7))
    assert [r.arrival_s for r in build_requests(Workload(500, 5.0, 8, 4, seed=7, burstiness=1.0))] == [r.arrival_s for r in poisson]
    rng = np.random.default_rng(np.random.SeedSequence(7).spawn(3)[0])
    assert [r.arrival_s for r in poisson] == poisson_arrivals(500, 5.0, rng)
    even = [r.arrival_s for r in build_requests(Workload(5, 5.0, 8, 4, burstiness=math.inf))]
    assert even == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    with pytest.raises(ValueError, match="burstiness"):
        Workload(5, 5.0, 8, 4, burstiness=0.0)


# ---- against our live API, with the in-flight requests counted on the server ---------------------
class InFlight:
    """ASGI middleware: how many completion requests the server holds open right now, the peak, and the paths."""

    def __init__(self, app: Any) -> None:
        self.app, self.now, self.peak, self.paths = app, 0, 0, []  # type: ignore[var-annotated]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            return await self.app(scope, receive, send)
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.paths.append(scope["path"])
        try:
            await self.app(scope, receive, send)
        finally:
            self.now -= 1

    def reset(self) -> None:
        self.peak, self.paths = self.now, []


class Server:
    """Our OpenAI-compatible app over a colocated tiny engine, behind ``InFlight``, on uvicorn in a thread."""

    def __init__(self) -> None:
        engine = LLMEngine(load_model("tiny", resolve_dtype("auto")), cache_config=CacheConfig(num_blocks=1024, block_size=16))
        self.client = ThreadedEngineClient(engine)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.in_flight = InFlight(build_fastapi_app(self.client, "tiny"))
        self.server = uvicorn.Server(uvicorn.Config(self.in_flight, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.client.close()
        self.sock.close()


@pytest.fixture(scope="module")
def live() -> Iterator[Server]:
    server = Server()
    yield server
    server.stop()


WORKLOAD = Workload(num_requests=8, rate=40.0, input_len=64, output_len=10, seed=5, ignore_eos=True, min_tokens=True)


@pytest.mark.parametrize("endpoint_type,path", [("completions", "/v1/completions"), ("chat", "/v1/chat/completions")])
def test_both_endpoint_types(live: Server, endpoint_type: str, path: str) -> None:
    live.in_flight.reset()
    result = run_load(live.base_url, "tiny", WORKLOAD, SLO(60.0, 60.0), endpoint_type=endpoint_type)
    s = result.summary
    assert (s.num_completed, s.num_errors) == (8, 0), s.error_kinds
    assert set(live.in_flight.paths) == {path} and len(live.in_flight.paths) == 8 + 2  # the requests and two calibration probes
    for r in result.requests:
        assert r.num_output_tokens == WORKLOAD.output_len and r.ttft_s is not None and r.ttft_s > 0
        # the chat template's tokens are calibrated away: prompts hit their target length on either endpoint
        assert r.num_prompt_tokens is not None and abs(r.num_prompt_tokens - WORKLOAD.input_len) <= 0.15 * WORKLOAD.input_len
    if endpoint_type == "chat":
        assert result.calibration[1] > 5  # the template's overhead tokens
    assert result.to_dict()["endpoint_type"] == endpoint_type


def test_bad_endpoint_type_is_refused(live: Server) -> None:
    with pytest.raises(ValueError, match="endpoint type"):
        run_load(live.base_url, "tiny", WORKLOAD, endpoint_type="embeddings")


def _text_chunks(base_url: str, body: dict[str, Any]) -> int:
    """Chunks carrying output in a fresh stream of ``body`` (read without the load generator)."""
    count = 0
    with httpx.stream("POST", base_url + "/completions", json=body, timeout=60, trust_env=False) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                count += any(c.get("text") for c in json.loads(line[5:]).get("choices") or [])
    return count


def test_itl_is_every_gap_between_output_chunks(live: Server) -> None:
    w = Workload(num_requests=4, rate=math.inf, input_len=48, output_len=16, seed=9, ignore_eos=True, min_tokens=True)
    result = run_load(live.base_url, "tiny", w, max_concurrency=1)  # one at a time: greedy output reproducible alone
    specs = build_requests(w, *result.calibration)
    for r, spec in zip(result.requests, specs):
        expected = _text_chunks(live.base_url, completion_body("tiny", spec.prompt, w, spec.output_len, stream=True))
        assert len(r.chunk_times_s) == expected >= 2 and len(r.itls_s) == expected - 1
        assert all(g >= 0 for g in r.itls_s) and sum(r.itls_s) == pytest.approx(r.last_token_s - r.first_token_s)  # type: ignore[operator]
    itls = [g for r in result.requests for g in r.itls_s]
    d = result.to_dict()
    assert d["mean_itl_ms"] == pytest.approx(1000 * np.mean(itls)) and d["p99_itl_ms"] == pytest.approx(1000 * np.percentile(itls, 99))
    assert result.summary.itl_p99_s == pytest.approx(np.percentile(itls, 99))


@pytest.mark.parametrize("limit", [1, 3])
def test_max_concurrency_is_respected_on_the_server(live: Server, limit: int) -> None:
    w = Workload(num_requests=9, rate=math.inf, input_len=32, output_len=12, seed=2, ignore_eos=True, min_tokens=True)
    live.in_flight.reset()
    result = run_load(live.base_url, "tiny", w, max_concurrency=limit)
    assert result.summary.num_completed == 9
    assert live.in_flight.peak == limit  # reached, never exceeded
    # Client side too: never more than `limit` streams overlap.
    spans = sorted((r.sent_s, r.finish_s) for r in result.requests)
    for t, _ in spans:
        assert sum(a <= t < b for a, b in spans) <= limit  # type: ignore[operator]
    assert result.to_dict()["max_concurrency"] == limit


def test_without_a_limit_the_server_holds_more(live: Server) -> None:
    w = Workload(num_requests=9, rate=math.inf, input_len=32, output_len=12, seed=2, ignore_eos=True, min_tokens=True)
    live.in_flight.reset()
    assert run_load(live.base_url, "tiny", w).summary.num_completed == 9
    assert live.in_flight.peak > 3  # the counter sees overlap when there is some


def test_vllm_keys_are_present_and_consistent_with_ours(live: Server) -> None:
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    result = run_load(live.base_url, "tiny", WORKLOAD, slo, metric_percentiles=(50, 99))
    d, s = result.to_dict(), result.summary
    for key in (*VLLM_KEYS, "p50_ttft_ms"):
        assert key in d, key
    done = [r for r in result.requests if r.ok]
    assert d["completed"] == s.num_completed == 8 and d["failed"] == 0
    assert d["duration"] == s.duration_s
    assert d["request_throughput"] == pytest.approx(s.throughput_rps)
    assert d["request_goodput"] == pytest.approx(s.goodput_rps)
    assert d["output_throughput"] == pytest.approx(s.output_tok_s)
    assert d["total_output_tokens"] == sum(r.num_output_tokens for r in done) == 8 * WORKLOAD.output_len
    assert d["total_input_tokens"] == sum(r.num_prompt_tokens for r in done)  # type: ignore[misc]
    assert d["total_token_throughput"] == pytest.approx((d["total_input_tokens"] + d["total_output_tokens"]) / s.duration_s)
    assert d["median_ttft_ms"] == pytest.approx(1000 * s.ttft_p50_s) == pytest.approx(d["p50_ttft_ms"])  # type: ignore[operator]
    assert d["p99_ttft_ms"] == pytest.approx(1000 * s.ttft_p99_s) and d["p99_tpot_ms"] == pytest.approx(1000 * s.tpot_p99_s)  # type: ignore[operator]
    assert d["mean_tpot_ms"] == pytest.approx(1000 * np.mean([r.tpot_s for r in done]))
    assert d["std_e2el_ms"] == pytest.approx(1000 * np.std([r.e2e_s for r in done]))
    assert d["p99_e2el_ms"] == pytest.approx(1000 * s.e2e_p99_s)  # type: ignore[operator]
    # No SLO: no goodput, as vLLM without --goodput.
    assert run_load(live.base_url, "tiny", Workload(2, math.inf, 16, 3)).to_dict()["request_goodput"] is None


def test_cli_takes_vllm_flags(live: Server, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--base-url", live.base_url, "--model", "tiny", "--endpoint-type", "chat", "--request-rate", "50", "--burstiness", "0.5",
            "--max-concurrency", "2", "--num-prompts", "4", "--random-input-len", "32", "--random-output-len", "5", "--ignore-eos",
            "--goodput", "ttft:30000", "tpot:30000", "--metric-percentiles", "90,99", "--json"]
    live.in_flight.reset()
    assert loadgen.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["completed"] == 4 and out["slo"] == {"ttft_s": 30.0, "tpot_s": 30.0} and out["request_goodput"] > 0
    assert out["workload"]["burstiness"] == out["burstiness"] == 0.5 and out["request_rate"] == 50.0
    assert out["endpoint_type"] == "chat" and "p90_itl_ms" in out
    assert live.in_flight.peak <= 2
    for bad, needle in ((["--goodput", "e2el:500"], "end-to-end"), (["--goodput", "ttft:200", "--ttft-slo", "0.2"], "use one"),
                        (["--burstiness", "0"], "burstiness"), (["--max-concurrency", "0"], "--max-concurrency"),
                        (["--ttft-slo", "200"], "milliseconds")):
        with pytest.raises(SystemExit) as info:
            loadgen.main([*argv[:argv.index("--goodput")], *bad, "--json"])
        assert info.value.code == 2 and needle in capsys.readouterr().err
