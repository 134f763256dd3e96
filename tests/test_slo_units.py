"""SLO latency flags take units (200ms, 0.2s, 0.2 s); a bare number above 60 is refused as a likely millisecond value."""

from __future__ import annotations

import math

import pytest

from distserve.cli import main
from distserve.cli.args import build_parser
from distserve.errors import InvalidConfigError
from distserve.measure import loadgen
from distserve.planner.classes import parse_class_slo
from distserve.slo import SLO, parse_latency


@pytest.mark.parametrize("text,seconds", [("200ms", 0.2), ("0.2s", 0.2), ("0.2", 0.2), ("200 ms", 0.2), ("1.5S", 1.5),
                                          ("60", 60.0), ("120s", 120.0), ("0.5ms", 0.0005), ("60000ms", 60.0)])
def test_units(text: str, seconds: float) -> None:
    assert parse_latency(text, "--ttft") == pytest.approx(seconds)


@pytest.mark.parametrize("text,needle", [
    ("200", "milliseconds: write 200ms (or 0.2s)"), ("60.5", "milliseconds"), ("abc", "expected a latency"),
    ("5m", "expected a latency"), ("0", "> 0"), ("-1ms", "> 0"), ("inf", "finite"), ("nan", "finite"), ("", "expected"),
])
def test_bad_latencies_name_the_flag(text: str, needle: str) -> None:
    with pytest.raises(InvalidConfigError) as info:
        parse_latency(text, "--tpot-slo")
    assert str(info.value).startswith("--tpot-slo") and needle in str(info.value) and info.value.param == "tpot_slo"


def test_inf_only_where_allowed() -> None:
    assert parse_latency("inf", "--class-slo", allow_inf=True) == math.inf
    assert parse_class_slo("latency=200ms:50ms") == ("latency", SLO(0.2, 0.05))
    assert parse_class_slo("throughput=inf:0.1s") == ("throughput", SLO(math.inf, 0.1))
    with pytest.raises(InvalidConfigError, match="--class-slo 'latency=200:50'.*200ms"):
        parse_class_slo("latency=200:50")


@pytest.mark.parametrize("argv,dests", [
    (["simulate", "--model", "facebook/opt-13b", "--ttft", "200ms", "--tpot", "0.05s"], {"ttft": 0.2, "tpot": 0.05}),
    (["simulate", "--model", "facebook/opt-13b", "--ttft-slo", "0.2", "--tpot-slo", "50ms"], {"ttft": 0.2, "tpot": 0.05}),
    (["plan", "--model", "facebook/opt-13b", "--ttft-slo", "1.5s", "--tpot", "100ms"], {"ttft": 1.5, "tpot": 0.1}),
    (["serve", "--ttft-slo", "250ms", "--tpot-slo", "0.04"], {"ttft_slo": 0.25, "tpot_slo": 0.04}),
])
def test_every_subcommand_takes_units(argv: list[str], dests: dict[str, float]) -> None:
    args = build_parser().parse_args(argv)
    for dest, seconds in dests.items():
        assert getattr(args, dest) == pytest.approx(seconds)


@pytest.mark.parametrize("argv,flag", [
    (["simulate", "--model", "facebook/opt-13b", "--ttft", "200", "--tpot", "0.05"], "--ttft"),
    (["plan", "--model", "facebook/opt-13b", "--ttft", "1", "--tpot", "75"], "--tpot"),
    (["serve", "--ttft-slo", "500"], "--ttft-slo"),
    (["serve", "--tpot-slo", "fast"], "--tpot-slo"),
])
def test_cli_refuses_a_bare_millisecond_value(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {flag}" in err and "Traceback" not in err


def test_plan_class_slo_with_units(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--workers", "1", "--model", "facebook/opt-13b", "--nodes", "1", "--gpus-per-node", "1", "--num-requests", "10",
                 "--class-slo", "latency=250", "--json"])
    assert code == 2 and "--class-slo" in capsys.readouterr().err
    code = main(["plan", "--workers", "1", "--model", "facebook/opt-13b", "--nodes", "1", "--gpus-per-node", "1", "--num-requests", "10",
                 "--class-slo", "latency=200:50", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "--class-slo" in err and "milliseconds" in err


def test_loadgen_slo_flags_take_units(capsys: pytest.CaptureFixture[str]) -> None:
    args = loadgen.build_parser().parse_args(["--base-url", "x", "--model", "m", "--rate", "1", "--num-requests", "1",
                                              "--input-len", "4", "--output-len", "4", "--ttft-slo", "200ms", "--tpot-slo", "0.05"])
    assert (args.ttft_slo, args.tpot_slo) == (pytest.approx(0.2), pytest.approx(0.05))
    with pytest.raises(SystemExit):
        loadgen.build_parser().parse_args(["--base-url", "x", "--model", "m", "--rate", "1", "--num-requests", "1",
                                           "--input-len", "4", "--output-len", "4", "--ttft-slo", "200"])
    err = capsys.readouterr().err
    assert "--ttft-slo" in err and "milliseconds" in err
