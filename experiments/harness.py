"""What every script in ``experiments/`` shares: its command line, where and how it writes, the quiet-machine guard.

A script is run as ``python experiments/NAME.py`` (its folder is on ``sys.path``, so ``import
harness`` works without any path edit) and:

* takes ``--quick`` (the test suite's small run) and ``--out-dir`` (``parser``). Without
  ``--out-dir`` a full run writes to ``experiments/results/``, a quick run to a new temporary
  directory, so test-sized figures never overwrite the committed results (``Outputs.for_run``);
* writes ``STEM.json`` / ``STEM.md`` / ``STEM.png`` there (``Outputs``; the stem ends in
  ``_quick`` for a quick run);
* ends its stdout with ONE line: the JSON object of its measured figures (``finish``).

Also a few helpers more than one script uses (``rich_table``, ``ms``, ``layout``, ``stop_server``).

This machine is shared, so timings are taken with the load of everything else in view:
``LoadWatch`` measures the CPU used outside this run's process tree (and which other benchmarks
ran) while a measurement runs, and ``QuietGuard`` waits for a quiet machine before a measurement
and redoes one that others disturbed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from distserve.measure.benchserve import ServerProcess
    from distserve.placement import Placement

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Other benchmarks that load the cores for minutes: a measurement waits for them to end.
BUSY_PATTERN = r"experiments/(validate_simulator|validate_planner|reproduce_distserve|bench_simulator)\.py"
T = TypeVar("T")


# ---- command line and outputs ---------------------------------------------------------------------
def parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """An argument parser with the script's docstring as its help and ``--quick``/``--out-dir``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out-dir", default=None,
                   help=f"where results go (default: {RESULTS_DIR.relative_to(RESULTS_DIR.parents[1])}/; a new temporary "
                        "directory with --quick)")
    return p


def model_dtype(value: str) -> str:
    """``--dtype``'s type: ``auto`` resolved here (bf16 only on a CPU with native bf16: elsewhere it runs
    ~70x slower than fp32, as on an AVX2-only machine), so both servers of a comparison and the results
    name the dtype that ran."""
    from distserve.dtypes import resolve_dtype

    if value not in ("auto", "float32", "bfloat16", "float16"):
        raise argparse.ArgumentTypeError(f"must be auto, float32, bfloat16 or float16, got {value!r}")
    return resolve_dtype(value)


