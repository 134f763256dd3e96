"""The controller's KV migrations: moving prefilled requests to decode instances (pull-based, FCFS).

A request whose prefill produced its first token waits (KV held on the prefill side) in the
migration queue (``cluster.migration_queue``) until a decode instance — tried in the one order of
``cluster.routing.decode_order`` — ``reserve``s room for it; then both sides post the transfer.
The decode side reports when the KV arrived, and only then is the prefill side told to
``release`` its blocks (``Controller._apply``). A transfer that fails or does not complete within
``kv_transfer_timeout_s`` is decided by the decode side (it cancels its reservation): the prefill
side prefills the request again (its prefix is cached) and it migrates anew. With class pools
(``InstanceSpec.pool``) each pool's requests wait in a lane of their own (``routing.decode_lane``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING

from distserve.cluster.counters import ClusterCounters
from distserve.cluster.migration_queue import MigrationQueue
from distserve.cluster.routing import decode_lane, decode_order
from distserve.config import SchedulerConfig
from distserve.engine.sequence import Sequence
from distserve.kvtransfer.plan import MAX_TAG, num_tags
from distserve.runtime.ray_deployment import DeployedInstance, route_of

log = logging.getLogger(__name__)


class KVMigrations:
    """The ``Controller``'s migration half (a mixin: it works on the controller's request state)."""

    instances: list[DeployedInstance]
    scheduler_config: SchedulerConfig  # the decode instances' (``RequestFrontend``)
    counters: ClusterCounters
    _seqs: dict[str, Sequence]
    _owner: dict[str, DeployedInstance]
    _source: dict[str, DeployedInstance]
    _pins: dict[str, tuple[str | None, str | None]]
    _pending: MigrationQueue[tuple[DeployedInstance, str]]
    _migration_lock: asyncio.Lock
    _migration_started: dict[str, float]
    _tags: itertools.count[int]

    if TYPE_CHECKING:  # the Controller's, which this half calls
        def _spawn(self, coro: object, name: str | None = None) -> None: ...
        async def _call_then_kick(self, inst: DeployedInstance, ref: object) -> None: ...

    async def _migrate_pending(self) -> None:
        """Move waiting requests to decode instances with room, oldest first (pull-based)."""
        async def move(entry: tuple[DeployedInstance, str]) -> bool:
            src, seq_id = entry
            seq = self._seqs.get(seq_id)
            if seq is None or seq.is_finished or not src.alive:
                return True  # finished, or its instance died: no longer waiting
            return await self._migrate(src, seq)

        pools = {i.route.pool for i in self.instances if i.phase == "decode"}

        def lane(entry: tuple[DeployedInstance, str]) -> object:
            seq = self._seqs.get(entry[1])
            return decode_lane(seq.request_class if seq is not None else None, pools)

        async with self._migration_lock:
            await self._pending.drain_async(move, lane if pools != {None} else None)

    async def _migrate(self, src: DeployedInstance, seq: Sequence) -> bool:
        decodes = [i for i in self.instances if i.alive and i.phase == "decode"]
        pinned = self._pins.get(seq.seq_id, (None, None))[1]
        decodes = [i for i in decodes if i.spec.instance_id == pinned] or decodes
        if not decodes:
            return False
        import ray

        for dst in decode_order(decodes, route_of, seq.request_class, self.scheduler_config.latency_max_num_seqs):
            try:
                reservation = await dst.actor.reserve.remote(seq.detached_copy())
            except ray.exceptions.RayError:
                dst.kick()  # died: its step loop finds out at its next step and handles that
                continue
            if reservation is not None:
                break
        else:
            return False
        if not (dst.alive and src.alive and self._owner.get(seq.seq_id) is src and not seq.is_finished):
            # An instance died (and its requests were re-run) or the request ended while we waited.
            if dst.alive:
                dst.actor.cancel_reservation.remote(seq.seq_id)
                dst.kick()
            return not (src.alive and self._owner.get(seq.seq_id) is src and not seq.is_finished)
        assert src.layout is not None and dst.layout is not None
        span = num_tags(src.layout, dst.layout)
        tag = 1 + (next(self._tags) * span) % (MAX_TAG - span - 1)
        self._migration_started[seq.seq_id] = time.monotonic()
        self._owner[seq.seq_id] = dst
        self._source[seq.seq_id] = src
        dst.route.assign(seq.seq_id, seq.request_class)
        first, end = reservation.num_reused_blocks, reservation.num_blocks_to_fill
        self.counters.record_migration(num_blocks_skipped=first, num_blocks=end - first)
        try:
            await asyncio.gather(
                src.actor.start_send.remote(seq.seq_id, first, end, dst.layout, dst.spec.global_ranks, tag),
                dst.actor.start_recv.remote(seq.seq_id, reservation, src.layout, src.spec.global_ranks, tag),
            )
        except ray.exceptions.RayError as exc:
            # One side died: the attempt is handed over (``_on_death`` re-runs the request); or a
            # side refused, e.g. the request was requeued meanwhile: the other side gives up on its
            # deadline and the attempt fails like any other.
            log.warning("starting the migration of %s failed: %s", seq.seq_id, type(exc).__name__)
        dst.kick()
        src.kick()
        return True

    def _on_failed_transfer(self, seq_id: str, timed_out: bool) -> None:
        """The decode side gave up (and freed its reservation): re-prefill where the KV still is.

        The prefill instance keeps the request's first token, so the client sees no duplicate, and
        its prefix is cached, so the re-prefill is cheap; the request then migrates anew.
        """
        self.counters.record_failed_migration(timed_out)
        src = self._source.pop(seq_id, None)
        dst = self._owner.pop(seq_id, None)
        if dst is not None:
            dst.route.release(seq_id)
        self._migration_started.pop(seq_id, None)
        if src is not None and src.alive:
            self._owner[seq_id] = src
            self._spawn(self._call_then_kick(src, src.actor.requeue.remote(seq_id)))
