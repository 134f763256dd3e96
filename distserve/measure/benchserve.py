"""Server processes for HTTP benchmarks: start an OpenAI-compatible server (ours, or a peer such as vLLM), wait until it answers, see where the CPU goes, stop it leaving nothing behind.

Every server runs in its own session (``start_new_session``), so the session id names all of its
processes, including the ones it spawns and that outlive it: Ray's raylet, GCS and actor workers,
vLLM's engine core and workers. ``ServerProcess.stop`` sends SIGINT (the servers shut down cleanly
on it), waits, SIGKILLs whatever is left in the session and reports how many survived: a benchmark
that leaves processes behind skews the next one's measurement.

The experiments in ``experiments/`` (bench_disagg, bench_serving) share these helpers; they import
them from here rather than from each other.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from distserve.measure.machine import cpu_jiffies

# What `distserve serve` prints once it listens (with --port 0 the port is only known from this line).
READY_LINE = re.compile(r"at (http://\S+)/v1")
# A Prometheus text sample: name, optional labels, value.
_SAMPLE = re.compile(r"^([\w:]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN|[+-]Inf)\s*$", re.MULTILINE)


def default_sigint() -> None:
    """``preexec_fn`` of a server ``stop`` ends with SIGINT: SIGINT back to its default in the child. A
    process started as a shell's background job (``cmd &`` in a script, ``nohup``) ignores SIGINT, and an
    ignored signal stays ignored across exec: a benchmark started that way left every server deaf to
    SIGINT, each stop fell through to SIGKILL (Ray Serve's ``serve run`` then left its agents behind)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes in session ``sid``: a server started with start_new_session and
    everything it spawned, Ray's raylet, GCS and actor workers included (they keep the session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far: per process (own + reaped children's) and of the whole machine."""

    per_pid: dict[int, tuple[int, str, float]]  # pid -> (session id, name, CPU seconds)
    machine_busy_s: float  # all CPUs, everything but idle and iowait (/proc/stat)


def process_cpu() -> CpuSnapshot:
    """A snapshot of every process's CPU time (reaped children included) and the machine's."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        name = os.path.basename(cmd[0].decode(errors="replace"))[:40] if cmd and cmd[0] else stat.split("(", 1)[1].split(")")[0]
        if b"distserve.cli" in cmd:
            name = "distserve-serve"  # the HTTP server (+ the colocated engine, or the Ray runtime's controller)
        elif b"vllm.entrypoints.openai.api_server" in cmd:
            name = "vllm-api-server"
        out[int(entry)] = (int(fields[3]), name, sum(int(x) for x in fields[11:15]) / tick)  # utime stime cutime cstime
    return CpuSnapshot(out, cpu_jiffies(busy=True)[0] / tick)


def cpu_usage(before: CpuSnapshot, after: CpuSnapshot, elapsed_s: float, server_sid: int | None) -> dict[str, Any]:
    """Where the CPU went between two snapshots, in cores: the server's busiest processes, this
    process (the load generator), and everything else on the machine (it is shared).

    "Everything else" is the machine's busy time minus the server's and ours: summing other
    processes instead would credit a process that exits meanwhile with its whole lifetime (it moves
    into its parent's reaped-children time at once).
    """
    me = os.getpid()
    server: list[tuple[str, float]] = []
    for pid, (sid, name, cpu) in after.per_pid.items():
        if pid != me and server_sid is not None and sid == server_sid:
            used = (cpu - before.per_pid[pid][2] if pid in before.per_pid else cpu) / elapsed_s
            server.append((f"{name} [{pid}]", round(used, 2)))
    mine = before.per_pid.get(me), after.per_pid.get(me)
    me_used = (mine[1][2] - mine[0][2]) / elapsed_s if mine[0] and mine[1] else 0.0
    other = (after.machine_busy_s - before.machine_busy_s) / elapsed_s - sum(c for _, c in server) - me_used
    return {
        "server_cores": sorted((x for x in server if x[1] >= 0.05), key=lambda x: -x[1])[:5],
        "loadgen_cores": round(me_used, 2),
        "other_cores": round(max(0.0, other), 2),
    }


