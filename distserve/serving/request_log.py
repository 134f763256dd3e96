"""The per-request log (``distserve serve --request-log FILE.jsonl``): one JSON line per finished
request — id, tenant, finish reason, token counts, every timestamp of ``RequestMetrics`` and the
latency breakdown — so an experiment can plot per-request breakdowns (DistServe's Figure 10).

Timestamps are the engine's ``time.monotonic`` seconds (differences are what matter); ``logged_at``
is the wall clock when the line was written. Lines are flushed as they are written, so a reader may
follow the file while the server runs.
"""

from __future__ import annotations

import json
import threading
import time
from typing import IO

from distserve.engine.outputs import RequestOutput
from distserve.errors import InvalidConfigError


class RequestLog:
    """Appends one JSON line per finished request to ``path``."""

    def __init__(self, path: str) -> None:
        try:
            self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by ``close``
        except OSError as exc:
            raise InvalidConfigError(f"--request-log: cannot open {path!r} for appending: {exc.strerror or exc}", "request_log") from exc
        self.path = path
        self._lock = threading.Lock()  # the HTTP layer's handlers may run on more than one thread

    def write(self, out: RequestOutput, tenant: str) -> None:
        record = {"request_id": out.request_id, "tenant": tenant, "finish_reason": out.finish_reason,
                  **out.metrics.as_dict(), "logged_at": time.time()}
        line = json.dumps(record) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_request_log(path: str) -> list[dict[str, object]]:
    """The records of a request log, in the order they were written."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = ["RequestLog", "read_request_log"]
