"""What this machine is doing while we time steps: CPU accounting from /proc and the quiet-machine guard.

A profile is only as good as the machine was quiet while it ran, so every measurement here can
tell whether other processes used the CPU during a timed step (``QuietGuard``) and how much CPU
the hypervisor gave to others (steal), from the kernel's jiffy counters.
"""

from __future__ import annotations

import os
import pathlib
import platform
import time
from collections.abc import Callable, Sequence as Seq

# Quiet-machine guard: others may use this much CPU (cores) during a timed step; a disturbed step is
# timed again up to QUIET_RETRIES times (waiting for quiet takes at most ``max_wait_s`` in all).
QUIET_MAX_OTHER_CORES = 0.25
QUIET_RETRIES = 3


def cpu_jiffies(busy: bool = False) -> tuple[int, int]:
    """(all, steal) jiffies of the machine since boot — with ``busy``, all but idle and iowait;
    (0, 0) where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return 0, 0
    total = sum(fields) - (fields[3] + fields[4] if busy else 0)
    return total, fields[7] if len(fields) > 7 else 0


def steal_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Share of the CPU time between two ``cpu_jiffies()`` readings the hypervisor gave to others."""
    total = after[0] - before[0]
    return round((after[1] - before[1]) / total, 4) if total > 0 else 0.0


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def process_cpu_s(pid: int, tick_s: float) -> float:
    """CPU seconds (user + system) process ``pid`` has used; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... utime stime
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) * tick_s


class QuietGuard:
    """Whether other processes used the CPU while a step ran, and waiting for them to stop.

    On a VM whose vCPUs can share a physical core a busy neighbour process can double a one-thread
    step's time (measured here: 2.05-2.3x at one time, ~1.0x an hour and a half later), so a step
    timed while others ran is timed again. Budgets bound the waiting: a machine that never quiets
    down still gets profiled.
    """

    def __init__(self, max_other_cores: float, max_retries: int, max_wait_s: float, exclude_pids: Seq[int] = ()) -> None:
        """``exclude_pids``: processes that are part of the measurement (not "others")."""
        self.max_other_cores = max_other_cores
        self.exclude_pids = list(exclude_pids)
        self.max_retries = max_retries
        self.wait_budget_s = max_wait_s
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self.num_disturbed = 0  # steps timed again
        self.num_kept_disturbed = 0  # out of retries: kept anyway
        self.waited_s = 0.0

    def snapshot(self) -> tuple[float, float]:
        """(CPU seconds the whole machine has been busy, CPU seconds of this process and the excluded ones)."""
        total, _ = cpu_jiffies(busy=True)
        return total * self.tick_s, time.process_time() + sum(process_cpu_s(pid, self.tick_s) for pid in self.exclude_pids)

    def timed(self, run: Callable[[], object]) -> float:
        """Seconds ``run()`` takes on a quiet machine: run again (after waiting) while others
        disturbed it, up to ``max_retries`` times."""
        for attempt in range(self.max_retries + 1):
            before = self.snapshot()
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
            if self.others_cores(before, seconds) < self.max_other_cores:
                break
            if attempt == self.max_retries:
                self.num_kept_disturbed += 1
                break
            self.num_disturbed += 1
            self.wait_for_quiet()
        return seconds

    def others_cores(self, before: tuple[float, float], seconds: float) -> float:
        busy, own = self.snapshot()
        others = (busy - before[0]) - (own - before[1])
        return max(0.0, others - 2 * self.tick_s) / max(seconds, 1e-9)  # two ticks of slack: jiffy rounding

    def wait_for_quiet(self, window_s: float = 0.5) -> None:
        while self.wait_budget_s > 0:
            before = self.snapshot()
            time.sleep(window_s)
            self.wait_budget_s -= window_s
            self.waited_s += window_s
            if self.others_cores(before, window_s) < self.max_other_cores:
                return

    def counts(self) -> dict[str, float]:
        """What the guard did, for a profile's ``meta.quiet_guard``."""
        return {"num_steps_retimed": self.num_disturbed, "num_steps_kept_disturbed": self.num_kept_disturbed,
                "waited_s": round(self.waited_s, 1)}


__all__ = ["QUIET_MAX_OTHER_CORES", "QUIET_RETRIES", "QuietGuard", "cpu_jiffies", "cpu_model", "process_cpu_s", "steal_fraction"]