def distserve_serve_argv(model: str, dtype: str, flags: list[str], port: int = 0) -> list[str]:
    """`python -m distserve.cli serve` with this interpreter (so a worktree's PYTHONPATH is honoured)."""
    return [
        sys.executable, "-m", "distserve.cli", "serve", "--model", model, "--dtype", dtype,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags,
    ]


def metric_sums(base_url: str, suffixes: tuple[str, ...], timeout_s: float = 5.0) -> dict[str, float] | None:
    """Per suffix, the sum of the server's ``/metrics`` samples whose name ends with it (over all
    labels and prefixes: ``distserve:`` and ``vllm:`` alike); a suffix nothing matched is left out.
    None if the server has no ``/metrics``."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        resp = httpx.get(f"{root}/metrics", timeout=timeout_s, trust_env=False)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    sums: dict[str, float] = {}
    for name, value in _SAMPLE.findall(resp.text):
        for suffix in suffixes:
            if name.endswith(suffix):
                sums[suffix] = sums.get(suffix, 0.0) + float(value)
    return sums


def num_requests_in_server(base_url: str) -> int | None:
    """Running + waiting requests (ours and vLLM's ``num_requests_running``/``_waiting`` gauges,
    over all instances); None if the server exports neither."""
    sums = metric_sums(base_url, ("num_requests_running", "num_requests_waiting"))
    return int(round(sum(sums.values()))) if sums else None


def wait_until_idle(base_url: str, timeout_s: float = 60.0) -> float:
    """Wait until the server holds no request (e.g. after a run that cancelled its requests);
    seconds waited. Returns at once for a server without the queue gauges."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        num = num_requests_in_server(base_url)
        if not num:
            break
        time.sleep(0.2)
    return time.monotonic() - t0


@dataclass
class ServerProcess:
    """One server subprocess in its own session; ``stop`` leaves none of its processes.

    ``port=None`` (ours, started with ``--port 0``): the URL is read from the ready line it prints.
    A given ``port`` (peers): the server is ready once ``GET /health`` answers 200 there.
    """

    name: str
    argv: list[str]
    startup_timeout_s: float
    port: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    work_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dsb", dir="/tmp")))
    proc: subprocess.Popen[bytes] | None = None
    base_url: str = ""
    startup_s: float = 0.0

    @property
    def log_path(self) -> Path:
        return self.work_dir / "server.log"

    @property
    def sid(self) -> int | None:
        """The session id of every process of this server (the leader's pid)."""
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def _root_url(self) -> str | None:
        if self.port is not None:
            return f"http://127.0.0.1:{self.port}"
        match = READY_LINE.search(self.log_tail(100_000))
        return match.group(1) if match else None

    def start(self) -> str:
        """Start, wait until ``/health`` answers, return the base URL (``http://127.0.0.1:PORT/v1``)."""
        env = dict(os.environ, RAY_TMPDIR=str(self.work_dir), PYTHONUNBUFFERED="1", **self.env)
        env.pop("RAY_ADDRESS", None)  # a fresh Ray instance of our own, never someone else's cluster
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=default_sigint)
        deadline = t0 + self.startup_timeout_s
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} server not healthy after {self.startup_timeout_s:g} s:\n{self.log_tail()}")
                root = self._root_url()
                if root:
                    try:
                        if client.get(f"{root}/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                time.sleep(0.2)
        self.startup_s = time.monotonic() - t0
        self.base_url = f"{root}/v1"
        return self.base_url

    def stop(self, grace_s: float = 30.0, linger_s: float = 10.0) -> dict[str, Any]:
        """SIGINT, wait up to ``grace_s`` for the server and ``linger_s`` more for the rest of its session to exit
        on its own, then SIGKILL whatever is left in the session; report what was left."""
        report: dict[str, Any] = {"graceful": True, "num_left_after_sigint": 0, "num_left": 0}
        if self.proc is None:
            return report
        sid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                report["graceful"] = False
        deadline = time.monotonic() + linger_s  # Ray's daemons exit shortly after the driver shuts Ray down
        while session_pids(sid) and time.monotonic() < deadline and report["graceful"]:
            time.sleep(0.2)
        left = session_pids(sid)
        report["num_left_after_sigint"] = len(left)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        deadline = time.monotonic() + 10.0
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        report["num_left"] = len(session_pids(sid))
        report["exit_code"] = self.proc.returncode
        if report["num_left"] == 0:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        return report
