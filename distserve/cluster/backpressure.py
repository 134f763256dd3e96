"""Backpressure: whether an entry (prefill or colocated) instance takes one more request from the
admission queue now (``distserve.cluster.admission``), from what its driver reports of it (``EntryLoad``).

Two rules, by ``Backpressure.waiting_unit``:

* ``tokens`` (the default): an instance takes a request while the prompt tokens waiting there
  *ahead of it* — of its admission rank or a lower one (``fair_queue``: tier, then sparse tenants
  before backlogged ones) — are fewer than the instance's next step computes
  (``max_num_batched_tokens``), and fewer requests wait than a step takes (``max_num_seqs``). So a
  dispatched request is computed within about a step, and the rest of a backlog stays in the fair
  queues, where a light tenant's request still overtakes it; a request of a lower rank is taken at
  once, because the scheduler computes it before the pending prompts of higher ranks (even the
  remaining chunks of a prompt under way, with chunked prefill).
* ``requests`` (TNG's gateway rule): while fewer than ``max_waiting`` (3) requests wait there.

Under both, batch-tier requests go only to an instance with nothing waiting (TNG), and with a
decode TPOT SLO (``tpot_slo_s``) none while the measured TPOT of where requests decode exceeds it,
and, on a disaggregated deployment, none while the decode instances lack free KV for what the
prefill side already holds (``EntryLoad.decode_room_tokens``): a request prefilled with nowhere to
decode waits for a decode slot after its first token, and that wait is its TPOT's (measured in
``experiments/chaos.py`` at 10x overload: 13 s of a 25 s time-after-first-token, p50). Held
back, it waits in the admission queue instead, where ``max_queue_delay_s`` sheds what cannot be served.
Measured in the simulator (issue 17's flood: one tenant at 10x three chat tenants' rate, OPT-13B
1P2D, whole prompts per step): the light tenants' P99 TTFT under ``fair`` is 2.6x their TTFT alone
with ``tokens``, 4.0x with ``requests``, at the same throughput (``tests/simulator/test_fairness_sim.py``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from mypy_extensions import mypyc_attr

from distserve.cluster.tenants import BATCH
from distserve.errors import InvalidConfigError

if TYPE_CHECKING:
    from distserve.cluster.admission import AdmissionItem

DEFAULT_MAX_WAITING = 3  # TNG: dispatch to an instance while fewer than this many requests wait in it
TOKENS, REQUESTS = "tokens", "requests"  # ``Backpressure.waiting_unit``
WAITING_UNITS = (TOKENS, REQUESTS)
DEFAULT_WAITING_UNIT = TOKENS


@mypyc_attr(native_class=False)  # compiled native, a frozen dataclass would not unpickle
@dataclass(frozen=True, slots=True)
class EntryLoad:
    """What backpressure reads of an entry instance."""

    num_waiting: int  # requests in its scheduler's waiting queue (not yet in a batch)
    tpot_s: float | None = None  # measured recent TPOT where its requests decode (None: unknown or idle)
    # Prompt tokens its scheduler holds and has not computed (waiting and partly prefilled), by
    # admission rank (index; ``Scheduler.pending_prompt_tokens``), and what its next step may take:
    # tokens (``SchedulerConfig.max_num_batched_tokens``) and sequences (``max_num_seqs``). None:
    # unknown (the token rule falls back to the request count).
    pending_tokens: tuple[int, ...] = ()
    step_tokens: int | None = None
    step_seqs: int | None = None
    # Disaggregated, under the TPOT rule: the decode instances' free KV tokens less what the requests
    # every prefill instance holds (waiting, prefilling, awaiting migration) will reserve there: shared
    # by all entry instances (``decode_room_tokens``). None: not disaggregated, or the rule is off.
    decode_room_tokens: int | None = None
    # Disaggregated, under the TPOT rule: how many more requests the prefill side may hold for the decode
    # instances before their time per token reaches the rule's TPOT (``decode_headroom``), shared by all
    # entry instances like the room above. None: not disaggregated, the rule is off, or a decode
    # instance is idle (nothing measured: the KV room decides).
    decode_headroom: int | None = None

    def tokens_ahead(self, rank: int) -> int:
        """Pending prompt tokens a request of ``rank`` would be computed after."""
        return sum(self.pending_tokens[: rank + 1])

    def with_dispatched(self, item: AdmissionItem) -> EntryLoad:
        """This load once ``item`` is added to the instance (a dispatch snapshot's update)."""
        tokens = item.prompt_tokens
        return EntryLoad(self.num_waiting + 1, self.tpot_s, add_pending(self.pending_tokens, item.rank, tokens), self.step_tokens, self.step_seqs,
                         self.decode_room_tokens, self.decode_headroom)

    @property
    def shares_decode(self) -> bool:
        """Whether this load carries the decode instances' room or headroom, which every prefill instance shares."""
        return self.decode_room_tokens is not None or self.decode_headroom is not None

    def with_decode_room_taken(self, tokens: int) -> EntryLoad:
        """This load once a request of ``tokens`` prompt tokens went to any prefill instance (the decode
        room and headroom are shared by all of them)."""
        if not self.shares_decode:
            return self
        return replace(self, decode_room_tokens=None if self.decode_room_tokens is None else self.decode_room_tokens - tokens,
                       decode_headroom=None if self.decode_headroom is None else self.decode_headroom - 1)


def add_pending(pending: tuple[int, ...], rank: int, tokens: int) -> tuple[int, ...]:
    """Pending prompt tokens by rank (``EntryLoad.pending_tokens``) with ``tokens`` more at ``rank``."""
    out = list(pending) + [0] * (rank + 1 - len(pending))
    out[rank] += tokens
    return tuple(out)


@mypyc_attr(native_class=False)  # compiled native, a frozen dataclass would not unpickle
@dataclass(frozen=True)
class Backpressure:
    """Whether an entry instance may take one more request now.

    ``waiting_unit`` ``tokens``: while the prompt tokens waiting ahead of the request there (of its
    admission rank or a lower one) are fewer than the instance's next step can compute, so a request
    is computed at most a step after it is dispatched and what is not yet due stays in the fair
    queues; ``requests`` (TNG's rule): while fewer than ``max_waiting`` requests wait there, and
    batch-tier requests only where nothing waits (also the ``tokens`` rule's fallback for a load
    without token counts). ``max_waiting`` None disables both (every request is dispatched at once,
    as before admission existed); ``tpot_slo_s`` None disables the TPOT rule.
    """

    max_waiting: int | None = DEFAULT_MAX_WAITING
    tpot_slo_s: float | None = None
    waiting_unit: str = DEFAULT_WAITING_UNIT

    def __post_init__(self) -> None:
        if self.max_waiting is not None and not (isinstance(self.max_waiting, int) and self.max_waiting >= 1):
            raise InvalidConfigError(f"backpressure max_waiting must be null or an integer >= 1, got {self.max_waiting!r}", "max_waiting")
        if self.tpot_slo_s is not None and not (self.tpot_slo_s > 0 and math.isfinite(self.tpot_slo_s)):
            raise InvalidConfigError(f"backpressure tpot_slo_s must be null or a positive number, got {self.tpot_slo_s!r}", "tpot_slo_s")
        if self.waiting_unit not in WAITING_UNITS:
            raise InvalidConfigError(f"waiting_unit must be one of {', '.join(WAITING_UNITS)}, got {self.waiting_unit!r}", "waiting_unit")

    def accepts(self, load: EntryLoad, tier: str, rank: int = 0, prompt_tokens: int = 0) -> bool:
        """Whether the instance of ``load`` takes a request of ``tier``, admission ``rank`` and
        ``prompt_tokens`` now."""
        if self.tpot_slo_s is not None:
            if load.tpot_s is not None and load.tpot_s > self.tpot_slo_s:
                return False
            if load.decode_room_tokens is not None and load.decode_room_tokens < prompt_tokens:
                return False
            if load.decode_headroom is not None and load.decode_headroom < 1:
                return False
        if self.max_waiting is None:
            return True
        if tier == BATCH and load.num_waiting:
            return False
        if self.waiting_unit == TOKENS and load.step_tokens is not None:
            return load.tokens_ahead(rank) < load.step_tokens and (load.step_seqs is None or load.num_waiting < load.step_seqs)
        return load.num_waiting < self.max_waiting


NO_BACKPRESSURE = Backpressure(max_waiting=None)


def measured_tpot_s(decoding: Iterable[tuple[int, float]]) -> float | None:
    """The TPOT backpressure reads, from (requests decoding, seconds between a request's tokens at the last
    step) per instance where requests decode: the best busy instance's (None: nothing decodes, so nothing
    to protect). A driver whose steps are micro-batches of a pipeline passes ``pp`` steps' time."""
    times = [step_s for num_running, step_s in decoding if num_running > 0 and step_s > 0]
    return min(times) if times else None


def held_prompt_tokens(scheduler: Any) -> int:
    """The KV tokens a decode instance reserves (prompt and first token, in whole blocks) for every request
    a prefill instance's scheduler holds: waiting, prefilling, and prefilled awaiting migration
    (``EntryLoad.decode_room_tokens``); 0 for a colocated one (it decodes its own)."""
    if scheduler.phase != "prefill":
        return 0
    bs = scheduler.block_manager.block_size
    seqs = itertools.chain(scheduler.waiting, scheduler.running, scheduler.isolated, getattr(scheduler, "awaiting_migration", {}).values())
    return sum(-(-(s.num_prompt_tokens + 1) // bs) for s in seqs) * bs


def held_requests(scheduler: Any) -> int:
    """The requests a prefill instance's scheduler holds for the decode instances (waiting, prefilling, and
    prefilled awaiting migration: ``decode_headroom``); 0 for a colocated one (it decodes its own)."""
    if scheduler.phase != "prefill":
        return 0
    return len(scheduler.waiting) + len(scheduler.running) + len(scheduler.isolated) + len(getattr(scheduler, "awaiting_migration", ()))


def decode_headroom(decoding: Iterable[tuple[int, float]], tpot_slo_s: float, held: int) -> int | None:
    """``EntryLoad.decode_headroom``: how many more requests the prefill side may hold for the decode
    instances, from (requests decoding, seconds between a request's tokens at the last step) per decode
    instance and the ``held`` requests (``held_requests`` of every prefill instance, plus those sent to
    them since). An instance at or over the TPOT takes none; one under it takes ``ceil(running x
    (tpot / per_token - 1))``: the batch that would reach the TPOT if a step's time grew in proportion to
    its batch — a bound, as a step's fixed part does not grow — and at least one. None when an instance
    decodes nothing (nothing to measure; the KV room decides).

    Without it the TPOT rule was all or nothing: whenever the latest reading dipped under the TPOT, the
    prefill instance took a step's worth of prompts, which reached the decode instance seconds later,
    after the reading had long turned; at 10x overload (``experiments/chaos.py``) the decode instance ran
    at twice the TPOT the rule held to.
    """
    total = 0
    for num_running, per_token_s in decoding:
        if num_running <= 0 or per_token_s <= 0:
            return None
        if per_token_s < tpot_slo_s:
            total += max(1, math.ceil(num_running * (tpot_slo_s / per_token_s - 1) - 1e-9))
    return total - held


def decode_room_tokens(decode_free_tokens: Iterable[int], held_tokens: Iterable[int]) -> int:
    """``EntryLoad.decode_room_tokens``: free KV tokens of the decode instances (free blocks x block
    size, each as its latest step left it) less ``held_prompt_tokens`` of the prefill instances."""
    return sum(decode_free_tokens) - sum(held_tokens)


def step_capacity(config: Any, phase: str, pipeline_depth: int = 1) -> tuple[int, int]:
    """(tokens, sequences) an entry instance's next launches take, what the ``tokens`` rule keeps waiting
    there: a step's (``SchedulerConfig.max_num_batched_tokens``, ``max_num_seqs``), per micro-batch of a
    pipelined prefill instance. That instance launches a micro-batch of prompts whenever stage 0 is
    free, pp per full-model step: with one step's worth waiting, the next launch found only what arrived
    since the last one and the pipeline ran part-empty (a PP=2 prefill instance under a backlog gained
    ~1.25x instead of ~2x). A colocated instance's micro-batches carry its running decodes: one step's
    worth of prompts (keeping pp there made the planner's short probes favour a colocated TP2·PP4 for
    OPT-13B that held 1.81 req/s/GPU over a longer run, against 2.88 for its earlier 4 × TP2)."""
    micro_batches = pipeline_depth if phase == "prefill" else 1
    return config.max_num_batched_tokens * micro_batches, config.max_num_seqs * micro_batches


class PendingPrompts(Protocol):
    """What ``entry_load`` reads of an entry instance's scheduler (``distserve.engine.scheduler.Scheduler``)."""

    config: Any  # its ``SchedulerConfig``: ``max_num_batched_tokens`` and ``max_num_seqs``, what a step may take
    pipeline_depth: int  # micro-batches in flight at once (the instance's pp)
    phase: str  # prefill | colocated

    @property
    def num_waiting(self) -> int: ...

    def pending_prompt_tokens(self) -> tuple[int, ...]: ...


def entry_load(scheduler: PendingPrompts, tpot_s: float | None, decode_room: int | None = None, headroom: int | None = None) -> EntryLoad:
    """An in-process entry instance's load, from its scheduler (a driver whose instances live elsewhere
    builds ``EntryLoad`` from the same figures in their stats)."""
    return EntryLoad(scheduler.num_waiting, tpot_s, scheduler.pending_prompt_tokens(),
                     *step_capacity(scheduler.config, scheduler.phase, scheduler.pipeline_depth), decode_room, headroom)


__all__ = [
    "Backpressure", "DEFAULT_MAX_WAITING", "add_pending", "DEFAULT_WAITING_UNIT", "EntryLoad", "NO_BACKPRESSURE", "PendingPrompts", "REQUESTS", "TOKENS",
    "WAITING_UNITS", "decode_headroom", "decode_room_tokens", "entry_load", "held_prompt_tokens", "held_requests", "measured_tpot_s", "step_capacity",
]
