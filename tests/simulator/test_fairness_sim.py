"""Tenants in the simulator: the admission queue is the runtime's, so one flooding tenant slows the
light tenants under ``fcfs`` and not under ``fair``; trace fields; ``distserve simulate`` per tenant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distserve.cli import main
from distserve.cluster.admission import AdmissionConfig
from distserve.cluster.tenants import TenantSpec
from distserve.config import SchedulerConfig
from distserve.errors import InvalidConfigError
from distserve.placement import Placement
from distserve.slo import SLO, SLOSpec
from simulator.latency import FittedLatencyModel
from simulator.metrics import SimResult
from simulator.multi_tenant import FLOOD_TENANT, flood_workload, parse_flood_spec
from simulator.profiles import TpCoefficients
from simulator.simulation import SimConfig, simulate
from simulator.workload import Request, load_trace, write_trace

MODEL = "facebook/opt-13b"
SLO_SPEC = SLOSpec(SLO(ttft_s=1.0, tpot_s=0.1, attainment=0.9))


def opt13b() -> FittedLatencyModel:
    """DistServe's fitted OPT-13B step times on one A100 (as ``test_simulation``)."""
    c = TpCoefficients((18.10254647486372, 0.1019122572698738, 7.122264314252114e-06),
                       (19.934702624895458, 0.0006269356524350583, 0.03850697740828398),
                       (7.1661889468253595, 0.0005798000403396046, 0.15831096191764046), 95)
    return FittedLatencyModel(MODEL, {1: c}, hardware="a100-80g")


# The flood alone needs more decode capacity than one prefill + two decode instances have: queues
# build up for the whole run (~300 simulated seconds).
RATE, NUM_REQUESTS = 7.0, 1200


def run(policy: str, requests: list[Request], prefill: SchedulerConfig = SchedulerConfig(), **admission: object) -> SimResult:
    config = SimConfig(admission=AdmissionConfig(policy, **admission), prefill_scheduler=prefill)  # type: ignore[arg-type]
    return simulate(Placement.disaggregated(1, 2), opt13b(), requests, config)


def light_p99_ttft(res: SimResult) -> float:
    return max(row["ttft_p99_s"] for t, row in res.per_tenant().items() if t != FLOOD_TENANT)  # type: ignore[type-var]


def output_tokens_per_s(res: SimResult) -> float:
    return sum(r.num_output_tokens for r in res.records) / res.duration_s


def test_fair_admission_protects_light_tenants_from_a_flood() -> None:
    requests = flood_workload(RATE, NUM_REQUESTS, max_total_len=2048)
    fcfs, fair = run("fcfs", requests), run("fair", requests)
    # FCFS: the light tenants' chats queue behind the flood's backlog (P99 ~23 s); fair: ~0.34 s.
    assert light_p99_ttft(fcfs) > 40 * light_p99_ttft(fair)
    # Issue 17's throughput target (< 5% off fcfs): the end of this overloaded run moves by up to ~4%
    # either way with the order of the decode instances' KV preemptions (seeds 0-2: 0.96-1.02x).
    assert output_tokens_per_s(fair) == pytest.approx(output_tokens_per_s(fcfs), rel=0.05)
    # The flood pays for it: the wait the light tenants no longer have is the flood's (conservation:
    # with the flood backlogged for the whole run, its median TTFT grows ~20%), and no more — the
    # requests' total TTFT is lower than under fcfs.
    flood = {name: res.per_tenant()[FLOOD_TENANT]["ttft_p50_s"] for name, res in (("fcfs", fcfs), ("fair", fair))}
    assert flood["fcfs"] < flood["fair"] < 1.25 * flood["fcfs"]  # type: ignore[operator]
    assert sum(r.ttft_s for r in fair.records) < sum(r.ttft_s for r in fcfs.records)  # type: ignore[misc]
    summary = fair.summary(SLO_SPEC)
    assert set(summary["tenants"]) == {FLOOD_TENANT, "light-0", "light-1", "light-2"}  # type: ignore[arg-type]
    assert summary["admission"]["policy"] == "fair"  # type: ignore[index]
    assert all(r.admission_wait_s is not None and r.completed for r in fair.records)


