"""The simulator compiled with mypyc (``distserve.compiled``) gives every record the interpreted
simulator gives, and its objects pickle as the Ray runtime needs; a build is loaded only if it was made
from the sources as they are now."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distserve import compiled

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.integration  # a build (about a minute, if `make install` did not make it) and subprocesses


def run(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, str(HERE / "compiled_runs.py")], env={**os.environ, "PYTHONPATH": str(compiled.ROOT), **env},
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_compiled_simulations_give_the_interpreted_records() -> None:
    if compiled.built_digest() != compiled.sources_digest():
        compiled.build()  # as `make sim-fast` does
    fast, slow = run({compiled.ENV: ""}), run({compiled.ENV: "0"})
    assert (fast["mode"], slow["mode"]) == ("compiled", "interpreted")
    assert fast["digests"] == slow["digests"]
    assert fast["round_trips"] == slow["round_trips"] and all(slow["round_trips"].values()), fast["round_trips"]  # type: ignore[union-attr]


def test_only_a_build_of_the_current_sources_is_loaded(tmp_path: Path) -> None:
    assert "not built" in compiled.unusable(tmp_path)
    (tmp_path / compiled.STAMP).write_text("0" * 64 + "\n")
    assert "stale" in compiled.unusable(tmp_path)
    (tmp_path / compiled.STAMP).write_text(compiled.sources_digest() + "\n")
    assert compiled.unusable(tmp_path, env={}) == "" or any(m in sys.modules for m in compiled.MODULES)
    import simulator.simulation  # noqa: F401 - loaded now: its compiled form loaded later would mix the two
    assert "imported before" in compiled.unusable(tmp_path)
    assert compiled.unusable(tmp_path, env={compiled.ENV: "0"}) == f"{compiled.ENV}=0"
