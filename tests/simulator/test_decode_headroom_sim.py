"""Under TPOT backpressure, a disaggregated deployment's prefill side holds only the requests the decode
instances' time per token leaves room for (``cluster.backpressure.decode_headroom``). Simulated past the knee
(OPT-13B 1P1D on A100s, requests shed after 5 s in the admission queue), with the rule at 0.8x a 50 ms TPOT
SLO: the admitted requests meet it; with the headroom switched off (``SimConfig.decode_headroom``; the rule then read only the latest
step, all or nothing) the decode batch outgrew the TPOT and most missed it. Fast-forward changes nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distserve.cluster.admission import AdmissionConfig
from distserve.placement import Placement
from simulator.metrics import SimResult
from simulator.simulation import SimConfig
from test_sim_fast_forward import both, chat

SLO_S, RULE_S = 0.05, 0.04


def met(res: SimResult) -> tuple[int, int]:
    """(completed requests within the TPOT SLO, completed requests)."""
    done = [r for r in res.records if r.completed]
    return sum(1 for r in done if r.num_output_tokens < 2 or (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) <= SLO_S), len(done)


@pytest.mark.parametrize("rate", [10.0, 40.0])
def test_the_admitted_requests_meet_the_tpot_past_the_knee(rate: float) -> None:
    requests = chat(rate, 600, seed=1)
    config = SimConfig(admission=AdmissionConfig("fcfs", tpot_slo_s=RULE_S, max_queue_delay_s=5.0))
    with_headroom, _ = both(Placement.disaggregated(1, 1), requests, config)
    without, _ = both(Placement.disaggregated(1, 1), requests, replace(config, decode_headroom=False))
    (ok, done), (ok_without, done_without) = met(with_headroom), met(without)
    assert any(r.dropped for r in with_headroom.records)  # past the knee: some are shed
    assert ok >= 0.9 * done
    assert ok_without < 0.7 * done_without and ok > ok_without  # more requests within the SLO, not only a higher share
