"""KV migration between simulated instances (a mixin of ``Simulation``).

Finished prefills wait, KV held, in one FCFS queue (``MigrationQueue``: nobody overtakes a request
waiting for room; class pools queue in lanes of their own) until a decode instance, fewest assigned
first (``decode_order``), can ``reserve`` room for them — pull-based, as in the runtime. The KV then
moves over the link in the latency model's time, one transfer at a time per sender and per receiver
(each worker has one transfer thread); when it arrives the decode instance takes the request and
the prefill instance frees its copy.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from mypy_extensions import mypyc_attr

from distserve.cluster.counters import ClusterCounters
from distserve.cluster.migration_queue import MigrationQueue
from distserve.cluster.routing import decode_order
from distserve.engine.sequence import Sequence
from simulator.latency import LatencyModel
from simulator.sim_config import SimConfig
from simulator.sim_events import MIGRATE, MIGRATED
from simulator.sim_instance import SimInstance, route_of
from simulator.sim_records import SimRecords

if TYPE_CHECKING:
    from simulator.metrics import RequestRecord

Pending = tuple[SimInstance, Sequence, Sequence]  # (prefill instance, its sequence, the copy a decode instance reserves for)


@mypyc_attr(allow_interpreted_subclasses=True)
class SimMigrations(SimRecords):
    """``Simulation``'s migrations: the attributes below are ``Simulation``'s."""

    pending: MigrationQueue[Pending]
    decodes: list[SimInstance]
    lane_of: Callable[[Pending], object] | None
    config: SimConfig
    latency: LatencyModel
    kv_bytes_per_token: int
    counters: ClusterCounters
    records: dict[str, RequestRecord]
    on_migration: Callable[[str, str, str], None] | None
    _events: list[tuple[float, int, int, object]]
    _seq_no: itertools.count[int]
    _migrate_at: float
    _no_room: set[str]  # the waiting prefills that found no room when last offered
    _admission_stale: bool

    def _launch_at_end(self, inst: SimInstance) -> None: ...  # Simulation's

    def _queue_migrate(self, now: float) -> None:
        """Migrate the waiting prefills once every step ending at ``now`` is applied (room freed)."""
        if self._migrate_at != now:
            self._migrate_at = now
            heapq.heappush(self._events, (now, MIGRATE, next(self._seq_no), None))

    def _migrate_pending(self, now: float) -> None:
        """Oldest first; nobody overtakes a request waiting for room (``MigrationQueue``)."""
        self.pending.drain(lambda entry: self._migrate(entry, now), self.lane_of)

    def _migrate(self, entry: Pending, now: float) -> bool:
        src, seq, copy = entry
        # A prefill that found no room is offered again at every step's end, mostly to no avail: where
        # no decode instance has room, every ``reserve`` below says no and changes nothing.
        if seq.seq_id in self._no_room and not any(
                copy.seq_id not in dst.core.seqs and dst.core.decode.can_reserve(copy) for dst in self.decodes):
            return False
        for dst in decode_order(self.decodes, route_of, seq.request_class, self.config.decode_scheduler.latency_max_num_seqs):
            reservation = dst.core.reserve(copy)
            if reservation is not None:
                break
        else:
            self._no_room.add(seq.seq_id)
            return False
        self._no_room.discard(seq.seq_id)
        self.records[seq.seq_id].num_preemptions += seq.num_preemptions
        dst.route.assign(seq.seq_id, seq.request_class)
        num_bytes = reservation.num_blocks_to_transfer * self.config.block_size * self.kv_bytes_per_token
        same_node = src.spec.node is None or dst.spec.node is None or src.spec.node == dst.spec.node
        duration = self.latency.migration_time(num_bytes, same_node, min(src.tp, dst.tp)) + self.config.migration_overhead_s
        start = max(now, src.tx_free, dst.rx_free)
        end = start + duration
        src.tx_free = dst.rx_free = end
        dst.rx_ends.append(end)
        self.counters.record_migration(reservation.num_reused_blocks, reservation.num_blocks_to_transfer, num_bytes)
        self.counters.record_migration_duration(duration)  # known now: the link model decides it
        heapq.heappush(self._events, (end, MIGRATED, next(self._seq_no), (src, dst, seq.seq_id)))
        return True

    def _migrated(self, src: SimInstance, dst: SimInstance, seq_id: str, now: float) -> None:
        """A transfer arrived: the decode instance takes the request, the prefill instance frees it."""
        dst.rx_ends.popleft()
        self._admission_stale = True  # the entry (prefill) instance changed
        src.last_load = None
        src.core.release(seq_id)
        src.route.release(seq_id)
        dst.core.complete(seq_id)
        if self.on_migration is not None:
            self.on_migration(seq_id, src.instance_id, dst.instance_id)
        self._launch_at_end(src)
        self._launch_at_end(dst)
        if self.pending:
            self._queue_migrate(now)