@dataclass(frozen=True)
class Outputs:
    """A run's result files: ``out_dir / (stem + suffix)``."""

    out_dir: Path
    stem: str

    @classmethod
    def for_run(cls, args: argparse.Namespace, name: str, tag: str = "") -> Outputs:
        """``--out-dir``, else ``experiments/results/`` (a temporary directory for ``--quick``);
        the stem is ``name`` + ``_quick`` (quick) or ``_tag``."""
        if args.out_dir is not None:
            out_dir = Path(args.out_dir)
        elif args.quick:
            out_dir = Path(tempfile.mkdtemp(prefix=f"{name}_quick_"))
            print(f"--quick without --out-dir: results go to {out_dir}", flush=True)
        else:
            out_dir = RESULTS_DIR
        out_dir.mkdir(parents=True, exist_ok=True)
        return cls(out_dir, name + ("_quick" if args.quick else f"_{tag}" if tag else ""))

    def path(self, suffix: str) -> Path:
        return self.out_dir / f"{self.stem}{suffix}"

    def json(self, data: Any, suffix: str = "", indent: int | None = 2) -> None:
        """``STEM{suffix}.json`` (numpy scalars written as floats)."""
        self.path(f"{suffix}.json").write_text(json.dumps(data, indent=indent, default=float) + "\n")

    def markdown(self, lines: list[str]) -> None:
        self.path(".md").write_text("\n".join(lines) + "\n")

    def png(self, fig: Any, dpi: int = 120) -> None:
        """Save a matplotlib figure as ``STEM.png`` and close it."""
        fig.savefig(self.path(".png"), dpi=dpi)
        pyplot().close(fig)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only backend (imported on first use: it is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds for a table; "-" when missing (None or NaN)."""
    return "-" if seconds is None or seconds != seconds else f"{seconds * 1000:.0f}"


def stop_server(server: ServerProcess) -> dict[str, Any]:
    """Stop a started server (SIGINT, then SIGKILL for its session) and report what survived."""
    stop = server.stop()
    print(f"{server.name}: stopped ({stop})", flush=True)
    if stop["num_left"]:
        print(f"WARNING: {stop['num_left']} processes of the {server.name} server survived SIGKILL", file=sys.stderr)
    return {"processes_left": stop["num_left"], "processes_left_after_sigint": stop["num_left_after_sigint"],
            "stopped_gracefully": stop["graceful"]}


def finish(figures: dict[str, Any]) -> None:
    """Print the run's figures as the last stdout line: one JSON object (what the test suite reads)."""
    sys.stdout.flush()
    print(json.dumps(figures, default=float), flush=True)


# ---- the machine's speed and load ----------------------------------------------------------------
def python_loop_ns(iterations: int = 2_000_000, repeats: int = 5) -> float:
    """Nanoseconds per iteration of a fixed pure-Python loop (``s += i``; the best of ``repeats``):
    this VM's interpreter speed when a benchmark ran. The machine's speed has differed by 1.7x between
    sessions (``bench_simulator.py`` on the same code), so a pure-Python benchmark's absolute figures
    are comparable across runs only together with it (ratios against a baseline measured in the same
    run are not affected)."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        s = 0
        for i in range(iterations):
            s += i
        best = min(best, time.perf_counter() - t0)
    return best / iterations * 1e9


# ---- the machine's load ---------------------------------------------------------------------------
def busy_pids() -> list[str]:
    """Other benchmarks that load the cores (this machine is shared): not this process, nor the
    processes that started it (a ``timeout`` or shell whose command line names this script)."""
    pids = subprocess.run(["pgrep", "-f", BUSY_PATTERN], capture_output=True, text=True).stdout.split()
    return [pid for pid in pids if int(pid) not in _ancestors()]


def _ancestors() -> set[int]:
    """This process and its parents, up to init."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state ppid
        except (OSError, ValueError, IndexError):
            break
    return out


def cpu_snapshot() -> tuple[int, int]:
    """(busy jiffies of the machine, hypervisor steal included; jiffies of this process and its
    descendants, e.g. Ray and its actors, or spawned workers)."""
    from distserve.measure.profiler import cpu_jiffies

    busy, _ = cpu_jiffies(busy=True)
    parent: dict[int, int] = {}
    used: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... utime stime cutime cstime
        except OSError:
            continue
        pid = int(entry.name)
        # Reaped children's time moves into their parent's cutime/cstime, so it stays in the tree.
        parent[pid], used[pid] = int(rest[1]), sum(int(x) for x in rest[11:15])
    mine = {os.getpid()}
    grew = True
    while grew:
        new = {pid for pid, ppid in parent.items() if ppid in mine} - mine
        mine |= new
        grew = bool(new)
    return busy, sum(used.get(pid, 0) for pid in mine)


class LoadWatch:
    """CPU used by everything but this run (cores, averaged over the ``with`` block) and the other
    benchmarks seen. With a ``period`` a thread polls every ``period`` s (and looks for other
    benchmarks); with ``period=None`` only the start and the end are read (nothing runs meanwhile,
    for timings that a polling thread would disturb)."""

    def __init__(self, period: float | None = 2.0) -> None:
        self.period = period
        self.seen: set[str] = set()
        self.seconds = 0.0
        self._other_jiffies = 0
        self._own_jiffies = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True) if period is not None else None

    def _add(self, before: tuple[int, int], after: tuple[int, int]) -> None:
        own = max(0, after[1] - before[1])
        self._other_jiffies += max(0, (after[0] - before[0]) - own)
        self._own_jiffies += own

    def _poll(self) -> None:
        snap = cpu_snapshot()
        while True:
            self.seen.update(busy_pids())
            stopped = self._stop.wait(self.period)
            now = cpu_snapshot()
            self._add(snap, now)
            snap = now
            if stopped:
                return

    def __enter__(self) -> LoadWatch:
        self._t0 = time.monotonic()
        if self._thread is not None:
            self._thread.start()
        else:
            self._snap = cpu_snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self._add(self._snap, cpu_snapshot())
        self.seconds = time.monotonic() - self._t0

    @property
    def other_cores(self) -> float:
        return self._other_jiffies / os.sysconf("SC_CLK_TCK") / max(self.seconds, 1e-9)

    @property
    def own_cores(self) -> float:
        """CPU of this run: this process and its descendants."""
        return self._own_jiffies / os.sysconf("SC_CLK_TCK") / max(self.seconds, 1e-9)


