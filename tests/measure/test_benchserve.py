"""Benchmark server helpers: reading ours and vLLM's /metrics alike, and a server process that leaves nothing behind."""

from __future__ import annotations

import http.server
import signal
import sys
import threading
from collections.abc import Iterator

import pytest

from distserve.measure.benchserve import ServerProcess, metric_sums, num_requests_in_server, session_pids, wait_until_idle
from distserve.ports import free_port

OURS = """# HELP distserve:num_requests_running Requests in the running batch.
# TYPE distserve:num_requests_running gauge
distserve:num_requests_running{instance="prefill-0",phase="prefill"} 1.0
distserve:num_requests_running{instance="decode-0",phase="decode"} 2.0
distserve:num_requests_waiting{instance="prefill-0",phase="prefill"} 3.0
distserve:prompt_tokens_total 512.0
distserve:request_success_total{finish_reason="length"} 2.0
"""
VLLM = """vllm:num_requests_running{engine="0",model_name="smollm2-135m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="smollm2-135m"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="smollm2-135m"} 1024.0
vllm:time_to_first_token_seconds_bucket{le="+Inf"} 4.0
"""


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, dict[str, str]]]:
    state = {"text": OURS}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = state["text"].encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    server.shutdown()
    server.server_close()


def test_metric_sums_read_ours_and_vllms(metrics_server: tuple[str, dict[str, str]]) -> None:
    url, state = metrics_server
    assert num_requests_in_server(url) == 6  # summed over instances, running + waiting
    assert metric_sums(url, ("prompt_tokens_total", "request_success_total", "no_such")) == {
        "prompt_tokens_total": 512.0, "request_success_total": 2.0,
    }
    state["text"] = VLLM
    assert num_requests_in_server(url) == 0 and wait_until_idle(url) < 1.0
    assert metric_sums(url, ("prompt_tokens_total",)) == {"prompt_tokens_total": 1024.0}
    state["text"] = "# nothing\n"
    assert num_requests_in_server(url) is None and wait_until_idle(url) < 1.0  # no gauges: nothing to wait for


def test_metric_sums_of_a_dead_server() -> None:
    assert metric_sums(f"http://127.0.0.1:{free_port()}/v1", ("x",)) is None


@pytest.mark.integration  # starts processes
@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint", "started-with-sigint-ignored"])
def test_server_process_on_a_given_port_is_stopped_with_its_children(sigint_ignored: bool) -> None:
    """A peer-style server (known port, ready on GET /health) that spawns a child; stop kills both. The
    server stops on SIGINT even when this process ignores SIGINT (a benchmark run as a background job),
    which a child would inherit across exec (``default_sigint``)."""
    port = free_port()
    script = (
        "import http.server, subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    server = ServerProcess("peer", [sys.executable, "-c", script], startup_timeout_s=30, port=port, env={"X_PEER": "1"})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if sigint_ignored else None
    try:
        assert server.start() == f"http://127.0.0.1:{port}/v1"
        assert server.sid is not None and len(session_pids(server.sid)) == 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        # The child never exits by itself: SIGKILL must end it (so waiting for it to leave on its own is padding).
        report = server.stop(grace_s=5, linger_s=0.5)
    assert report["num_left_after_sigint"] == 1 and report["num_left"] == 0 and not session_pids(server.sid)
