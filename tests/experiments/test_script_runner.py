"""``script_runner`` (the quick runs' fork server) behaves as ``subprocess.run`` of ``python SCRIPT ARGS``: exit status,
stdout and stderr, argv, ``__file__``, the script's folder on ``sys.path``, the caller's cwd and environment, stdin
closed, fresh random state, atexit handlers run, and a timeout kills the script and raises ``TimeoutExpired``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_runner import run_script

pytestmark = pytest.mark.integration  # starts processes

SCRIPT = '''
import atexit, json, os, random, sys
import helper_next_to_it
atexit.register(lambda: print("atexit ran", file=sys.stderr))
print("progress line")
print(json.dumps({"argv": sys.argv, "file": __file__, "name": __name__, "cwd": os.getcwd(), "env": os.environ.get("SCRIPT_RUNNER_PROBE"),
                  "stdin": sys.stdin.read(), "random": random.random(), "helper": helper_next_to_it.VALUE}))
sys.exit(int(sys.argv[1]))
'''


def test_a_script_runs_as_python_script_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "probe.py").write_text(SCRIPT)
    (tmp_path / "helper_next_to_it.py").write_text("VALUE = 7\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("SCRIPT_RUNNER_PROBE", "seen")
    runs = [run_script([sys.executable, str(tmp_path / "probe.py"), code, "--x"], cwd=work, timeout=60) for code in ("0", "3")]
    for code, proc in zip((0, 3), runs):
        assert proc.returncode == code and proc.stdout.splitlines()[0] == "progress line"
        assert proc.stderr.strip() == "atexit ran"
        f = json.loads(proc.stdout.splitlines()[-1])
        assert f["argv"] == [str(tmp_path / "probe.py"), str(code), "--x"] and f["file"] == str(tmp_path / "probe.py")
        assert f["name"] == "__main__" and f["cwd"] == str(work) and f["env"] == "seen" and f["stdin"] == "" and f["helper"] == 7
    assert json.loads(runs[0].stdout.splitlines()[-1])["random"] != json.loads(runs[1].stdout.splitlines()[-1])["random"]


def test_an_exception_is_exit_status_1_with_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "boom.py").write_text("raise ValueError('boom')\n")
    proc = run_script([sys.executable, str(tmp_path / "boom.py")], cwd=tmp_path, timeout=60)
    assert proc.returncode == 1 and "ValueError: boom" in proc.stderr and proc.stdout == ""


def test_a_timeout_kills_the_script(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    (tmp_path / "slow.py").write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_script([sys.executable, str(tmp_path / "slow.py")], cwd=tmp_path, timeout=1.5)
    pid = int(pid_file.read_text())
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
    (tmp_path / "ok.py").write_text("print('fine')\n")
    after = run_script([sys.executable, str(tmp_path / "ok.py")], cwd=tmp_path, timeout=60)
    assert after.returncode == 0 and after.stdout == "fine\n"  # the runner still serves
