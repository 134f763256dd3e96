"""HTTP load generator for any OpenAI-compatible server: Poisson or gamma arrivals, streamed completions or chat
completions, SLO attainment and goodput, and vLLM's ``vllm bench serve`` result keys next to ours.

Each request of the workload (``distserve.measure.workload``) is sent at its arrival time (with
``max_concurrency``, once fewer than that many requests are open: later, as vLLM's
``--max-concurrency`` does), streamed and timed on the client side
(``distserve.measure.stream_client``); TTFT, TPOT, E2E and attainment are ``distserve.slo``'s
definitions, the same the simulator predicts; ITL is every gap between streamed output chunks. Before the run, two probe
requests (``max_tokens=1``) holding the prompt word list once and twice calibrate the server's
tokens per word, so prompts hit their target length in the server's tokens.

Goodput is the number of requests meeting *both* SLOs divided by the run's duration (first arrival
to last completion); attainment is that number over all requests sent (errors count as misses).

A run can end as soon as its SLO verdict is certain (``stop_below``, for goodput searches whose
probes are long): once more requests are *known* to miss than the target attainment allows, the
outstanding requests are cancelled (their streams closed, so the server aborts them) and the
unsent ones never go out. A miss is known when a finished request missed, when a request has
waited longer than the TTFT SLO for its first token, or when its tokens so far already span more
than ``TPOT SLO x (max_tokens - 1)`` (a stream never has more than ``max_tokens`` tokens, so its
TPOT can only be worse). Cancelled requests count as misses (not as errors): such a run's
attainment is a lower bound on the full run's, and the verdict (below the target) is the same.

vLLM's keys (``vllm_metrics``, as ``vllm/benchmarks/serve.py`` computes them): ``completed`` and
``failed`` requests, ``total_input_tokens``/``total_output_tokens`` (of completed requests; input:
the server's usage count), ``request_throughput``, ``request_goodput`` (None without an SLO, as
vLLM without ``--goodput``), ``output_throughput``, ``total_token_throughput`` (per second of our
``duration_s``, first arrival to last completion, so ``request_throughput == throughput_rps`` and
``request_goodput == goodput_rps``), and ``mean_/median_/std_/p{P}_`` of ``ttft``, ``tpot``, ``itl``
and ``e2el`` in milliseconds over completed requests (0 where there is no value, as vLLM). Two
differences to know when comparing with a ``vllm bench serve`` run: its E2E latency ends at the
last output chunk, ours at the end of the stream; its duration is the wall time of the whole run.

CLI::

    python -m distserve.measure.loadgen --base-url http://127.0.0.1:8000/v1 --model smollm2-135m \\
        --rate 2 --num-requests 40 --input-len 256 --output-len 64 --ttft-slo 2s --tpot-slo 100ms \\
        --endpoint-type chat --burstiness 0.5 --max-concurrency 8 --ignore-eos --min-tokens --json

prints a summary (``--json``: one JSON object) and exits 1 if no request completed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from distserve.cli.arg_types import positive_int
from distserve.errors import InvalidConfigError
from distserve.measure.stream_client import (
    ENDPOINT_PATHS, RequestResult, calibrate_tokens_per_word, completion_body, endpoint_url, stream_completion,
)
from distserve.measure.workload import INPUT_LEN_DISTS, RequestSpec, Workload, build_requests
from distserve.measure.load_summary import LoadResult, format_summary, num_known_misses, summarize
from distserve.slo import SLO, max_misses, parse_latency

async def run_load_async(
    base_url: str,
    model: str,
    workload: Workload,
    slo: SLO = SLO(),
    *,
    api_key: str | None = None,
    calibrate: bool = True,
    tokens_per_word: tuple[float, float] | None = None,
    request_timeout_s: float = 300.0,
    stop_below: float | None = None,
    endpoint_type: str = "completions",
    max_concurrency: int | None = None,
    metric_percentiles: Seq[float] = (99.0,),
) -> LoadResult:
    """Send ``workload`` to ``{base_url}/completions`` (``endpoint_type="chat"``: ``/chat/completions``)
    and measure it; failures are counted, never raised.

    ``tokens_per_word`` = (tokens per word, overhead tokens), e.g. from an earlier run's
    ``LoadResult.calibration``, skips the probes. If the probes fail, one token per word is assumed
    and the reason is kept in ``LoadResult.extra["calibration_error"]`` (the requests will most
    likely fail the same way).
    ``stop_below``: end the run (``LoadResult.stopped_early``) once its SLO attainment is certain
    to end below this fraction; the requests still open or unsent are cancelled.
    ``max_concurrency``: at most this many requests open at once; an arrival waits for a free slot
    (its latencies start when it is sent).
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    url = endpoint_url(base_url, endpoint_type)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        calibration = tokens_per_word or (1.0, 0.0)
        extra: dict[str, Any] = {}
        if calibrate and tokens_per_word is None:
            try:
                calibration = await calibrate_tokens_per_word(client, url, model, headers, endpoint_type)
            except Exception as exc:  # noqa: BLE001 - reported, and the run goes on to count the errors
                extra["calibration_error"] = f"{type(exc).__name__}: {exc}"
        specs = build_requests(workload, *calibration)
        results = [RequestResult(s.index, s.arrival_s, s.input_len) for s in specs]
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else contextlib.nullcontext()
        t0 = time.perf_counter()

        async def fire(spec: RequestSpec, result: RequestResult) -> None:
            await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - t0)))
            body = completion_body(model, spec.prompt, workload, spec.output_len, stream=True, endpoint_type=endpoint_type)
            async with slots:
                await stream_completion(client, url, body, headers, result, t0, request_timeout_s)

        tasks = [asyncio.create_task(fire(s, r)) for s, r in zip(specs, results)]
        stopped_early = False
        if stop_below is None:
            await asyncio.gather(*tasks)
        else:
            allowed = max_misses(len(results), stop_below)
            pending = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=0.05)
                now = time.perf_counter() - t0
                if pending and num_known_misses(results, slo, [s.output_len for s in specs], now) > allowed:
                    stopped_early = True
                    for task in pending:
                        task.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    for task, result in zip(tasks, results):
                        if task.cancelled():
                            result.cancelled = True
                            result.error = "cancelled: the run's SLO verdict was already certain"
                    break
    return LoadResult(
        base_url, model, workload, slo, results, summarize(results, slo), calibration, extra, stopped_early=stopped_early,
        endpoint_type=endpoint_type, max_concurrency=max_concurrency, metric_percentiles=tuple(metric_percentiles),
    )


