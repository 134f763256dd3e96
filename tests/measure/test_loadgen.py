"""The load generator: seeded Poisson workload, summary math on hand-made results, and runs against our live API."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import uvicorn
from scipy import stats

from distserve.measure import loadgen
from distserve.config import CacheConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.dtypes import resolve_dtype
from distserve.engine.weights import load_model
from distserve.measure import load_summary
from distserve.measure.load_summary import summarize
from distserve.measure.loadgen import run_load
from distserve.measure.stream_client import RequestResult
from distserve.measure.workload import Workload, build_requests, words_for
from distserve.runtime.threaded_client import ThreadedEngineClient
from distserve.serving.api import build_fastapi_app
from distserve.slo import SLO, max_misses

pytestmark = pytest.mark.timeout(120)


# ---- workload ------------------------------------------------------------------------------
def test_arrivals_are_seeded_and_poisson() -> None:
    w = Workload(num_requests=2000, rate=5.0, input_len=32, output_len=4, seed=7)
    arrivals = [r.arrival_s for r in build_requests(w)]
    assert arrivals == [r.arrival_s for r in build_requests(w)]  # reproducible
    assert arrivals != [r.arrival_s for r in build_requests(Workload(2000, 5.0, 32, 4, seed=8))]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    gaps = np.diff(arrivals)
    assert np.mean(gaps) == pytest.approx(1 / 5.0, rel=0.1)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 5.0)).pvalue > 0.01  # exponential gaps
    # Arrivals come from their own RNG stream: another length distribution does not move them.
    other = Workload(2000, 5.0, 32, 4, input_len_dist="uniform", seed=7)
    assert [r.arrival_s for r in build_requests(other)] == arrivals
    assert all(r.arrival_s == 0.0 for r in build_requests(Workload(5, float("inf"), 8, 4)))
    # A prompt seed changes the prompts, not the arrivals; the same seed at another rate scales the gaps.
    reprompted = build_requests(Workload(2000, 5.0, 32, 4, seed=7, prompt_seed=99))
    assert [r.arrival_s for r in reprompted] == arrivals
    assert not {r.prompt for r in reprompted} & {r.prompt for r in build_requests(w)}
    faster = [r.arrival_s for r in build_requests(Workload(2000, 10.0, 32, 4, seed=7))]
    assert faster == pytest.approx([a / 2 for a in arrivals])


def test_input_lengths_and_prompts() -> None:
    fixed = build_requests(Workload(50, 1.0, 100, 4))
    assert {r.input_len for r in fixed} == {100}
    assert all(len(r.prompt.split()) == 100 for r in fixed)  # one token per word when uncalibrated
    assert len({r.prompt for r in fixed}) == 50  # distinct, so prefix caching cannot skip prefill
    assert len({r.prompt.split()[0] + r.prompt.split()[1] for r in fixed}) > 40

    uniform = build_requests(Workload(500, 1.0, 100, 4, input_len_dist="uniform", input_len_spread=0.5))
    assert all(50 <= r.input_len <= 150 for r in uniform) and len({r.input_len for r in uniform}) > 50
    lognormal = build_requests(Workload(5000, 1.0, 100, 4, input_len_dist="lognormal", input_len_spread=0.5))
    assert np.mean([r.input_len for r in lognormal]) == pytest.approx(100, rel=0.05)

    # With 4 tokens per word and 2 tokens of overhead, 202 tokens are 50 words.
    assert words_for(202, 4.0, 2.0) == 50
    assert len(build_requests(Workload(1, 1.0, 202, 4), 4.0, 2.0)[0].prompt.split()) == 50


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_requests=0), dict(rate=0.0), dict(input_len=0), dict(output_len=0), dict(input_len_dist="zipf")],
)
def test_bad_workload_is_refused(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = dict(num_requests=1, rate=1.0, input_len=8, output_len=8)
    with pytest.raises(ValueError):
        Workload(**{**base, **kwargs})  # type: ignore[arg-type]


# ---- summary math on hand-made results ---------------------------------------------------------
def _req(i: int, arrival: float, ttft: float, tpot: float, n: int, error: str | None = None) -> RequestResult:
    first = arrival + ttft
    last = first + tpot * (n - 1)
    return RequestResult(
        index=i, arrival_s=arrival, input_len=10, sent_s=arrival, first_token_s=first, last_token_s=last,
        finish_s=last + 0.01, num_prompt_tokens=10, num_output_tokens=n, error=error,
    )


def test_summary_math() -> None:
    results = [
        _req(0, 0.0, ttft=0.1, tpot=0.02, n=11),  # meets both
        _req(1, 1.0, ttft=0.5, tpot=0.02, n=11),  # misses TTFT
        _req(2, 2.0, ttft=0.1, tpot=0.05, n=11),  # misses TPOT
        _req(3, 3.0, ttft=0.2, tpot=0.0, n=1),  # one token: no TPOT, meets both
        RequestResult(index=4, arrival_s=4.0, input_len=10, sent_s=4.0, finish_s=4.5, error="HTTP 500: boom"),
    ]
    assert results[0].tpot_s == pytest.approx(0.02) and results[0].ttft_s == pytest.approx(0.1)
    assert results[0].e2e_s == pytest.approx(0.1 + 0.2 + 0.01)
    assert results[3].tpot_s is None

    s = summarize(results, SLO(ttft_s=0.3, tpot_s=0.03))
    assert (s.num_requests, s.num_completed, s.num_errors) == (5, 4, 1)
    assert s.error_kinds == {"HTTP 500: boom": 1}
    assert s.duration_s == pytest.approx(4.5)  # first arrival (0) to last completion (the error, 4.5)
    assert s.ttft_attainment == pytest.approx(3 / 5)
    assert s.tpot_attainment == pytest.approx(3 / 5)
    assert s.slo_attainment == pytest.approx(2 / 5)
    assert s.goodput_rps == pytest.approx(2 / 4.5)
    assert s.throughput_rps == pytest.approx(4 / 4.5)
    assert s.output_tok_s == pytest.approx(34 / 4.5)
    assert s.ttft_p50_s == pytest.approx(0.15)  # median of 0.1, 0.1, 0.2, 0.5
    assert s.tpot_p50_s == pytest.approx(0.02) and s.tpot_p90_s == pytest.approx(0.044)  # 0.02, 0.02, 0.05
    assert s.mean_output_tokens == pytest.approx(8.5)
    assert s.max_send_lag_s == 0.0

    unchecked = summarize(results, SLO())
    assert unchecked.slo_attainment == pytest.approx(4 / 5) and unchecked.goodput_rps == pytest.approx(4 / 4.5)
    assert json.loads(json.dumps(s.to_dict()))["slo_attainment"] == pytest.approx(0.4)


def test_known_misses_and_the_miss_budget() -> None:
    slo = SLO(ttft_s=0.3, tpot_s=0.03)
    open_slow_ttft = RequestResult(5, 5.0, 10, sent_s=5.0)  # sent at 5 s, no token yet
    open_slow_tpot = RequestResult(6, 5.0, 10, sent_s=5.0, first_token_s=5.1, last_token_s=5.5)  # 0.4 s of tokens
    open_fine = RequestResult(7, 5.0, 10, sent_s=5.0, first_token_s=5.1, last_token_s=5.2)
    unsent = RequestResult(8, 9.0, 10)
    finished = [
        _req(0, 0.0, ttft=0.1, tpot=0.02, n=11),  # meets
        _req(1, 1.0, ttft=0.5, tpot=0.02, n=11),  # missed TTFT
        _req(2, 2.0, ttft=0.1, tpot=0.05, n=11),  # missed TPOT
    ]
    results = [*finished, open_slow_ttft, open_slow_tpot, open_fine, unsent]
    # At 5.2 s: two finished misses; the open request has waited 0.2 s (< TTFT SLO); with at most 11
    # tokens, 0.4 s of tokens is a TPOT of at least 0.04 s: a known miss.
    assert load_summary.num_known_misses(results, slo, max_tokens=11, now_s=5.2) == 3
    assert load_summary.num_known_misses(results, slo, max_tokens=11, now_s=5.4) == 4  # now past the TTFT SLO
    assert load_summary.num_known_misses(results, slo, max_tokens=20, now_s=5.2) == 2  # 0.4 / 19 < 0.03: not yet known
    assert load_summary.num_known_misses(results, SLO(), max_tokens=11, now_s=100.0) == 0
    assert [max_misses(n, 0.9) for n in (1, 9, 10, 40, 41)] == [0, 0, 1, 4, 4]
    assert max_misses(40, 1.0) == 0 and max_misses(40, 0.0) == 40


def test_cancelled_requests_are_misses_not_errors() -> None:
    results = [
        _req(0, 0.0, ttft=0.1, tpot=0.02, n=11),
        RequestResult(1, 1.0, 10, sent_s=1.0, finish_s=1.5, error="cancelled", cancelled=True),
        RequestResult(2, 9.0, 10, error="cancelled", cancelled=True),  # never sent
    ]
    s = summarize(results, SLO(ttft_s=0.3, tpot_s=0.03))
    assert (s.num_completed, s.num_errors, s.num_cancelled, s.error_kinds) == (1, 0, 2, {})
    assert s.slo_attainment == pytest.approx(1 / 3) and s.duration_s == pytest.approx(1.5)


def test_summary_of_nothing_completed() -> None:
    s = summarize([RequestResult(0, 0.0, 8, sent_s=0.0, finish_s=0.2, error="x")], SLO(1.0, 1.0))
    assert s.num_completed == 0 and s.ttft_p50_s is None and s.goodput_rps == 0.0 and s.slo_attainment == 0.0


# ---- against our live API ----------------------------------------------------------------------
class LiveServer:
    """Our OpenAI-compatible app over a colocated tiny engine, on uvicorn in a thread, on a free port."""

    def __init__(self) -> None:
        engine = LLMEngine(load_model("tiny", resolve_dtype("auto")), cache_config=CacheConfig(num_blocks=1024, block_size=16))
        self.client = ThreadedEngineClient(engine)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        config = uvicorn.Config(build_fastapi_app(self.client, "tiny"), log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
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
def live() -> Iterator[LiveServer]:
    server = LiveServer()
    yield server
    server.stop()


WORKLOAD = Workload(num_requests=8, rate=20.0, input_len=96, output_len=12, seed=3, ignore_eos=True, min_tokens=True)


def test_every_request_completes_with_the_asked_tokens(live: LiveServer) -> None:
    result = run_load(live.base_url, "tiny", WORKLOAD, SLO(ttft_s=60.0, tpot_s=60.0))
    s = result.summary
    assert (s.num_completed, s.num_errors) == (8, 0), s.error_kinds
    assert [r.arrival_s for r in result.requests] == [r.arrival_s for r in build_requests(WORKLOAD)]
    for r in result.requests:
        assert r.num_output_tokens == WORKLOAD.output_len
        assert r.sent_s is not None and r.sent_s >= r.arrival_s
        assert r.ttft_s is not None and r.e2e_s is not None and r.tpot_s is not None
        assert 0 < r.ttft_s <= r.e2e_s and r.tpot_s >= 0
        assert r.num_prompt_tokens is not None and abs(r.num_prompt_tokens - WORKLOAD.input_len) <= 0.15 * WORKLOAD.input_len
    assert result.tokens_per_word > 1  # the tiny model's tokenizer is byte-level: a word is several tokens
    assert s.slo_attainment == 1.0 and s.goodput_rps == pytest.approx(8 / s.duration_s)
    assert s.mean_output_tokens == WORKLOAD.output_len
    impossible = summarize(result.requests, SLO(ttft_s=1e-9))
    assert impossible.slo_attainment == 0.0 and impossible.goodput_rps == 0.0


def test_bad_model_and_dead_server_are_counted_not_raised(live: LiveServer) -> None:
    w = Workload(num_requests=3, rate=50.0, input_len=16, output_len=4)
    bad = run_load(live.base_url, "no-such-model", w).summary
    assert (bad.num_completed, bad.num_errors) == (0, 3)
    assert list(bad.error_kinds) == ["HTTP 404: The model `no-such-model` does not exist."]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    dead = run_load(dead_url, "tiny", w)
    assert dead.summary.num_errors == 3 and "ConnectError" in next(iter(dead.summary.error_kinds))
    assert "calibration_error" in dead.extra


def test_run_stops_once_its_verdict_is_certain(live: LiveServer) -> None:
    # 40 requests over ~4 s; a TTFT SLO nobody meets: the 5th miss (> 10% of 40) ends the run.
    w = Workload(num_requests=40, rate=10.0, input_len=32, output_len=8, seed=1, ignore_eos=True)
    t0 = time.monotonic()
    result = run_load(live.base_url, "tiny", w, SLO(ttft_s=1e-6), stop_below=0.9)
    s = result.summary
    assert result.stopped_early and result.to_dict()["stopped_early"]
    assert s.num_errors == 0 and s.num_cancelled > 0 and s.num_completed + s.num_cancelled == 40
    assert s.slo_attainment == 0.0 and time.monotonic() - t0 < 3.0
    assert all(r.error is not None and r.error.startswith("cancelled") for r in result.requests if r.cancelled)
    # A run that meets its target is never stopped, and is the same as without stop_below.
    easy = run_load(live.base_url, "tiny", Workload(8, 20.0, 32, 8, ignore_eos=True), SLO(60.0, 60.0), stop_below=0.9)
    assert not easy.stopped_early and easy.summary.num_completed == 8 and easy.summary.num_cancelled == 0


def test_request_timeout_is_an_error(live: LiveServer) -> None:
    w = Workload(num_requests=1, rate=1.0, input_len=16, output_len=400, ignore_eos=True)
    result = run_load(live.base_url, "tiny", w, calibrate=False, request_timeout_s=0.05)
    assert result.summary.num_errors == 1 and "timed out" in result.requests[0].error  # type: ignore[operator]


def test_cli_json(live: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--base-url", live.base_url, "--model", "tiny", "--rate", "20", "--num-requests", "4", "--input-len", "32",
        "--output-len", "5", "--ignore-eos", "--ttft-slo", "30", "--tpot-slo", "30", "--seed", "1", "--json",
    ]
    assert loadgen.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["num_completed"] == 4 and out["mean_output_tokens"] == 5 and out["slo_attainment"] == 1.0
    assert out["workload"]["seed"] == 1 and out["slo"] == {"ttft_s": 30.0, "tpot_s": 30.0}

    assert loadgen.main([*argv[:3], "nope", *argv[4:-1]]) == 1  # nothing completed: exit 1, readable summary
    assert "HTTP 404" in capsys.readouterr().out


def test_async_api_runs_in_a_running_loop(live: LiveServer) -> None:
    async def main() -> load_summary.LoadResult:
        return await loadgen.run_load_async(live.base_url, "tiny", Workload(2, float("inf"), 16, 3, ignore_eos=True))

    assert asyncio.run(main()).summary.num_completed == 2
