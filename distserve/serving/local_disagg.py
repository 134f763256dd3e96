"""Disaggregated serving inside one process: xPyD instances, routing and pull-based KV migration.

The Ray runtime runs the same instances as actors; this executor keeps them in-process, which
makes it the reference for correctness tests and the fastest way to try a placement on one core.
One ``step`` runs a prefill step on every prefill instance with work, migrates every request
whose KV a decode instance has room for, then runs a decode step on every busy decode instance.
A failed migration (only ever injected here: the copy is synchronous and cannot time out) takes
the Ray runtime's path: the decode side cancels its reservation and the request is prefilled again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from distserve.config import CacheConfig, SchedulerConfig
from distserve.decode.instance import DecodeInstance
from distserve.engine.model import resolve_dtype
from distserve.engine.outputs import EngineBase, RequestOutput
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import InvalidConfigError
from distserve.kvtransfer.migration import pack_blocks, unpack_blocks
from distserve.prefill.instance import PrefillInstance

# ---- routing policies: pick a prefill instance for a new request ------------------------------
PrefillRouter = Callable[[list[PrefillInstance], Sequence], PrefillInstance]


def _least_loaded(instances: list[PrefillInstance], seq: Sequence) -> PrefillInstance:
    return min(instances, key=lambda inst: (inst.load(), inst.scheduler.num_awaiting_migration))


def _prefix_affinity(instances: list[PrefillInstance], seq: Sequence) -> PrefillInstance:
    """The instance caching most of this prompt's prefix; least loaded among ties."""
    return min(instances, key=lambda inst: (-inst.block_manager.num_cached_prefix_tokens(seq), inst.load()))


PREFILL_ROUTERS: dict[str, PrefillRouter] = {"least_loaded": _least_loaded, "prefix_affinity": _prefix_affinity}


@dataclass
class MigrationCounters:
    num_migrations: int = 0
    num_blocks_sent: int = 0
    num_blocks_skipped: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    durations_s: list[float] = field(default_factory=list)
    num_failures: int = 0
    num_timeouts: int = 0


