"""What one request may cost (``serving.limits``): a body over the limit is a 413 before it is read, too many or too
large headers a 431, and a client that sends its headers or body too slowly (slowloris) is answered 408 and cut off,
while other clients are served. Raw sockets, so the test controls every byte and its timing."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from distserve.config import CacheConfig
from distserve.serving.limits import HttpLimits
from serving_util import HttpServer

pytestmark = pytest.mark.timeout(120)

LIMITS = HttpLimits(max_request_body_bytes=65536, max_header_bytes=4096, max_header_count=24, timeout_keep_alive_s=1.0,
                    request_read_timeout_s=1.0)
PLAIN = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    from distserve.engine.llm_engine import LLMEngine
    from distserve.engine.weights import load_model
    from distserve.runtime.threaded_client import ThreadedEngineClient

    loaded = load_model("tiny")

    async def make_client() -> ThreadedEngineClient:
        return ThreadedEngineClient(LLMEngine(loaded, cache_config=CacheConfig(num_blocks=64, block_size=16)))

    srv = HttpServer(make_client, http_limits=LIMITS)
    yield srv
    srv.stop()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes, float]:
    """Status, headers and body of the response, and when the server closed the connection (it must)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    closed_at = time.monotonic()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body, closed_at


def assert_served(server: HttpServer) -> None:
    resp = httpx.post(f"{server.url}/v1/completions", json=PLAIN, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


def _accepted_socket(client: socket.socket) -> socket.socket:
    """The server's end of ``client``'s connection (the server runs in this process): found among our fds."""
    want = (client.getpeername(), client.getsockname())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if sock.family == socket.AF_INET and (sock.getsockname(), sock.getpeername()) == want:
                    return sock
            except OSError:
                pass
            sock.close()
        time.sleep(0.05)
    raise AssertionError("the server never accepted the connection")


def test_connections_send_without_nagle(server: HttpServer) -> None:
    """The listening socket says TCP, so asyncio sets TCP_NODELAY on every connection it accepts: without it a
    response's body (written after its head) and each SSE token waited ~40 ms for the client's delayed ACK on
    every keep-alive connection (uvicorn#3149: a socket bound before uvicorn starts has ``proto`` 0)."""
    from distserve.serving.server import open_listen_socket

    listener = open_listen_socket("127.0.0.1", 0)
    assert listener.proto == socket.IPPROTO_TCP
    listener.close()
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert client.recv(65536).startswith(b"HTTP/1.1 200")
        accepted = _accepted_socket(client)
        try:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            accepted.close()


def test_a_body_over_the_limit_is_413_before_it_is_read(server: HttpServer) -> None:
    for path in ("/v1/completions", "/v1/semantic_var", "/tokenize"):
        sock = connect(server.url)
        # Only the head is sent: the answer must not wait for the 1 MB the client announced.
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n".encode())
        status, headers, body, _ = read_response(sock)
        error = json.loads(body)["error"]
        assert status == 413 and error["param"] == "body" and error["code"] == "request_too_large" and "65536" in error["message"]
        assert headers["connection"] == "close"
    resp = httpx.post(f"{server.url}/v1/completions", json={**PLAIN, "prompt": "x" * 70_000})
    assert resp.status_code == 413 and resp.json()["error"]["param"] == "body"
    assert_served(server)


def test_a_chunked_body_is_counted_as_it_arrives(server: HttpServer) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b"x" * 10_000

    resp = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["param"] == "body"
    small = httpx.post(f"{server.url}/v1/completions", content=iter([json.dumps(PLAIN).encode()]), headers={"Content-Type": "application/json"})
    assert small.status_code == 200


def test_too_many_or_too_large_headers_are_431(server: HttpServer) -> None:
    many = {f"X-H{i}": "v" for i in range(30)}
    resp = httpx.post(f"{server.url}/v1/completions", json=PLAIN, headers=many)
    assert resp.status_code == 431 and resp.json()["error"]["param"] == "headers" and "24" in resp.json()["error"]["message"]
    sock = connect(server.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    status, headers, body, _ = read_response(sock)
    assert status == 431 and json.loads(body)["error"]["param"] == "headers" and headers["connection"] == "close"
    sock = connect(server.url)  # a head that never ends is not buffered past the bound
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000)
    status, _, body, _ = read_response(sock)
    assert status == 431 and json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    sock = connect(server.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\x00bad\r\n\r\n")
    status, _, body, _ = read_response(sock)
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert_served(server)


def test_slow_headers_slow_bodies_and_silent_connections_are_cut_off(server: HttpServer) -> None:
    """Slowloris: a header byte every 0.2 s would hold the connection forever without a deadline."""
    slow_head = connect(server.url)
    slow_body = connect(server.url)
    silent = connect(server.url)
    t0 = time.monotonic()
    slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    slow_head.settimeout(0.2)
    head_answer = b""
    for i in range(30):  # up to 6 s of dribbling
        try:
            slow_head.sendall(b"X-Slow-%d: 1\r\n" % i)
            head_answer += slow_head.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if head_answer:
            break
    head_cut_s = time.monotonic() - t0
    assert b"408" in head_answer.split(b"\r\n")[0] and b'"param":"headers"' in head_answer.replace(b" ", b""), head_answer[:300]
    assert 0.8 < head_cut_s < 4.0, head_cut_s
    assert_served(server)  # others were served meanwhile and still are
    slow_body.settimeout(10)
    status, headers, body, closed_at = read_response(slow_body)
    assert status == 408 and json.loads(body)["error"]["param"] == "body" and headers["connection"] == "close"
    assert closed_at - t0 < 4.0
    silent.settimeout(10)
    assert silent.recv(10) == b""  # closed without a word after the keep-alive timeout
    assert time.monotonic() - t0 < 5.0


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(server: HttpServer) -> None:
    """More characters than the context's tokens of the longest token cannot fit: 400 at once, never seconds of tokenizing."""
    assert server.client is not None
    max_chars = server.client.max_model_len * server.client.tokenizer.max_token_chars
    long = "y" * (max_chars + 1)
    assert len(long) < LIMITS.max_request_body_bytes - 1000
    for route, body, param in (("/v1/completions", {**PLAIN, "prompt": long}, "prompt"),
                               ("/v1/completions", {**PLAIN, "prompt": long, "max_tokens": None}, "prompt"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}], "max_tokens": 2}, "messages"),
                               ("/tokenize", {"prompt": long}, "prompt"),
                               ("/tokenize", {"messages": [{"role": "user", "content": long}]}, "messages")):
        resp = httpx.post(f"{server.url}{route}", json=body, timeout=30)
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == param and error["code"] == "context_length_exceeded", (route, resp.text[:300])
        assert "cannot fit" in error["message"]
    assert_served(server)


