"""Per-request phase timestamps and the latency breakdown (queueing, prefill, migration, decode) of the
in-process runtimes: the timestamps come in phase order, the breakdown adds up to the end-to-end latency,
and only the disaggregated engine has a migration."""

from __future__ import annotations

import time

import pytest

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.frontend import EngineBase
from distserve.engine.outputs import RequestOutput
from distserve.engine.request_metrics import LatencyBreakdown, RequestMetrics, latency_breakdown
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.local_disagg import LocalDisaggEngine

CACHE = CacheConfig(num_blocks=256, block_size=4)
SP = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, ignore_eos=True)
# One prompt per prefill step, so the later requests queue in the instance.
ONE_AT_A_TIME = SchedulerConfig(max_num_seqs=1)
PROMPTS = [[3 + (7 * i + k) % 200 for k in range(24 + 8 * i)] for i in range(4)]
TOLERANCE_S = 1e-3


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def run(engine: EngineBase) -> tuple[list[RequestOutput], float, float]:
    """All of PROMPTS at once; their final outputs and the wall-clock window around the run."""
    start = time.monotonic()
    outs = engine.generate(PROMPTS, SP)
    return outs, start, time.monotonic()


def check_phases(m: RequestMetrics, window: tuple[float, float], migrated: bool) -> LatencyBreakdown:
    """The timestamps in phase order inside ``window``; the breakdown adds up to E2E within 1 ms."""
    assert m.prefill_start_time is not None and m.first_token_time is not None and m.finish_time is not None
    points = [m.arrival_time, m.dispatch_time or m.arrival_time, m.prefill_start_time, m.first_token_time]
    if migrated:
        assert m.migration_start_time is not None and m.migration_end_time is not None
        points += [m.migration_start_time, m.migration_end_time]
    else:
        assert m.migration_start_time is None and m.migration_end_time is None
    points.append(m.finish_time)
    assert window[0] <= points[0] and points[-1] <= window[1]
    assert points == sorted(points), points
    bd = m.breakdown
    assert bd is not None and m.e2e_s is not None
    assert abs(bd.total_s - m.e2e_s) <= TOLERANCE_S
    assert bd.prefill_s > 0 and bd.decode_s > 0 and bd.queue_s >= 0
    assert (bd.migration_s is not None) == migrated and (bd.migration_queue_s is not None) == migrated
    return bd


def test_local_disagg_breakdown_adds_up_and_has_a_migration(tiny: LoadedModel) -> None:
    engine = LocalDisaggEngine(tiny, cache_config=CACHE, prefill_scheduler_config=ONE_AT_A_TIME)
    outs, start, end = run(engine)
    bds = [check_phases(o.metrics, (start, end), migrated=True) for o in outs]
    assert all(b.migration_s is not None and b.migration_s > 0 for b in bds)
    # One prompt per prefill step: the last request waited for the other three prefills.
    assert bds[-1].queue_s >= sum(b.prefill_s for b in bds[:-1]) - TOLERANCE_S


def test_colocated_breakdown_adds_up_without_migration(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, cache_config=CACHE, scheduler_config=SchedulerConfig(max_num_seqs=2))
    outs, start, end = run(engine)
    bds = [check_phases(o.metrics, (start, end), migrated=False) for o in outs]
    assert max(b.queue_s for b in bds[2:]) > 0  # two sequences at a time: the others waited for a slot


def test_breakdown_splits_at_the_known_points() -> None:
    m = RequestMetrics(10.0, 10.5, 12.0, 4, 0, 3, dispatch_time=10.1, prefill_start_time=10.2,
                       migration_start_time=10.7, migration_end_time=10.75)
    bd = latency_breakdown(m)
    assert bd is not None
    assert bd.as_dict() == pytest.approx({"queue_s": 0.2, "prefill_s": 0.3, "migration_queue_s": 0.2, "migration_s": 0.05, "decode_s": 1.25})
    assert bd.inference_s == pytest.approx(1.8) and bd.total_s == pytest.approx(2.0)
    # Unknown prefill start: the wait in the instance counts as prefill; no migration: decode from the first token.
    bare = latency_breakdown(RequestMetrics(10.0, 10.5, 12.0, 4, 0, 3, dispatch_time=10.1))
    assert bare == LatencyBreakdown(pytest.approx(0.1), pytest.approx(0.4), None, None, pytest.approx(1.5))  # type: ignore[arg-type]
    # A prefill start read before the dispatch (two clocks of one driver) is taken as the dispatch.
    early = latency_breakdown(RequestMetrics(10.0, 10.5, 12.0, 4, 0, 3, dispatch_time=10.1, prefill_start_time=10.05))
    assert early is not None and early.queue_s == pytest.approx(0.1) and early.total_s == pytest.approx(2.0)
    assert latency_breakdown(RequestMetrics(10.0, None, 12.0, 4, 0, 0)) is None  # no first token
    assert latency_breakdown(RequestMetrics(10.0, 10.5, None, 4, 0, 1)) is None  # not finished