class LocalDisaggEngine(EngineBase):
    """``num_prefill`` prefill and ``num_decode`` decode instances of one model, all in this process."""

    def __init__(
        self,
        model: str | LoadedModel = "tiny",
        *,
        num_prefill: int = 1,
        num_decode: int = 1,
        dtype: str = "auto",
        cache_config: CacheConfig | None = None,
        prefill_scheduler_config: SchedulerConfig | None = None,
        decode_scheduler_config: SchedulerConfig | None = None,
        router: str = "prefix_affinity",
        kv_transfer_timeout_s: float = 30.0,
    ) -> None:
        if not (kv_transfer_timeout_s > 0 and math.isfinite(kv_transfer_timeout_s)):
            raise InvalidConfigError(f"kv_transfer_timeout_s must be a positive number of seconds, got {kv_transfer_timeout_s}")
        if num_prefill < 1 or num_decode < 1:
            raise InvalidConfigError(f"need at least one prefill and one decode instance, got {num_prefill}P{num_decode}D")
        if router not in PREFILL_ROUTERS:
            raise InvalidConfigError(f"unknown router {router!r}; choose from {sorted(PREFILL_ROUTERS)}")
        loaded = load_model(model, resolve_dtype(dtype)) if isinstance(model, str) else model
        super().__init__(loaded, cache_config, decode_scheduler_config)
        prefill_cfg = prefill_scheduler_config or self.scheduler_config
        common = (loaded, self.cache_config)
        tail = (self.num_blocks, self.max_model_len, self.eos_token_ids)
        self.prefill = [PrefillInstance(*common, prefill_cfg, *tail, f"prefill-{i}") for i in range(num_prefill)]
        self.decode = [DecodeInstance(*common, self.scheduler_config, *tail, f"decode-{i}") for i in range(num_decode)]
        self.router = PREFILL_ROUTERS[router]
        self.migration = MigrationCounters()
        self.kv_transfer_timeout_s = kv_transfer_timeout_s  # for parity with the Controller: copies here are synchronous
        self._fault: str | None = None
        self._pending: list[tuple[PrefillInstance, Sequence]] = []  # prompts done, KV not yet pulled
        self._owner: dict[str, PrefillInstance | DecodeInstance] = {}

    # ---- requests ----------------------------------------------------------------------------
    def _submit(self, seq: Sequence) -> None:
        inst = self.router(self.prefill, seq)
        inst.add(seq)
        self._owner[seq.seq_id] = inst

    def abort_request(self, request_id: str) -> None:
        """Abort wherever the request is: queued, prefilling, awaiting migration or decoding."""
        seq = self._forget(request_id)
        owner = self._owner.pop(request_id, None)
        self._pending = [(i, s) for i, s in self._pending if s.seq_id != request_id]
        if seq is not None and owner is not None and not seq.is_finished:
            seq.finish_time = time.monotonic()
            owner.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    def _reset(self) -> None:
        for inst in (*self.prefill, *self.decode):
            inst.reset()
        self._pending = []
        self._owner = {}

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Finish on the side that holds the request (a stop string matched)."""
        owner = self._owner.pop(seq.seq_id, None)
        self._pending = [(i, s) for i, s in self._pending if s is not seq]
        if owner is not None:
            owner.seqs.pop(seq.seq_id, None)
            owner.scheduler.finish(seq, reason)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for inst in self.prefill:
            if not inst.has_work():
                continue
            for seq in inst.step():
                if seq.status is not SequenceStatus.FINISHED:
                    self._pending.append((inst, seq))
                outputs.append(self._emit(seq))
        self._migrate_pending()
        for inst in self.decode:
            if inst.has_work():
                outputs.extend(self._emit(seq) for seq in inst.step())
        return outputs

    def _emit(self, seq: Sequence) -> RequestOutput:
        out = self._output(seq, time.monotonic(), self._finish)
        if out.finished:
            self._owner.pop(seq.seq_id, None)
        return out

    def _migrate_pending(self) -> None:
        """Pull KV for waiting requests, oldest first, while some decode instance has room."""
        still: list[tuple[PrefillInstance, Sequence]] = []
        for src, seq in self._pending:
            if seq.is_finished or seq.seq_id not in self._seqs:
                continue
            dst = max(self.decode, key=lambda d: d.free_blocks())
            if still or not self._migrate(src, dst, seq):
                still.append((src, seq))  # FCFS: nobody overtakes a request that is waiting for room
        self._pending = still

    def inject_transfer_fault(self, kind: str) -> None:
        """Test hook: the next migration fails (one-shot). ``drop_send`` counts as a timeout, ``fail_recv`` as an error."""
        if kind not in ("drop_send", "fail_recv"):
            raise ValueError(f"unknown transfer fault {kind!r}; choose drop_send or fail_recv")
        self._fault = kind

    def _migrate(self, src: PrefillInstance, dst: DecodeInstance, seq: Sequence) -> bool:
        moved = seq.detached_copy()
        reservation = dst.reserve(moved)
        if reservation is None:
            return False
        if self._fault is not None:
            fault, self._fault = self._fault, None
            dst.cancel(seq.seq_id)
            src.requeue(seq.seq_id)  # prefilled again; it keeps its first token
            self.migration.num_failures += 1
            self.migration.num_timeouts += fault == "drop_send"
            return True  # no longer waiting: the prefill step reports it again
        t0 = time.perf_counter()
        first, end = reservation.num_reused_blocks, reservation.num_blocks_to_fill
        src_blocks = src.kv_source(seq.seq_id)[first:end]
        dst_blocks = reservation.block_table[first:end]
        if src_blocks:
            cache = src.runner.kv_cache  # [L, 2, NB, BS, KVH, D]
            whole = ((0, cache.shape[0]), (0, cache.shape[4]))
            data = pack_blocks(cache, src_blocks, *whole)
            unpack_blocks(dst.runner.kv_cache, dst_blocks, *whole, data)
            self.migration.num_bytes += data.numel() * data.element_size()
        dst.complete(seq.seq_id)
        src.release(seq.seq_id)  # after the receiver holds the KV
        elapsed = time.perf_counter() - t0
        m = self.migration
        m.num_migrations += 1
        m.num_blocks_sent += len(src_blocks)
        m.num_blocks_skipped += first
        m.seconds += elapsed
        m.durations_s.append(elapsed)
        self._seqs[seq.seq_id] = moved
        self._owner[seq.seq_id] = dst
        return True

    def stats(self) -> dict[str, object]:
        return {
            "prefill": {i.instance_id: i.stats() for i in self.prefill},
            "decode": {i.instance_id: i.stats() for i in self.decode},
            "kv_migration_blocks_total": self.migration.num_blocks_sent,
            "kv_migration_blocks_skipped_total": self.migration.num_blocks_skipped,
            "kv_migration_bytes_total": self.migration.num_bytes,
            "kv_migration_seconds_total": self.migration.seconds,
            "kv_migration_failures_total": self.migration.num_failures,
            "kv_migration_timeouts_total": self.migration.num_timeouts,
            "num_requests_awaiting_migration": len(self._pending),
        }
