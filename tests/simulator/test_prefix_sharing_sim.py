"""In-flight prefix sharing in the simulator: it runs the real admission rule, so siblings arriving
together compute their shared prefix once there too, and its result counts the tokens."""

from __future__ import annotations

import pytest

from distserve.cluster.admission import AT_ONCE
from distserve.config import SchedulerConfig
from distserve.placement import Placement
from simulator.latency import FittedLatencyModel
from simulator.profiles import TpCoefficients
from simulator.simulation import SimConfig, simulate
from simulator.workload import Request

BS = 16
PREFIX = tuple(range(1000, 1000 + 4 * BS))  # 4 full blocks
SUFFIX_LENS = [5, 9, 13, 17, 21, 25]
NUM_UNSHARED = sum(SUFFIX_LENS)


def constant_model(prefill_ms: float, decode_ms: float) -> FittedLatencyModel:
    coeffs = TpCoefficients(prefill=(prefill_ms, 0.0, 0.0), decode_small=(decode_ms, 0.0, 0.0), decode_large=(decode_ms, 0.0, 0.0), decode_threshold=95)
    return FittedLatencyModel("facebook/opt-13b", {1: coeffs}, hardware="a100-80g")


def siblings() -> list[Request]:
    out = []
    for i, n in enumerate(SUFFIX_LENS):
        prompt = PREFIX + tuple(5000 + 100 * i + j for j in range(n))
        out.append(Request(i, 0.0, len(prompt), 4, prompt_token_ids=prompt))
    return out


@pytest.mark.parametrize("placement", [Placement.disaggregated(1, 1), Placement.colocated_instances(1)], ids=["disagg", "colocated"])
@pytest.mark.parametrize("share", [True, False], ids=["sharing", "no-sharing"])
def test_siblings_arriving_together_compute_the_prefix_once(placement: Placement, share: bool) -> None:
    sched = SchedulerConfig(enable_inflight_prefix_sharing=share)
    # No backpressure: the siblings reach the scheduler together (with it, later ones find the prefix cached).
    config = SimConfig(block_size=BS, num_blocks=256, enable_prefix_caching=True, scheduler=sched, prefill_scheduler=sched, decode_scheduler=sched,
                       admission=AT_ONCE)
    result = simulate(placement, constant_model(50.0, 5.0), siblings(), config)
    assert all(r.completed for r in result.records)
    if share:
        expected = (len(PREFIX) + NUM_UNSHARED, 5 * len(PREFIX))
    else:
        expected = (6 * len(PREFIX) + NUM_UNSHARED, 0)
    assert (result.num_prefill_tokens_computed, result.num_prefix_cache_hit_tokens) == expected
    summary = result.summary()
    assert (summary["prefill_tokens_computed_total"], summary["prefix_cache_hit_tokens_total"]) == expected
    entry = "prefill0" if placement.prefill else "colocated0"
    assert result.instances[entry]["prefill_tokens_computed"] == expected[0]


def test_siblings_migrating_together_receive_the_shared_prefix_once() -> None:
    """Transfers slower than a prefill step: the siblings' reservations on the decode instance come
    while the first one's prompt KV is still arriving. With sharing they wait for it (the decode
    scheduler's held reservation) and receive only their own blocks; without, each receives all."""
    moved = {}
    for share in (True, False):
        sched = SchedulerConfig(enable_inflight_prefix_sharing=share)
        config = SimConfig(block_size=BS, num_blocks=256, enable_prefix_caching=True, scheduler=sched,
                           prefill_scheduler=sched, decode_scheduler=sched, migration_overhead_s=0.2)
        result = simulate(Placement.disaggregated(1, 1), constant_model(50.0, 5.0), siblings(), config)
        assert all(r.completed for r in result.records) and result.num_migrations == len(SUFFIX_LENS)
        moved[share] = result.migration_bytes
    all_blocks = sum(-(-(len(PREFIX) + n) // BS) for n in SUFFIX_LENS)  # the prompt's KV of every sibling
    shared_blocks = (len(SUFFIX_LENS) - 1) * (len(PREFIX) // BS)  # the prefix, received once instead of six times
    assert moved[True] * all_blocks == moved[False] * (all_blocks - shared_blocks)
