"""The one SLO type and the shared latency definitions: the load generator's and the simulator's records agree."""

from __future__ import annotations

import math

import pytest

from distserve.errors import InvalidConfigError
from distserve.measure.stream_client import RequestResult
from distserve.slo import SLO, SLOSpec, attainment, latency_summary, max_misses, meets
from simulator.metrics import RequestRecord


def _pair(start: float, first: float | None, finish: float | None, n: int) -> tuple[RequestResult, RequestRecord]:
    """The same request as the load generator and the simulator record it (last token = finish)."""
    client = RequestResult(0, start, 8, sent_s=start, first_token_s=first, last_token_s=finish, finish_s=finish,
                           num_output_tokens=n)
    sim = RequestRecord(0, start, 8, n, first_token_s=first, finish_s=finish, num_output_tokens=n)
    return client, sim


def test_both_records_define_latencies_the_same_way() -> None:
    for r in _pair(1.0, 1.5, 2.5, 11):
        assert r.ttft_s == pytest.approx(0.5)  # from the send / arrival
        assert r.tpot_s == pytest.approx(0.1)  # (last - first) / (n - 1)
        assert r.e2e_s == pytest.approx(1.5)
    for r in _pair(1.0, 1.5, 1.5, 1):
        assert r.tpot_s is None and r.meets(SLO(1.0, 1e-9))  # one token: meets any TPOT SLO
    for r in _pair(1.0, None, None, 0):
        assert r.ttft_s is None and r.e2e_s is None and not r.meets(SLO())  # never completed: a miss


def test_failed_request_is_a_miss_even_with_good_timings() -> None:
    failed = RequestResult(0, 0.0, 8, sent_s=0.0, first_token_s=0.1, last_token_s=0.2, finish_s=0.2,
                           num_output_tokens=3, error="stream error: boom")
    assert not failed.meets_ttft(SLO()) and not failed.meets_tpot(SLO())


def test_attainment_and_summary_over_both_record_types() -> None:
    timings = [(0.0, 0.1, 1.1, 11), (1.0, 1.5, 2.5, 11), (2.0, 2.1, 4.1, 11), (3.0, 3.2, 3.2, 1), (4.0, None, None, 0)]
    slo = SLO(ttft_s=0.3, tpot_s=0.15)
    client, sim = zip(*(_pair(*t) for t in timings))
    for records in (client, sim):
        assert attainment(records, slo) == pytest.approx({"ttft": 3 / 5, "tpot": 3 / 5, "joint": 2 / 5})
        lat = latency_summary(records)
        assert lat["ttft_p50_s"] == pytest.approx(0.15)  # 0.1, 0.1, 0.2, 0.5 (the open request has none)
        assert lat["tpot_mean_s"] == pytest.approx(0.4 / 3)  # 0.1, 0.1, 0.2: the one-token answer has no TPOT
    assert latency_summary(client[4:])["ttft_p90_s"] != latency_summary(client[4:])["ttft_p90_s"]  # nan
    assert latency_summary(client[4:], with_mean=False, empty=None) == {f"{k}_p{q}_s": None for k in ("ttft", "tpot", "e2e")
                                                                        for q in (50, 90, 99)}
    with pytest.raises(InvalidConfigError, match="no requests"):
        attainment([], slo)


def test_spec_classes_and_modes() -> None:
    spec = SLOSpec(SLO(1.0, 1.0, attainment=0.5), classes={"tight": SLO(0.01, 1.0)})
    loose = RequestRecord(0, 0.0, 8, 2, first_token_s=0.1, finish_s=0.2, num_output_tokens=2)
    tight = RequestRecord(1, 0.0, 8, 2, slo_class="tight", first_token_s=0.1, finish_s=0.2, num_output_tokens=2)
    assert attainment([loose, tight], spec) == {"ttft": 0.5, "tpot": 1.0, "joint": 0.5}
    with pytest.raises(InvalidConfigError, match="not defined"):
        attainment([RequestRecord(2, 0.0, 8, 2, slo_class="nope")], spec)
    assert meets({"ttft": 0.5, "tpot": 1.0, "joint": 0.5}, spec)
    separate = SLOSpec(SLO(1.0, 1.0, attainment=0.6), mode="separate")
    assert meets({"ttft": 0.7, "tpot": 0.6, "joint": 0.4}, separate)
    assert not meets({"ttft": 0.7, "tpot": 0.5, "joint": 0.5}, separate)
    with pytest.raises(InvalidConfigError, match="attainment mode"):
        SLOSpec(SLO(), mode="both")
    assert [max_misses(n, 0.9) for n in (1, 9, 10, 40, 41)] == [0, 0, 1, 4, 4]


@pytest.mark.parametrize("kwargs", [dict(ttft_s=0.0), dict(tpot_s=-1.0), dict(ttft_s=math.nan), dict(attainment=0.0),
                                    dict(attainment=1.5)])
def test_bad_slo_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidConfigError):
        SLO(**kwargs)


def test_infinite_targets_are_not_checked() -> None:
    slow = RequestRecord(0, 0.0, 8, 3, first_token_s=100.0, finish_s=300.0, num_output_tokens=3)
    assert slow.meets(SLO()) and not slow.meets(SLO(ttft_s=200.0, tpot_s=99.0))
