"""Every script under experiments/ runs with --quick and ends with one JSON object of figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "experiments").glob("*.py"))

# Figures a quick run must get right regardless of machine speed.
CHECKS = {
    "bench_engine": lambda f: f["greedy_same_as_hf_float32"] == 1.0 and f["ours_tok_s_batch_float32"] > 0,
}


def test_there_are_experiments() -> None:
    assert SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_quick_run_prints_json_last(script: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    figures = json.loads(last)
    assert isinstance(figures, dict) and figures
    check = CHECKS.get(script.stem)
    assert check is None or check(figures), figures
