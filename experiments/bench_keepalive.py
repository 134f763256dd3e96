"""What a keep-alive connection costs a request: the same server, the same requests, each sent either on a
fresh connection or on one connection reused (what the OpenAI SDK, httpx, aiohttp and every load
generator do). Without TCP_NODELAY on the server's connections, Nagle holds each small write that
follows an unacknowledged one (a response's body after its head, an SSE token after the last) until the
client's delayed ACK, ~40 ms on Linux; fresh connections escape it (the kernel ACKs a new connection's
first segments at once), so the ratio shows it. ``distserve serve`` names ``IPPROTO_TCP`` on its
listening socket for this (uvicorn#3149); any OpenAI-compatible server can be measured with ``--url``
(vLLM's ``api_server`` binds its socket the same way uvicorn's ``--workers`` path does).

Reported per mode, p50 over ``--requests`` of each kind (the two modes alternate): streaming TTFT, the
largest gap between two streamed tokens, and a non-streaming request's whole latency; and the ratio
keep-alive ÷ fresh connection (1.0: reuse costs nothing).

    python experiments/bench_keepalive.py                  # SmolLM2-135M, `distserve serve` started here
    python experiments/bench_keepalive.py --url http://127.0.0.1:8000 --model MODEL   # any server
    python experiments/bench_keepalive.py --quick          # the tiny model, a few requests
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import harness
import httpx

from distserve.cli.arg_types import positive_float, positive_int
from distserve.measure.benchserve import ServerProcess, distserve_serve_argv

MODES = ("fresh", "keep-alive")
KINDS = ("ttft_s", "max_gap_s", "non_stream_s")


def one_request(client: httpx.Client, url: str, model: str, max_tokens: int) -> dict[str, float]:
    """A streaming request (TTFT, largest gap between tokens), then the same one non-streaming (latency)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                times.append(time.perf_counter())
    if not times:
        raise SystemExit("the server streamed no tokens")
    t1 = time.perf_counter()
    client.post(f"{url}/v1/chat/completions", json={**body, "stream": False}).raise_for_status()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": times[0] - t0, "max_gap_s": max(gaps, default=0.0), "non_stream_s": time.perf_counter() - t1}


def measure(url: str, model: str, requests: int, max_tokens: int) -> dict[str, dict[str, float]]:
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with httpx.Client(timeout=60, trust_env=False) as reused:
        one_request(reused, url, model, max_tokens)  # warm-up (and the connection is open)
        for _ in range(requests):
            with httpx.Client(timeout=60, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)) as fresh:
                samples["fresh"].append(one_request(fresh, url, model, max_tokens))
            samples["keep-alive"].append(one_request(reused, url, model, max_tokens))
    return {m: {k: statistics.median(s[k] for s in samples[m]) for k in KINDS} for m in MODES}


def main() -> None:
    ap = harness.parser(__doc__, "the tiny model, 4 requests of each kind")
    ap.add_argument("--url", default=None, help="an OpenAI-compatible server to measure (default: start `distserve serve`)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", type=harness.model_dtype, default="auto")
    ap.add_argument("--requests", type=positive_int, default=30, help="requests of each kind per mode")
    ap.add_argument("--max-tokens", type=positive_int, default=32)
    ap.add_argument("--startup-timeout", type=positive_float, default=600.0)
    args = ap.parse_args()
    if args.quick:
        args.model, args.requests, args.max_tokens = "tiny", 4, 8
    out = harness.Outputs.for_run(args, "bench_keepalive")
    server = None
    figures: dict[str, Any] = {"quick": args.quick, "model": args.model, "requests": args.requests, "max_tokens": args.max_tokens}
    try:
        if args.url is None:
            server = ServerProcess("distserve", distserve_serve_argv(args.model, args.dtype, []), args.startup_timeout)
            url = server.start().rstrip("/").removesuffix("/v1")
        else:
            url = args.url.rstrip("/").removesuffix("/v1")
        figures["server"] = "distserve serve" if server else url
        p50 = measure(url, args.model, args.requests, args.max_tokens)
    finally:
        if server is not None:
            figures.update(harness.stop_server(server))
    figures["p50_s"] = {m: {k: round(v, 4) for k, v in p50[m].items()} for m in MODES}
    figures["keepalive_over_fresh"] = {k: round(p50["keep-alive"][k] / p50["fresh"][k], 3) if p50["fresh"][k] > 0 else None for k in KINDS}
    columns = ["", *(f"{m} (ms)" for m in MODES), "keep-alive ÷ fresh"]
    rows = [[k, *(harness.ms(p50[m][k]) for m in MODES), f"{figures['keepalive_over_fresh'][k]}"] for k in KINDS]
    harness.rich_table(f"p50 per connection mode, {figures['server']}", columns, rows, left=("",))
    out.json(figures)
    out.markdown([f"# A keep-alive connection's cost ({figures['server']}, {args.model}, {args.requests} of each)", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *("| " + " | ".join(r) + " |" for r in rows)])
    harness.finish(figures)


if __name__ == "__main__":
    main()
