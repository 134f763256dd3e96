"""What a cluster counts: KV migrations and recovery events, one type for every driver.

The Ray controller, the in-process ``LocalDisaggEngine`` and the simulator each hold one
``ClusterCounters`` and record into it where they act; ``as_stats`` / ``migration_stats`` give the
keys of ``distserve.runtime.stats.ClientStats``. Drivers differ in *when* they learn a figure, not
in what it means: the Ray runtime records a migration when it starts the transfer and the bytes
as the decode side reports them arrived; the in-process engine and the simulator know both at
once. A migration that fails is counted by ``record_failed_migration``; the Ray runtime had
already counted its start (``num_migrations`` includes the attempts that failed there), while
in-process a failure is injected before any transfer starts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Migration durations kept between drains (a /metrics scrape drains them): a server nobody scrapes keeps
# only the newest, rather than one float per migration for ever (issue 20's soak).
MAX_UNDRAINED_DURATIONS = 10_000


@dataclass
class ClusterCounters:
    """Cumulative since the driver started, except ``migration_durations_s`` (the newest
    ``MAX_UNDRAINED_DURATIONS`` since the last drain)."""

    num_migrations: int = 0  # migrations started
    num_blocks_migrated: int = 0  # KV blocks to send, of the migrations started
    num_blocks_skipped: int = 0  # prefix blocks the receiver already held, so not sent
    num_bytes_migrated: int = 0  # KV bytes that arrived
    num_failed_migrations: int = 0  # failed or timed out: the request was prefilled again
    num_timed_out_migrations: int = 0  # of those, the ones that timed out
    num_instance_restarts: int = 0  # instances replaced after a death
    num_requests_rerun: int = 0  # re-run from prompt + tokens so far after their instance died
    num_requests_failed_poison: int = 0  # failed for a second death of the instance computing them
    migration_s: float = 0.0  # total duration of the migrations that completed
    migration_durations_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_UNDRAINED_DURATIONS))

    def record_migration(self, num_blocks_skipped: int, num_blocks: int = 0, num_bytes: int = 0) -> None:
        """A migration started: ``num_blocks`` blocks (``num_bytes`` bytes, when known now) to send,
        ``num_blocks_skipped`` prefix blocks the receiver already held."""
        self.num_migrations += 1
        self.num_blocks_skipped += num_blocks_skipped
        self.num_blocks_migrated += num_blocks
        self.num_bytes_migrated += num_bytes

    def record_bytes_migrated(self, num_bytes: int) -> None:
        """KV bytes that arrived, for a driver that learns them only as transfers complete."""
        self.num_bytes_migrated += num_bytes

    def record_migration_duration(self, seconds: float) -> None:
        """A migration completed after ``seconds``."""
        self.migration_s += seconds
        self.migration_durations_s.append(seconds)

    def record_failed_migration(self, timed_out: bool) -> None:
        """A migration failed (``timed_out``: it did not complete in time); the request is prefilled again."""
        self.num_failed_migrations += 1
        self.num_timed_out_migrations += int(timed_out)

    def record_instance_restart(self) -> None:
        self.num_instance_restarts += 1

    def record_request_rerun(self) -> None:
        """A request of a dead instance is re-run from its prompt + tokens so far."""
        self.num_requests_rerun += 1

    def record_request_failed_poison(self) -> None:
        """A request was blamed for a second death of its instance and failed instead of being re-run."""
        self.num_requests_failed_poison += 1

    def drain_migration_durations(self) -> list[float]:
        """The durations recorded since the previous drain (the Ray runtime reports each once)."""
        durations = list(self.migration_durations_s)
        self.migration_durations_s.clear()
        return durations

    def migration_stats(self) -> dict[str, int]:
        """The cumulative KV migration figures every runtime reports (``ClientStats`` keys)."""
        return {
            "kv_migration_blocks_skipped_total": self.num_blocks_skipped,
            "kv_migration_bytes_total": self.num_bytes_migrated,
            "kv_migration_failures_total": self.num_failed_migrations,
            "kv_migration_timeouts_total": self.num_timed_out_migrations,
        }

    def as_stats(self) -> dict[str, int]:
        """All the cumulative counts, keyed as the Ray runtime's ``stats()`` reports them."""
        return {
            "num_migrations": self.num_migrations,
            **self.migration_stats(),
            "instance_restarts_total": self.num_instance_restarts,
            "requests_rerun_total": self.num_requests_rerun,
            "requests_failed_poison_total": self.num_requests_failed_poison,
        }