def watched(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()``, and the cores processes outside this run kept busy meanwhile (``LoadWatch`` without polling)."""
    with LoadWatch(period=None) as watch:
        result = fn()
    return result, watch.other_cores


def add_quiet_args(p: argparse.ArgumentParser, max_wait_s: float, retries: int) -> None:
    """``QuietGuard``'s options: --max-wait-s (0: no wait), --max-other-cores (> 0), --retries (0: measured once)."""
    from distserve.cli.arg_types import non_negative_float, non_negative_int, positive_float

    p.add_argument("--max-wait-s", type=non_negative_float, default=max_wait_s, help="longest wait for a quiet machine before a measurement")
    p.add_argument("--max-other-cores", type=positive_float, default=0.25,
                   help="CPU the rest of the machine (hypervisor steal included) may use during a measurement (cores, mean) "
                        "before it is redone")
    p.add_argument("--retries", type=non_negative_int, default=retries, help="times a measurement is redone when others used the CPU meanwhile")


@dataclass(frozen=True)
class QuietGuard:
    """Measurements on a quiet machine: wait until no other benchmark runs and the rest of the
    machine uses less than ``max_other_cores``, and redo (up to ``retries`` times) a measurement
    during which either happened. Disabled (the quick run): just measure, others' load still reported."""

    enabled: bool
    max_wait_s: float
    max_other_cores: float
    retries: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> QuietGuard:
        """From ``add_quiet_args``' options; enabled unless ``--quick``."""
        return cls(not args.quick, args.max_wait_s, args.max_other_cores, args.retries)

    def wait(self) -> float:
        """Seconds spent waiting for a quiet machine (judged over 5 s)."""
        t0 = time.monotonic()
        announced = False
        while time.monotonic() - t0 < self.max_wait_s:
            with LoadWatch(period=5.0) as watch:
                time.sleep(5.0)
            if not watch.seen and watch.other_cores < self.max_other_cores:
                break
            if not announced:
                print(f"  waiting for a quiet machine (others use {watch.other_cores:.1f} cores"
                      + (f"; benchmarks running: pids {', '.join(sorted(watch.seen))})" if watch.seen else ")"), flush=True)
                announced = True
            time.sleep(10)
        return time.monotonic() - t0

    def measure(self, what: str, fn: Callable[[], T]) -> tuple[T, float, LoadWatch]:
        """``fn()`` on a quiet machine. Returns the result, the seconds waited and the watch of the
        result kept (the last attempt's, marked disturbed in the log if all were)."""
        waited = 0.0
        for attempt in range(self.retries + 1):
            if self.enabled:
                waited += self.wait()
            with LoadWatch() as watch:
                result = fn()
            if not self.enabled or (not watch.seen and watch.other_cores < self.max_other_cores):
                return result, waited, watch
            again = "measuring again" if attempt < self.retries else "keeping it, marked disturbed"
            print(f"  {what}: others used {watch.other_cores:.2f} cores meanwhile"
                  + (f" (benchmarks: pids {', '.join(sorted(watch.seen))})" if watch.seen else "") + f"; {again}", flush=True)
        return result, waited, watch


def layout(p: Placement) -> str:
    """A placement in brief: "2 x colocated tp1pp1" or "1P tp2pp1 + 1D tp1pp1" (homogeneous roles)."""
    if p.colocated:
        s = p.colocated[0]
        return f"{len(p.colocated)} x colocated tp{s.tp}pp{s.pp}"
    sp, sd = p.prefill[0], p.decode[0]
    return f"{len(p.prefill)}P tp{sp.tp}pp{sp.pp} + {len(p.decode)}D tp{sd.tp}pp{sd.pp}"


def rich_table(title: str, columns: list[str], rows: list[list[str]], width: int | None = None, left: tuple[str, ...] = ()) -> None:
    """Print a table to stdout (columns right-aligned except those named in ``left``)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    for row in rows:
        table.add_row(*row)
    Console(file=sys.stdout, width=width).print(table)
