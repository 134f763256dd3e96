"""The cluster's counters: what each record means, the stats keys they produce, and a driver using them."""

from __future__ import annotations

from distserve.cluster.counters import MAX_UNDRAINED_DURATIONS, ClusterCounters
from distserve.config import CacheConfig, SamplingParams
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.runtime.stats import PREFILL_COUNTER_KEYS, ClientStats, normalize_stats

# The counters the Ray runtime's ``stats()`` reports, in its order (tests and the HTTP metrics read them).
RUNTIME_KEYS = [
    "num_migrations",
    "kv_migration_blocks_skipped_total",
    "kv_migration_bytes_total",
    "kv_migration_failures_total",
    "kv_migration_timeouts_total",
    "instance_restarts_total",
    "requests_rerun_total",
    "requests_failed_poison_total",
]


def test_records_add_up() -> None:
    c = ClusterCounters()
    c.record_migration(num_blocks_skipped=3, num_blocks=5, num_bytes=500)
    c.record_migration(num_blocks_skipped=0)  # a runtime that learns the bytes on arrival
    c.record_bytes_migrated(200)
    c.record_failed_migration(timed_out=True)
    c.record_failed_migration(timed_out=False)
    c.record_instance_restart()
    c.record_request_rerun()
    c.record_request_rerun()
    c.record_request_failed_poison()
    assert (c.num_migrations, c.num_blocks_skipped, c.num_blocks_migrated, c.num_bytes_migrated) == (2, 3, 5, 700)
    assert (c.num_failed_migrations, c.num_timed_out_migrations) == (2, 1)
    assert (c.num_instance_restarts, c.num_requests_rerun, c.num_requests_failed_poison) == (1, 2, 1)
    assert c.as_stats() == {
        "num_migrations": 2,
        "kv_migration_blocks_skipped_total": 3,
        "kv_migration_bytes_total": 700,
        "kv_migration_failures_total": 2,
        "kv_migration_timeouts_total": 1,
        "instance_restarts_total": 1,
        "requests_rerun_total": 2,
        "requests_failed_poison_total": 1,
    }


def test_draining_durations_keeps_the_total() -> None:
    c = ClusterCounters()
    c.record_migration_duration(0.25)
    c.record_migration_duration(0.5)
    assert c.drain_migration_durations() == [0.25, 0.5]
    assert c.drain_migration_durations() == []  # each duration is reported once
    c.record_migration_duration(1.0)
    assert list(c.migration_durations_s) == [1.0] and c.migration_s == 1.75


def test_stats_keys_are_the_runtimes() -> None:
    c = ClusterCounters()
    assert list(c.as_stats()) == RUNTIME_KEYS
    assert set(c.migration_stats()) < set(RUNTIME_KEYS)
    assert set(RUNTIME_KEYS) - {"num_migrations"} <= set(ClientStats.__annotations__)
    c.record_migration(num_blocks_skipped=2, num_bytes=64)
    c.record_failed_migration(timed_out=True)
    c.record_request_rerun()
    normalized = normalize_stats({"instances": [], "kv_migration_seconds": c.drain_migration_durations(), **c.as_stats()})
    for key, value in c.as_stats().items():
        if key != "num_migrations":
            assert normalized[key] == float(value), key  # type: ignore[literal-required]


def test_local_engine_counts_into_its_counters() -> None:
    engine = LocalDisaggEngine("tiny", cache_config=CacheConfig(num_blocks=128, block_size=4))
    sp = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    shared = "System: you are a helpful assistant. " * 2
    engine.generate([shared + "Q: hi"], sp)
    engine.inject_transfer_fault("drop_send")  # the next migration fails and the request is prefilled again
    engine.generate([shared + "Q: bye"], sp)
    c = engine.counters
    assert (c.num_migrations, c.num_failed_migrations, c.num_timed_out_migrations) == (2, 1, 1)
    assert c.num_blocks_skipped > 0 and c.num_blocks_migrated > 0 and c.num_bytes_migrated > 0
    assert len(c.migration_durations_s) == 2 and c.migration_s == sum(c.migration_durations_s)
    stats = engine.stats()
    assert list(stats) == [
        "prefill", "decode", "kv_migration_blocks_total", "kv_migration_seconds_total", "kv_migration_blocks_skipped_total",
        "kv_migration_bytes_total", "kv_migration_failures_total", "kv_migration_timeouts_total", "num_requests_awaiting_migration",
        *PREFILL_COUNTER_KEYS,
    ]
    assert stats["kv_migration_blocks_total"] == c.num_blocks_migrated and stats["kv_migration_bytes_total"] == c.num_bytes_migrated
    assert stats["kv_migration_failures_total"] == 1 and stats["kv_migration_timeouts_total"] == 1


def test_undrained_migration_durations_are_bounded() -> None:
    """Issue 20 (soak): a server whose /metrics nobody scrapes keeps the newest durations, not every one for ever."""
    c = ClusterCounters()
    for i in range(MAX_UNDRAINED_DURATIONS + 5):
        c.record_migration_duration(float(i))
    assert len(c.migration_durations_s) == MAX_UNDRAINED_DURATIONS and c.migration_durations_s[0] == 5.0
    assert c.drain_migration_durations()[-1] == MAX_UNDRAINED_DURATIONS + 4 and not c.drain_migration_durations()
