"""Probes of a running server's request limits over raw sockets (shared by ``fuzz_report.py``): what a hostile
client's connection gets — an oversized body, too many or too large headers, a slowloris head or body, a silent
connection, a body that is no text — and whether everyone else is served meanwhile. Each probe reports what was
expected, what was observed and how long the server took to answer or cut the connection.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

PLAIN = b'{"prompt": "Hello", "max_tokens": 2, "temperature": 0}'


@dataclass
class Probe:
    name: str
    expected: str
    observed: str
    ok: bool
    seconds: float


def _connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _answer(sock: socket.socket, deadline_s: float) -> tuple[str, bool]:
    """The status line the server sent (or "") and whether it then closed the connection, within ``deadline_s``."""
    sock.settimeout(deadline_s)
    data = b""
    closed = False
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            data += chunk
    except ConnectionResetError:
        closed = True  # closed with our unread bytes in its buffer: a reset
    except OSError:
        pass
    sock.close()
    return data.split(b"\r\n", 1)[0].decode("latin-1"), closed


def _status(line: str) -> int | None:
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _probe(name: str, expected: int | None, base_url: str, payload: bytes, deadline_s: float, dribble: tuple[bytes, float] | None = None) -> Probe:
    """Send ``payload`` (then, with ``dribble``, one chunk every period, as a slow client), and see what comes back."""
    t0 = time.monotonic()
    sock = _connect(base_url)
    try:
        sock.sendall(payload)
    except OSError:
        pass  # the server answered and closed before it all went: read what it said
    if dribble is not None:
        chunk, period = dribble
        sock.settimeout(period)
        while time.monotonic() - t0 < deadline_s:
            try:
                sock.sendall(chunk)
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except socket.timeout:
                continue
            except OSError:
                break
    line, closed = _answer(sock, deadline_s)
    seconds = time.monotonic() - t0
    status = _status(line)
    observed = f"{status if status is not None else 'no answer'}, {'closed' if closed else 'left open'}"
    want = f"{expected if expected is not None else 'no answer'}, closed"
    return Probe(name, want, observed, status == expected and closed, round(seconds, 2))


def run_probes(base_url: str, max_body_bytes: int, read_timeout_s: float, keep_alive_s: float) -> tuple[list[Probe], dict[str, Any]]:
    """Every probe, and how plain requests fared while the slow clients held their connections."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    slack = 3.0
    served: list[float] = []
    stop = threading.Event()

    def plain_client() -> None:  # a well-behaved client, all along
        with httpx.Client(base_url=base_url, timeout=30, trust_env=False) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                ok = http.post("/v1/completions", content=PLAIN, headers={"Content-Type": "application/json"}).status_code == 200
                served.append(time.monotonic() - t0 if ok else float("inf"))
                time.sleep(0.2)

    watcher = threading.Thread(target=plain_client, daemon=True)
    watcher.start()
    probes = [
        _probe("body over the limit (Content-Length)", 413, base_url, head + b"Content-Length: %d\r\n\r\n" % (max_body_bytes + 1), slack),
        _probe("chunked body over the limit", 413, base_url,
               head + b"Transfer-Encoding: chunked\r\n\r\n" + (b"100000\r\n" + b"x" * 0x100000 + b"\r\n") * (max_body_bytes // 0x100000 + 1), 30),
        _probe("300 headers", 431, base_url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(300)) + b"\r\n", slack),
        _probe("100 KB header, whole", 431, base_url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", slack),
        _probe("100 KB header, never ending", 431, base_url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000, slack),
        _probe("slowloris: a header line every 0.5 s", 408, base_url, head, read_timeout_s + slack, dribble=(b"X-Slow: 1\r\n", 0.5)),
        _probe("slow body: 1 of 100 bytes, then nothing", 408, base_url, head + b"Content-Length: 100\r\n\r\n{", read_timeout_s + slack),
        _probe("silent connection", None, base_url, b"", keep_alive_s + slack),
        _probe("body with a lone surrogate", 400, base_url,
               head + b"Connection: close\r\nContent-Length: 18\r\n\r\n" + b'{"prompt": "\\ud800', slack),
        _probe("not HTTP", 400, base_url, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\r\n\r\n", slack),
    ]
    stop.set()
    watcher.join(60)
    finite = [s for s in served if s != float("inf")]
    during = {"num_plain_requests": len(served), "num_plain_failed": len(served) - len(finite),
              "plain_max_s": round(max(finite), 3) if finite else None}
    return probes, during


def probes_json(probes: list[Probe]) -> list[dict[str, Any]]:
    return [asdict(p) for p in probes]


__all__ = ["Probe", "probes_json", "run_probes"]