def run_load(base_url: str, model: str, workload: Workload, slo: SLO = SLO(), **kwargs: Any) -> LoadResult:
    """Synchronous ``run_load_async`` (starts its own event loop)."""
    return asyncio.run(run_load_async(base_url, model, workload, slo, **kwargs))


@dataclass(frozen=True)
class SingleStream:
    """A server's unloaded latency: medians over requests sent one at a time."""

    ttft_s: float
    tpot_s: float
    num_prompt_tokens: int | None
    calibration: tuple[float, float]  # the server's (tokens per word, overhead tokens), for later runs


def single_stream(
    base_url: str,
    model: str,
    input_len: int,
    output_len: int,
    num_requests: int = 3,
    *,
    seed: int = 10_000,
    tokens_per_word: tuple[float, float] | None = None,
    request_timeout_s: float = 300.0,
) -> SingleStream:
    """Send one warm-up and then ``num_requests`` requests one at a time (full length: ``ignore_eos``
    and ``min_tokens``); raise if none completed. Also probes the tokenizer unless ``tokens_per_word``."""
    runs: list[LoadResult] = []
    calibration = tokens_per_word
    for i in range(num_requests + 1):
        w = Workload(1, 1.0, input_len, output_len, seed=seed + i, ignore_eos=True, min_tokens=True)
        runs.append(run_load(base_url, model, w, tokens_per_word=calibration, request_timeout_s=request_timeout_s))
        calibration = runs[-1].calibration
    done = [r.requests[0] for r in runs[1:] if r.requests[0].ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    if not ttfts or not tpots:
        raise RuntimeError(f"single requests to {base_url} failed: {runs[-1].summary.error_kinds}")
    return SingleStream(float(np.median(ttfts)), float(np.median(tpots)), done[0].num_prompt_tokens, runs[-1].calibration)


# ---- CLI -------------------------------------------------------------------------------------
def _latency_arg(flag: str) -> Any:
    def parse(text: str) -> float:
        try:
            return parse_latency(text, flag, allow_inf=True)
        except InvalidConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from None

    return parse


def parse_goodput(pairs: Seq[str]) -> dict[str, float]:
    """vLLM's ``--goodput ttft:200 tpot:50`` (milliseconds) -> ``{"ttft_s": 0.2, "tpot_s": 0.05}``."""
    out: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if name == "e2el":
            raise InvalidConfigError(f"--goodput {pair!r}: an end-to-end latency SLO is not supported (ttft and tpot are)", "goodput")
        if not sep or name not in ("ttft", "tpot"):
            raise InvalidConfigError(f"--goodput {pair!r}: expected ttft:MS or tpot:MS (milliseconds, as vLLM)", "goodput")
        try:
            ms = float(value)
        except ValueError:
            raise InvalidConfigError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds", "goodput") from None
        if not (ms > 0 and math.isfinite(ms)):
            raise InvalidConfigError(f"--goodput {pair!r}: must be > 0 ms", "goodput")
        out[f"{name}_s"] = ms / 1000.0
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m distserve.measure.loadgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True, help="the model name the server answers to")
    ap.add_argument("--endpoint-type", default="completions", choices=sorted(ENDPOINT_PATHS),
                    help="completions: POST {base-url}/completions; chat: POST {base-url}/chat/completions, the prompt as one user message")
    ap.add_argument("--rate", "--request-rate", dest="rate", type=float, required=True, help="requests per second; inf = all at once")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="shape of the gamma inter-arrival times, mean 1/rate (vLLM's): 1 Poisson, < 1 burstier, > 1 more regular, inf evenly spaced")
    ap.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                    help="at most N requests open at once; later arrivals wait for a free slot (default: no limit)")
    ap.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, required=True)
    ap.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, required=True,
                    help="target prompt length in the server's tokens")
    ap.add_argument("--input-len-dist", default="fixed", choices=INPUT_LEN_DISTS)
    ap.add_argument("--input-len-spread", type=float, default=0.5, help="uniform: +-fraction; lognormal: sigma")
    ap.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, required=True, help="max_tokens of every request")
    ap.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true (vLLM-style extension)')
    ap.add_argument("--min-tokens", action="store_true", help='send "min_tokens" = output len (vLLM-style extension)')
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ttft-slo", type=_latency_arg("--ttft-slo"), default=None,
                    help="200ms, 0.2s or 0.2 (seconds; default: not checked)")
    ap.add_argument("--tpot-slo", type=_latency_arg("--tpot-slo"), default=None,
                    help="200ms, 0.2s or 0.2 (seconds; default: not checked)")
    ap.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="vLLM's form of the SLO: ttft:MS and/or tpot:MS in milliseconds (instead of --ttft-slo/--tpot-slo)")
    ap.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles of the p{P}_*_ms keys (vLLM's; default 99)")
    ap.add_argument("--seed", type=int, default=0, help="arrivals and lengths")
    ap.add_argument("--prompt-seed", type=int, default=None, help="prompt words (default: --seed)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds, per request")
    ap.add_argument("--stop-below", type=float, default=None,
                    help="end the run once SLO attainment is certain to be below this fraction (e.g. 0.9)")
    ap.add_argument("--no-calibrate", action="store_true", help="assume one token per word instead of probing")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--per-request", action="store_true", help="with --json: include every request's timings")
    return ap


def main(argv: Seq[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        workload = Workload(
            num_requests=args.num_requests, rate=args.rate, input_len=args.input_len, output_len=args.output_len,
            input_len_dist=args.input_len_dist, input_len_spread=args.input_len_spread, seed=args.seed,
            prompt_seed=args.prompt_seed, ignore_eos=args.ignore_eos, min_tokens=args.min_tokens, temperature=args.temperature,
            burstiness=args.burstiness,
        )
    except ValueError as exc:
        ap.error(str(exc))
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
        if not all(0 <= p <= 100 for p in percentiles):
            raise ValueError
    except ValueError:
        ap.error(f"argument --metric-percentiles: expected comma-separated numbers in [0, 100], got {args.metric_percentiles!r}")
    try:
        targets = parse_goodput(args.goodput) if args.goodput else {}
        if targets and (args.ttft_slo is not None or args.tpot_slo is not None):
            raise InvalidConfigError("--goodput and --ttft-slo/--tpot-slo both give the SLO: use one", "goodput")
        slo = SLO(ttft_s=targets.get("ttft_s", args.ttft_slo if args.ttft_slo is not None else math.inf),
                  tpot_s=targets.get("tpot_s", args.tpot_slo if args.tpot_slo is not None else math.inf))
    except InvalidConfigError as exc:
        ap.error(str(exc))
    result = run_load(
        args.base_url, args.model, workload, slo, api_key=args.api_key,
        calibrate=not args.no_calibrate, request_timeout_s=args.request_timeout, stop_below=args.stop_below,
        endpoint_type=args.endpoint_type, max_concurrency=args.max_concurrency, metric_percentiles=percentiles,
    )
    print(json.dumps(result.to_dict(include_requests=args.per_request)) if args.json else format_summary(result))
    return 0 if result.summary.num_completed else 1


if __name__ == "__main__":
    sys.exit(main())
