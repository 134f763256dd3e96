"""Runs ``experiments/`` scripts as processes forked from one warm interpreter (a fork server), so that the
suite's ~30 quick runs do not each pay for importing torch, transformers, matplotlib and distserve anew.

``ScriptRunner.run(argv, cwd, timeout)`` behaves as ``subprocess.run(argv, cwd=cwd, capture_output=True,
text=True, timeout=timeout)`` for ``argv = [sys.executable, script, *args]``: the script runs in a process of
its own (forked from the server, which has only imported modules: no thread of its own, no Ray, no model), as
``__main__`` with ``sys.argv = [script, *args]``, its folder first on ``sys.path``, this process's environment
and working directory, stdin from /dev/null; it exits through the interpreter's normal shutdown (atexit
handlers, non-daemon threads joined), and its exit status, stdout and stderr come back as a
``CompletedProcess``. On timeout it is killed and ``subprocess.TimeoutExpired`` is raised, as
``subprocess.run`` does. If the server cannot be started, or dies, the run falls back to ``subprocess.run``.

The server itself is this file run as a script (``python script_runner.py``): it reads one JSON request per
line on stdin and answers on stdout, first the child's pid, then its exit status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# What most quick runs import before they do anything (no Ray: its import starts nothing, but a forked copy of a
# Ray client is not safe; nothing here starts a thread of its own or uses the tokenizers' thread pool).
WARM_MODULES = (
    "numpy", "torch", "transformers", "httpx", "aiohttp", "matplotlib.pyplot", "rich.console", "rich.table",
    "distserve.engine.llm_engine", "distserve.engine.weights", "distserve.measure.benchserve", "distserve.measure.loadgen",
    "distserve.measure.profiler", "distserve.serving.api", "distserve.cli", "simulator.simulation", "simulator.latency",
)


class ScriptRunner:
    """The test side: starts the server on first use; ``close`` stops it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._broken = False

    def _readline(self, deadline: float | None = None) -> str | None:
        """One line from the server (None: EOF, or ``deadline`` passed first)."""
        import selectors

        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if deadline is not None:
                with selectors.DefaultSelector() as sel:
                    sel.register(fd, selectors.EVENT_READ)
                    if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                        return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def _server(self) -> subprocess.Popen[bytes] | None:
        if self._broken:
            return None
        if self._proc is None or self._proc.poll() is not None:
            self._buffer = b""
            self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                          cwd=Path(__file__).resolve().parents[2])
            if self._readline(time.monotonic() + 120) != "ready":
                self._proc.kill()
                self._proc.wait()
                self._broken = True
                return None
        return self._proc

    def run(self, argv: list[str], cwd: str | os.PathLike[str], timeout: float) -> subprocess.CompletedProcess[str]:
        server = self._server() if argv[0] == sys.executable and len(argv) > 1 and argv[1].endswith(".py") else None
        if server is None:
            return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        assert server.stdin is not None
        with tempfile.TemporaryDirectory(prefix="script_runner") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": argv[1:], "cwd": str(cwd), "env": dict(os.environ), "stdout": str(out), "stderr": str(err)}
            try:
                server.stdin.write((json.dumps(request) + "\n").encode())
                pid = int(self._readline() or "")
            except (OSError, ValueError):  # the server died: this run (and the next ones) as plain processes
                self._broken = True
                return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
            try:
                line = self._readline(time.monotonic() + timeout)
            except BaseException:  # e.g. the test's own timeout: as subprocess.run, the child is killed and waited for
                self._kill_and_reap(pid)
                raise
            timed_out = line is None and server.poll() is None
            if timed_out:  # as subprocess.run: killed, then waited for
                line = self._kill_and_reap(pid)
            elif line is None:  # the server died with the child: report it, and run the next ones as plain processes
                self._broken = True
            returncode = int(line) if line else -signal.SIGKILL
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    def _kill_and_reap(self, pid: int) -> str | None:
        """SIGKILL the child ``pid``; the server's line with its exit status (None if the server is gone)."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        line = self._readline(time.monotonic() + 30)
        if line is None:  # the server does not answer: a fresh one for the next run
            self.close()
        return line

    def close(self) -> None:
        """Stop the server. Killed, not sent EOF: between runs it only waits for a request, and a process forked from
        this one since (a test's fork-started helper) may still hold the write end of its stdin, so EOF can be late."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc = None
        self._buffer = b""


RUNNER = ScriptRunner()  # the suite's one fork server (tests/experiments/conftest.py closes it)


def run_script(argv: list[str], cwd: str | os.PathLike[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)``, through ``RUNNER``."""
    return RUNNER.run(argv, cwd, timeout)


def _child(request: dict[str, Any]) -> int:
    """In the forked child: become ``python SCRIPT ARGS...`` and run it; its exit status."""
    import runpy

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = os.path.abspath(request["argv"][0])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` puts the script's folder first
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A fresh process seeds its random generators from the OS; a forked one starts from the server's state: reseed.
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, exit status 1
        import traceback

        traceback.print_exc()
        return 1
    return 0


def _serve() -> None:
    """The server: warm imports, then one forked child per request, one at a time."""
    import importlib

    import gc

    for name in WARM_MODULES:
        importlib.import_module(name)
    # The imported modules' objects stay out of the children's garbage collections (they would otherwise scan them
    # all, as a fresh process does not for modules it never imports, and copy their pages on write).
    gc.freeze()
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sys.stdin = open(os.devnull)  # noqa: SIM115 - the child must not read the requests
            sys.exit(_child(request))  # the interpreter's normal exit: atexit handlers, threads joined, streams flushed
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    _serve()
