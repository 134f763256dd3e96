"""``experiments/slo_sweep.py``: re-scoring one run at scaled SLOs equals fresh runs at those SLOs
(and is refused where it would not), the exact tightest scale, the target grammar, and an endpoint
target measured against a real in-process server of the tiny model."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from experiment_modules import load_experiment
from serving_util import HttpServer, colocated_server

from distserve.config import CacheConfig
from distserve.errors import InvalidConfigError
from distserve.slo import SLO, SLOSpec, attainment, meets
from simulator.latency import get_latency_model
from simulator.simulation import SimConfig, simulate, with_rate
from simulator.workload import generate_requests

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


_load = load_experiment


_load("harness")
systems = _load("sweep_systems")
_load("sweeper")
sweep = _load("slo_sweep")

SLO_BASE = SLO(0.25, 0.1, 0.9)
SCALES = [0.25, 0.5, 1.0, 2.0, 4.0]
LATENCY = get_latency_model("facebook/opt-13b", hardware="a100-80g")  # roofline: no file needed


def _args(*extra: str) -> object:
    return sweep.parse_args(["--sim", "x=--colocated 1", "--num-requests", "60", *extra])


def _target(spec: str, *extra: str) -> object:
    args = _args(*extra)
    base = SimConfig(**sweep.scheduler_configs(None, None, args.tpot_slo if args.step_budget == "slo" else None))
    return systems.parse_sim(f"t={spec}", systems.with_overrides(base, args.scheduler), lambda kind: pytest.fail("no plan"))


def _sweeper(*extra: str) -> object:
    args = _args(*extra)
    unit = generate_requests("chatbot", 1.0, args.num_requests, seed=3, max_total_len=2048)
    return sweep.Sweeper(args, LATENCY, unit, SLO_BASE), unit


@pytest.mark.parametrize("spec", ["--colocated 1", "--prefill 1 --decode 1"])
def test_rescored_attainment_equals_fresh_simulations_at_scaled_slos(spec: str) -> None:
    sweeper, unit = _sweeper()
    target = _target(spec)
    rate = 6.0  # loaded enough that attainment varies across the scales
    got = sweeper.scale_sweep(target, rate / target.num_gpus, SCALES)
    assert got["rescored"]
    joint = []
    for point, scale in zip(got["points"], SCALES):
        fresh = simulate(target.placement, LATENCY, with_rate(unit, rate), target.config)
        att = attainment(fresh.records, SLO(0.25 * scale, 0.1 * scale, 0.9))
        assert {k: point[k] for k in ("joint", "ttft", "tpot")} == att
        assert point["separate"] == min(att["ttft"], att["tpot"])
        joint.append(att["joint"])
    assert joint == sorted(joint) and joint[0] < joint[-1]  # the scales matter here
    # The exact tightest scale: the target is met just at it and missed just below.
    for mode in ("joint", "separate"):
        s = got["min_scale"][mode]
        assert math.isfinite(s)
        spec_at = SLOSpec(SLO(0.25 * s, 0.1 * s, 0.9), mode=mode)
        below = SLOSpec(SLO(0.25 * s * 0.999, 0.1 * s * 0.999, 0.9), mode=mode)
        records = simulate(target.placement, LATENCY, with_rate(unit, rate), target.config).records
        assert meets(attainment(records, spec_at), spec_at) and not meets(attainment(records, below), below)


def test_slo_dependent_scheduling_is_simulated_again_per_scale() -> None:
    """With the "slo" step budget the schedule follows the TPOT SLO: re-scoring would be wrong, so
    each scale is simulated with its own SLO in the budget — and that differs from re-scoring."""
    sweeper, unit = _sweeper("--step-budget", "slo")
    target = _target("--colocated 1", "--step-budget", "slo")
    assert target.slo_dependent and target.config.scheduler.tpot_slo_s == 0.1
    rate = 6.0
    got = sweeper.scale_sweep(target, rate, SCALES)
    assert not got["rescored"]
    base = simulate(target.placement, LATENCY, with_rate(unit, rate), target.config).records
    differs = False
    for point, scale in zip(got["points"], SCALES):
        slo = SLO(0.25 * scale, 0.1 * scale, 0.9)
        fresh = simulate(target.placement, LATENCY, with_rate(unit, rate), target.config_at(scale)).records
        assert {k: point[k] for k in ("joint", "ttft", "tpot")} == attainment(fresh, slo)
        differs |= attainment(base, slo) != attainment(fresh, slo)
    assert differs


def test_target_grammar() -> None:
    t = _target("--prefill 2 --decode 1 --prefill-tp 2 --router least-loaded decode.max_num_seqs=8 policy=priority")
    assert [s.tp for s in t.placement.prefill] == [2, 2] and len(t.placement.decode) == 1
    assert t.config.router == "least-loaded" and t.config.decode_scheduler.max_num_seqs == 8
    assert t.config.scheduler.max_num_seqs != 8 and {c.policy for c in (t.config.scheduler, t.config.decode_scheduler)} == {"priority"}
    assert _target("--colocated 2", "--scheduler", "enable_chunked_prefill=true").config.scheduler.enable_chunked_prefill
    for bad, words in [("--colocated 0", "must be >= 1"), ("--colocated 1 --rate 3", "not a placement flag"),
                       ("--colocated 1 nope=1", "FIELD one of"), ("--colocated 1 max_num_seqs=x", "expected a number"),
                       ("/no/such.json", "such.json")]:
        with pytest.raises(InvalidConfigError, match=words):
            _target(bad)


def test_bad_command_lines_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv in (["--num-requests", "5"], ["--sim", "x=--colocated 1", "--modes", "both"],
                 ["--sim", "x=--colocated 1", "--scales", "0,1"], ["--sim", "x=--colocated 1", "--sweeps", "slo-scale"]):
        with pytest.raises(SystemExit) as exc:
            sweep.parse_args(argv)
        assert exc.value.code == 2
    assert not list(tmp_path.iterdir())
    # Every numeric flag refuses a bad value naming itself (before: a negative --max-rate ran a sweep).
    for flag, value, words in [("--max-rate", "-1", "must be a finite number > 0"), ("--ttft-slo", "nan", "finite latency > 0"),
                               ("--attainment", "1.5", r"must be in \(0, 1\]"), ("--cv", "0", "finite number > 0"),
                               ("--min-rate", "-1", "finite number >= 0"), ("--endpoint-gpus", "0", "must be >= 1"),
                               ("--start-per-gpu", "x", "must be a number"), ("--request-timeout", "inf", "finite number > 0")]:
        with pytest.raises(SystemExit) as exc:
            sweep.parse_args(["--sim", "x=--colocated 1", flag, value])
        assert exc.value.code == 2
        assert re.search(f"argument {flag}: .*{words}", capsys.readouterr().err)
    for argv, words in [(["--max-rate", "0.1"], "--max-rate must be above --min-rate"), (["--rel-tol", "1"], "--rel-tol must be in"),
                        (["--scales", "1,inf"], "--scales must be finite numbers > 0")]:
        with pytest.raises(SystemExit):
            sweep.parse_args(["--sim", "x=--colocated 1", *argv])
        assert words in capsys.readouterr().err
    out = ["--out-dir", str(tmp_path)]
    assert sweep.main(["--sim", "x=--colocated 1", "--sim", "x=--colocated 2", *out]) == 2
    assert "names must differ" in capsys.readouterr().err
    # Checked when the target's instances are built: a policy no scheduler knows, a tp the latency model cannot time.
    assert sweep.main(["--sim", "x=--colocated 1 policy=nope", *out]) == 2
    assert "--sim x: unknown scheduling policy 'nope'" in capsys.readouterr().err
    assert sweep.main(["--sim", "x=--prefill 1 --decode 1 --prefill-tp 8", *out]) == 2  # DistServe's coefficients: tp 1, 2, 4
    assert "--sim x: the latency model cannot time tp=8" in capsys.readouterr().err
    dead = ["--endpoint", "dead=http://127.0.0.1:1/v1", "--probe-requests", "2", "--start-per-gpu", "50", *out]
    assert sweep.main(dead) == 2
    assert "--endpoint dead=http://127.0.0.1:1/v1: no request completed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ---- an endpoint: a real server of the tiny model ------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    srv = colocated_server(CacheConfig(num_blocks=512, block_size=16))
    yield srv
    srv.stop()


@pytest.mark.integration
def test_endpoint_target_sweeps_a_live_server(server: HttpServer, tmp_path: Path) -> None:
    argv = ["--endpoint", f"tiny={server.url}/v1", "--model-name", "tiny", "--workload", "fixed:48:6", "--num-requests", "8",
            "--probe-requests", "8", "--max-probes", "2", "--start-per-gpu", "4", "--ttft-slo", "5", "--tpot-slo", "1",
            "--modes", "joint", "--scales", "0.000001,1", "--out-dir", str(tmp_path)]
    assert sweep.main(argv) == 0
    data = json.loads((tmp_path / "slo_sweep.json").read_text())
    s = data["systems"]["tiny"]
    probes = s["rate_sweep"]["points"]
    assert 1 <= len(probes) <= 2 and s["rate_sweep"]["goodput_rps"]["joint"] >= 4.0  # loose SLOs: the first probe passes
    assert all(p["joint"] == 1.0 for p in probes)
    at = {p["scale"]: p for p in s["scale_sweep"]["points"]}
    # A 5 µs TTFT / 1 µs TPOT is out of reach (the tiny model met 5 ms / 1 ms for one request in eight once: 0.001 was not)
    assert at[1.0]["joint"] == 1.0 and at[1e-6]["joint"] == 0.0
    assert 1e-6 < s["scale_sweep"]["min_scale"]["joint"] <= 1.0
    assert (tmp_path / "slo_sweep.png").stat().st_size > 0 and "| tiny | endpoint | 1 |" in (tmp_path / "slo_sweep.md").read_text()


@pytest.mark.integration
def test_endpoint_requests_carry_the_workloads_own_lengths(server: HttpServer) -> None:
    """The load generator replays the sweep's workload: each request its own arrival and output length."""
    args = sweep.parse_args(["--endpoint", f"tiny={server.url}/v1", "--probe-requests", "6", "--ttft-slo", "30", "--tpot-slo", "5"])
    unit = generate_requests("chatbot", 1.0, 10, seed=1, max_total_len=96)
    assert len({r.output_len for r in unit[:6]}) > 1
    sweeper = sweep.Sweeper(args, None, unit, SLO(30.0, 5.0, 0.9))
    records, stopped = sweeper.load(systems.EndpointTarget("tiny", f"{server.url}/v1", 1), 20.0, stop_below=None)
    assert not stopped and [r.num_output_tokens for r in records] == [r.output_len for r in unit[:6]]
    sent = [r.sent_s for r in records]
    assert sent == sorted(sent) and sent[-1] - sent[0] == pytest.approx((unit[5].arrival_s - unit[0].arrival_s) / 20.0, abs=0.05)
    # Prompts are whole words (one at least: ~5 of the tiny model's byte tokens), calibrated to the server's tokens.
    assert all(abs(r.num_prompt_tokens - u.prompt_len) <= max(5, 0.15 * u.prompt_len) for r, u in zip(records, unit))
