"""`distserve simulate`: tables, --json, traces, goodput search and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distserve.cli import main
from distserve.placement import Placement
from simulator.workload import Request, write_trace

BASE = ["simulate", "--model", "facebook/opt-13b", "--hardware", "a100-80g", "--ttft", "0.25", "--tpot", "0.1"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*BASE, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_json_result_for_flags_and_placement_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = run_json(capsys, "--prefill", "1", "--decode", "1", "--rate", "2", "--num-requests", "80")
    res = out["result"]
    assert res["num_requests"] == 80 and res["num_gpus"] == 2 and res["num_migrations"] > 0
    assert 0 < res["ttft_p50_s"] <= res["ttft_p90_s"] and 0 <= res["attainment"]["joint"] <= 1
    assert "roofline" in out["latency_model"].lower()
    path = tmp_path / "plan.json"
    Placement.disaggregated(1, 1).to_json(path)
    again = run_json(capsys, "--placement", str(path), "--rate", "2", "--num-requests", "80")
    assert again["result"]["ttft_p90_s"] == pytest.approx(res["ttft_p90_s"])  # seeded: same run


def test_table_output_and_goodput_search(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*BASE, "--colocated", "1", "--rate", "1", "--num-requests", "60", "--goodput"])
    text = capsys.readouterr().out
    assert code == 0 and "TTFT (ms)" in text and "goodput of 1x colocated" in text and "req/s per GPU" in text
    # Failing probes end once they cannot pass: their attainments are marked as lower bounds.
    assert text.count("≤") >= 2 and "lower" in text


def test_trace_replayed_at_its_own_rate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [Request(i, 0.5 * i, 100, 20) for i in range(30)])
    out = run_json(capsys, "--colocated", "1", "--workload", str(trace))
    assert out["result"]["num_requests"] == 30 and out["workload"]["rate"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--colocated", "1"], "--rate is required"),
        (["--colocated", "1", "--rate", "-1"], "--rate"),
        (["--colocated", "1", "--rate", "1", "--hardware", "tpu-v9"], "tpu-v9"),
        (["--colocated", "1", "--rate", "1", "--workload", "poems"], "unknown workload"),
        (["--colocated", "1", "--prefill", "1", "--rate", "1"], "--colocated cannot be combined"),
        (["--colocated", "1", "--prefill-tp", "3", "--decode-pp", "2", "--rate", "1"], "--prefill-tp/--decode-pp set the parallelism"),
        (["--prefill", "1", "--decode", "1", "--prefill-tp", "3", "--rate", "1"], "tp=3"),
        (["--colocated", "1", "--rate", "1", "--workload", "/nonexistent/trace.jsonl"], "trace"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) if "-1" in argv else _no_raise():
        code = main([*BASE, *argv])
        assert code == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_unknown_model_and_oversized_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "nope/nope", "--colocated", "1", "--rate", "1", "--ttft", "1", "--tpot", "1"]) == 2
    assert "nope/nope" in capsys.readouterr().err
    assert main(["simulate", "--model", "facebook/opt-66b", "--colocated", "1", "--rate", "1", "--ttft", "1", "--tpot", "1"]) == 2
    assert "does not fit" in capsys.readouterr().err


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_simulate_step_budget_slo_keeps_colocated_tpot_within_the_slo(capsys: pytest.CaptureFixture[str]) -> None:
    tpot = {}
    for budget in ("static", "slo"):
        code = main(["simulate", "--model", "facebook/opt-13b", "--colocated", "1", "--workload", "fixed:1024:64",
                     "--ttft", "1", "--tpot", "0.03", "--rate", "3", "--num-requests", "100", "--step-budget", budget, "--json"])
        assert code == 0
        tpot[budget] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["result"]["tpot_p90_s"]
    assert tpot["slo"] <= 0.03 < tpot["static"]