@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', b'{"model": "\\udfff", "prompt": "hi"}',
    b'{"prompt": "hi", "session_auth": "\\ud800x"}', b'{"prompt": "\xed\xa0\x80"}',
])
def test_bodies_that_are_no_text_are_400_on_every_route(server: HttpServer, body: bytes) -> None:
    """Lone surrogates (a fuzzing find): Python's JSON parser takes them, then the tokenizer, a session token's compare
    or a JSON response raised (500). Now the body is refused where it enters, whatever the route."""
    headers = {"Content-Type": "application/json"}
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("POST", "/v1/semantic_var"), ("GET", "/v1/session/1")):
        resp = httpx.request(method, f"{server.url}{path}", content=body, headers=headers)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "body", (path, resp.text[:300])
    pair = httpx.post(f"{server.url}/tokenize", content=b'{"prompt": "\\ud83d\\ude00 \\\\ud800"}', headers=headers)
    assert pair.status_code == 200 and pair.json()["count"] > 0  # a whole pair, and an escaped backslash, are text


def test_tokenize_refuses_ids_outside_the_vocabulary(server: HttpServer) -> None:
    """A fuzzing find: ``/tokenize`` of token ids with ``return_token_strs`` converted ids past the vocabulary (500)."""
    for ids in ([1, 262144], [-1], [2**40]):
        for strs in (True, False):
            resp = httpx.post(f"{server.url}/tokenize", json={"prompt": ids, "return_token_strs": strs})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text[:300]
    ok = httpx.post(f"{server.url}/tokenize", json={"prompt": [1, 2, 3], "return_token_strs": True}).json()
    assert ok["count"] == 3 and len(ok["token_strs"]) == 3