def test_light_tenants_keep_their_ttft_alone_under_a_flood() -> None:
    """Issue 17's bound: the light tenants' P99 TTFT under ``fair`` within 1.5x of theirs alone, at
    fcfs's throughput. Each light request goes first twice over: in the admission queue (a sparse
    tenant) and in the prefill scheduler, before the flood's prompts waiting there and, with chunked
    prefill, before the remaining chunks of the one under way; token backpressure keeps about one
    step of the flood's prompts on the instance. What is left is the step under way when it arrives
    and its own chunks' steps, full of flood tokens: at most ~72 ms each with a 512-token budget."""
    requests = flood_workload(RATE, NUM_REQUESTS, max_total_len=2048)
    light = [r for r in requests if r.tenant != FLOOD_TENANT]
    chunked = SchedulerConfig(enable_chunked_prefill=True, max_num_batched_tokens=512)
    alone = light_p99_ttft(run("fair", light, chunked))
    fair, fcfs = run("fair", requests, chunked), run("fcfs", requests, chunked)
    assert light_p99_ttft(fair) < 1.3 * alone  # measured 1.23x (0.192 s vs 0.148 s); fcfs: 370x
    assert output_tokens_per_s(fair) > 0.97 * output_tokens_per_s(fcfs)
    # Whole prompts per step (the default): the flood's plan under way when a light request arrives
    # yields at its next layer (``simulator.layer_preemption``): 1.15x. Without layer preemption the
    # light request waits for that plan, up to 2048 tokens of flood prompts (~0.26 s): 2.6x; TNG's
    # count rule also holds it in the admission queue while 3 requests wait on the instance: 4x.
    default_alone = light_p99_ttft(run("fair", light))
    assert light_p99_ttft(run("fair", requests)) < 1.3 * default_alone
    whole = SchedulerConfig(layer_preemption=False)
    whole_alone = light_p99_ttft(run("fair", light, whole))
    by_tokens, by_requests = light_p99_ttft(run("fair", requests, whole)), light_p99_ttft(run("fair", requests, whole, waiting_unit="requests"))
    assert by_tokens < 2.8 * whole_alone < by_requests


def test_flood_workload_shape() -> None:
    requests = flood_workload(13.0, 1300, num_light=3, factor=10, seed=1)
    counts = {t: sum(r.tenant == t for r in requests) for t in {r.tenant for r in requests}}
    assert counts[FLOOD_TENANT] == 1000 and all(counts[f"light-{i}"] == 100 for i in range(3))
    assert [r.req_id for r in requests] == list(range(len(requests)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(requests, requests[1:]))
    mean = {t: sum(r.prompt_len for r in requests if r.tenant == t) / counts[t] for t in counts}
    assert mean[FLOOD_TENANT] > 5 * mean["light-0"]  # long prompts
    assert parse_flood_spec("flood") == (3, 10.0) and parse_flood_spec("flood:2:4") == (2, 4.0)
    with pytest.raises(InvalidConfigError, match="flood"):
        parse_flood_spec("flood:x")


def test_bounds_and_deadlines_in_the_simulator() -> None:
    burst = [Request(i, 0.0, 1500, 50, tenant="a", timeout_s=0.5 if i % 2 else None) for i in range(20)]
    cfg = SimConfig(admission=AdmissionConfig(tenants=(TenantSpec("a", max_queued_requests=10),)))
    res = simulate(Placement.disaggregated(1, 1), opt13b(), burst, cfg)
    dropped = [r.dropped for r in res.records]
    assert dropped.count("rejected") == 10  # the queue held 10; the instant's dispatch came after every arrival
    assert dropped.count("expired") > 0
    assert all(r.completed for r in res.records if r.dropped is None)
    expired_waits = [r.admission_wait_s for r in res.records if r.dropped == "expired"]
    assert all(w is not None and w >= 0.5 for w in expired_waits)
    assert res.admission["tenants"]["a"]["num_rejected_full"] == 10  # type: ignore[index]


def test_trace_tenant_fields_round_trip_and_are_validated(tmp_path: Path) -> None:
    reqs = [Request(0, 0.0, 10, 5, tenant="acme", tier="batch", priority=-2, timeout_s=3.0), Request(1, 1.0, 10, 5)]
    path = tmp_path / "t.jsonl"
    write_trace(path, reqs)
    assert load_trace(path) == reqs
    for line, field in ((b'"tier": "gold"', "tier"), (b'"tenant": ""', "tenant"), (b'"priority": 1.5', "priority"),
                        (b'"timeout": -1', "timeout")):
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(b'{"arrival_s": 0, "prompt_len": 3, "output_len": 2}\n{"arrival_s": 1, "prompt_len": 3, "output_len": 2, '
                        + line + b"}\n")
        with pytest.raises(InvalidConfigError, match=f"bad.jsonl:2: .*{field}") as info:
            load_trace(bad)
        assert info.value.param == field


def test_simulate_cli_prints_per_tenant_figures(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # rich fits tables to the terminal
    base = ["simulate", "--model", MODEL, "--hardware", "a100-80g", "--ttft", "1", "--tpot", "0.1", "--prefill", "1", "--decode", "1",
            "--workload", "flood:2:5", "--rate", "2", "--num-requests", "70"]
    assert main([*base, "--admission-policy", "fcfs", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["result"]["tenants"]) == {"flood", "light-0", "light-1"}
    assert out["result"]["admission"]["policy"] == "fcfs"
    assert main(base) == 0
    text = capsys.readouterr().out
    assert "per tenant" in text and "light-1" in text
