"""The simulator and the planner import no torch: ``distserve plan`` and a sweep's workers start in a fraction of
a second instead of ~1.5 s (torch's import alone), and run where torch is not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # a subprocess: a fresh interpreter's modules


def test_the_simulator_and_the_planner_import_no_torch() -> None:
    code = ("import sys, simulator.simulation, simulator.goodput, distserve.planner.search, distserve.cli.commands; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
