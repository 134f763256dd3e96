"""``InstanceCore``: one instance's state and step bookkeeping, without a model or a clock.

An instance is a phase scheduler (colocated, prefill or decode) over a ``BlockManager``, the
sequences it holds, the plans it has launched and not applied yet (up to ``pipeline_depth``
micro-batches), the operations that free blocks and must wait for those plans, and the tokens each
request has been told about. Every executor drives this one class:

* the colocated ``LLMEngine`` and the in-process instances of ``LocalDisaggEngine`` run each plan
  on a ``ModelRunner`` at once (``step`` below);
* the Ray runtime's ``InstanceServer`` launches plans onto ``tp × pp`` workers, applies them when
  the ranks are done, and reports token deltas (``delta``) across processes;
* the simulator launches plans and applies them when its clock reaches the latency model's step time.
* the profiler (``distserve.measure.step_times``) launches a plan, times it on a runner shared by
  its prefill and decode instances, and applies it at once.

A driver calls ``launch`` (schedule a plan if the pipeline has room), executes it however it
does, reports its duration with ``observe`` and applies the oldest plan's tokens with
``apply_oldest``. Operations that free blocks (``abort``, ``release``, ``requeue``, ``cancel``)
run at once unless a plan in flight computes the request; then they wait for the step boundary
that applies it (``defer``), in call order per request. Not thread-safe: a driver with several
threads (the Ray instance actor) serialises calls with its own lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from distserve.config import SchedulerConfig
from distserve.decode.scheduler import DecodeScheduler, Reservation
from distserve.engine.block_manager import BlockManager
from distserve.engine.logprobs import PromptLogprobs, TopLogprobs
from distserve.engine.scheduler import Scheduler
from distserve.engine.step_plan import SampledToken, StepPlan, attributed_to
from distserve.engine.structured_output import GrammarCompiler, SequenceGrammars
from distserve.engine.step_intervals import StepIntervals
from distserve.engine.step_stats import ITERATION_TOKEN_BOUNDS, STEP_SECONDS_BOUNDS, CumulativeHistogram
from distserve.engine.sequence import Sequence, SequenceStatus
from distserve.prefill.scheduler import PrefillScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    "colocated": Scheduler,
    "prefill": PrefillScheduler,
    "decode": DecodeScheduler,
}
# The scheduler's cumulative counters, which outlive a ``reset`` (a new scheduler starts them at 0).
SCHEDULER_COUNTERS = ("num_prefix_cache_hit_tokens", "num_prefix_cache_query_tokens", "num_preemptions")


@dataclass
class SeqUpdate:
    """What happened to one request in a step (tokens since its previous update); plain data for Ray."""

    seq_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    awaiting_migration: bool = False
    error: str | None = None  # with finish_reason "error"
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per new token, if the request asked
    prompt_logprobs: PromptLogprobs | None = None  # with the request's first token, if it asked


@dataclass(slots=True)
class PlanInFlight:
    """A launched plan whose tokens are not applied yet."""

    plan: StepPlan
    plan_seq: int  # launch order; every worker executes plans in this order
    refs: Seq[Any] = ()  # the driver's handles on the ranks computing it (Ray refs), set by the driver
    sampled: Seq[SampledToken] = ()  # the driver's result, once it has one
    _seq_ids: frozenset[str] | None = None

    def computes(self, seq_id: str) -> bool:
        """Whether this plan computes ``seq_id`` (whose blocks must then not be freed yet)."""
        if self._seq_ids is None:  # built on first use: most plans never need it
            self._seq_ids = frozenset(c.seq_id for c in self.plan.chunks)
        return seq_id in self._seq_ids


class InstanceCore:
    """One instance's scheduler, blocks, sequences, plans in flight, deferred frees and token deltas.

    Args:
        phase: ``colocated``, ``prefill`` or ``decode`` (``SCHEDULERS``).
        pipeline_depth: plans that may be in flight at once (the instance's pp degree).
        grammar_compiler: compiles the grammars of structured-output requests (``engine.structured_output``).
    """

    scheduler: Scheduler

    def __init__(
        self,
        phase: str,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        *,
        enable_prefix_caching: bool = True,
        pipeline_depth: int = 1,
        grammar_compiler: GrammarCompiler | None = None,
        step_histograms: bool = True,
    ) -> None:
        if phase not in SCHEDULERS:
            raise ValueError(f"unknown phase {phase!r}; choose from {sorted(SCHEDULERS)}")
        self.phase = phase
        self.config = config
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.enable_prefix_caching = enable_prefix_caching
        self.pipeline_depth = pipeline_depth
        self.grammar_compiler = grammar_compiler  # structured output (None: requests with a grammar are not served here)
        self.num_steps = 0
        self.last_step_s = 0.0
        # The latest step's interval and token interval (``StepIntervals``, fed by ``step_ended``): seconds
        # between a running request's tokens with pp = 1, and with any pp (TPOT backpressure reads it).
        self.step_interval_s = self.token_interval_s = 0.0
        self._intervals = StepIntervals(pipeline_depth)
        self.max_plans_in_flight = 0  # high-water mark, counting plans that compute tokens
        self.num_overlapped_launches = 0  # plans launched while another that computes tokens was in flight
        self.num_prefill_tokens_computed = 0  # prompt (and recomputed) tokens of the plans applied
        self.iteration_tokens = CumulativeHistogram(ITERATION_TOKEN_BOUNDS)  # tokens per observed step
        self.step_seconds = CumulativeHistogram(STEP_SECONDS_BOUNDS)  # duration of each observed step
        # Whether ``observe`` fills the two histograms above (/metrics reads them; a simulation does not).
        self.step_histograms = step_histograms
        self._counts_before_reset = dict.fromkeys(SCHEDULER_COUNTERS, 0)
        self.reset()

    def reset(self) -> None:
        """Forget every request, plan and KV block (after a failed step); counters stay."""
        if hasattr(self, "scheduler"):
            for key in SCHEDULER_COUNTERS:
                self._counts_before_reset[key] += getattr(self.scheduler, key)
        self.block_manager = BlockManager(self.num_blocks, self.block_size, self.enable_prefix_caching)
        self.scheduler = SCHEDULERS[self.phase](
            self.config, self.block_manager, self.max_model_len, self.eos_token_ids, pipeline_depth=self.pipeline_depth
        )
        self.seqs: dict[str, Sequence] = {}
        # Constrained decoding: one matcher per sequence with a grammar (None: this driver has no compiler).
        self.grammars = SequenceGrammars(self.grammar_compiler) if self.grammar_compiler is not None else None
        self.scheduler.grammars = self.grammars
        self.in_flight: deque[PlanInFlight] = deque()  # oldest first
        self._deferred: list[tuple[str, Callable[[], object]]] = []  # (seq_id, op) waiting for its plans
        self._reported: dict[str, int] = {}  # output tokens already reported per request (``delta``)
        self._next_plan_seq = 0

    # ---- the phase's schedulers, typed ---------------------------------------------------------
    @property
    def prefill(self) -> PrefillScheduler:
        assert isinstance(self.scheduler, PrefillScheduler), f"a {self.phase} instance has no prefill queue"
        return self.scheduler

    @property
    def decode(self) -> DecodeScheduler:
        assert isinstance(self.scheduler, DecodeScheduler), f"a {self.phase} instance has no reservations"
        return self.scheduler

    # ---- requests ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """A new request, or one re-run here; after any op still queued for an earlier attempt of its id."""

        def run() -> None:
            for s in (seq, *seq.forks):  # n > 1: its completions ride with it until forked
                self.seqs[s.seq_id] = s
                self._reported[s.seq_id] = s.num_output_tokens
            self.scheduler.add(seq)

        if self.grammars is not None:
            self.grammars.prefetch(seq)
        self.defer(seq.seq_id, run)

    def abort(self, seq_id: str, reason: str = "abort") -> None:
        """Finish a request here (abort, or a stop string matched); frees its KV."""

        def run() -> None:
            seq = self._forget(seq_id)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, reason)

        self.defer(seq_id, run)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a sequence the driver holds right now, between steps (a stop string matched)."""
        self._forget(seq.seq_id)
        self.scheduler.finish(seq, reason)

    def _forget(self, seq_id: str) -> Sequence | None:
        self._reported.pop(seq_id, None)
        if self.grammars is not None:
            self.grammars.drop(seq_id)
        return self.seqs.pop(seq_id, None)

    def kv_source(self, seq_id: str) -> list[int]:
        """Prefill: the block table holding the prompt KV of a request awaiting migration."""
        return list(self.prefill.awaiting_migration[seq_id].block_table)

    def release(self, seq_id: str) -> None:
        """Prefill: the decode side holds the KV now; free it (hashed blocks stay as prefix cache)."""

        def run() -> None:
            self.prefill.release(seq_id)
            self._forget(seq_id)

        self.defer(seq_id, run)

    def requeue(self, seq_id: str) -> None:
        """Prefill: the migration failed; drop the KV and prefill the request again."""
        self.defer(seq_id, lambda: self.prefill.requeue(seq_id))

    def reserve(self, seq: Sequence) -> Reservation | None:
        """Decode: blocks for a migrating request (prompt + first token), or None while there is no room
        or this instance still holds an earlier attempt of the request."""
        if seq.seq_id in self.seqs:
            return None
        reservation = self.decode.reserve(seq)
        if reservation is not None:
            self.seqs[seq.seq_id] = seq
            self._reported[seq.seq_id] = seq.num_output_tokens
            if self.grammars is not None:
                self.grammars.prefetch(seq)
        return reservation

    def complete(self, seq_id: str) -> Sequence | None:
        """Decode: the KV arrived; the request decodes from the next step on."""
        return self.decode.complete(seq_id)

    def cancel(self, seq_id: str) -> None:
        """Decode: the transfer failed or was aborted; give the reservation's blocks back."""

        def run() -> None:
            self.decode.cancel(seq_id)
            self._forget(seq_id)

        self.defer(seq_id, run)

    # ---- deferred ops --------------------------------------------------------------------------
    def defer(self, seq_id: str, run: Callable[[], object]) -> None:
        """Run now if no plan in flight computes ``seq_id``, else once none does (a step boundary).

        Ops of one request run in call order: one arriving behind a queued op of its id queues too
        (e.g. the re-run of a request whose earlier attempt's abort is still waiting).
        """
        if self.computes(seq_id) or (self._deferred and any(queued == seq_id for queued, _ in self._deferred)):
            self._deferred.append((seq_id, run))
        else:
            run()

    def computes(self, seq_id: str) -> bool:
        """Whether a plan in flight computes ``seq_id`` (its blocks must not be freed yet)."""
        for p in self.in_flight:  # (a loop, not any(): a pipelined prefill instance asks this per release)
            if p.computes(seq_id):
                return True
        return False

    def run_deferred(self) -> None:
        """The deferred ops whose request no plan in flight computes any more, in order."""
        if not self._deferred:
            return
        waiting: list[tuple[str, Callable[[], object]]] = []
        for seq_id, run in self._deferred:
            if self.computes(seq_id):
                waiting.append((seq_id, run))
            else:
                run()
        self._deferred = waiting

    # ---- the step ------------------------------------------------------------------------------
    def launch(self, send_finished: bool = True, *, preempting: bool = False, num_lazy_decodes: int = 0,
               lazy_decode_ctx: int = 0, num_lazy_in_flight: int = 0, lazy_in_flight_ctx: int = 0) -> PlanInFlight | None:
        """The next plan, numbered and in flight, if the pipeline has room and there is something
        to send: tokens to compute, or (``send_finished``) finished ids whose per-request state the
        workers drop; else None. A driver without such state (the simulator) passes False.
        ``preempting``: one plan more than the pipeline holds, to run while a suspended one waits
        (``engine.preemptible``). ``num_lazy_*``: running sequences the driver decodes itself
        (``Scheduler.schedule``; the plan then holds only the others)."""
        if self._deferred:
            self.run_deferred()
        if len(self.in_flight) >= self.pipeline_depth + preempting:
            return None
        if num_lazy_decodes or num_lazy_in_flight:
            plan = self.scheduler.schedule(num_lazy_decodes, lazy_decode_ctx, num_lazy_in_flight, lazy_in_flight_ctx)
        else:
            plan = self.scheduler.schedule()
        if plan.is_empty and not (send_finished and plan.finished_seq_ids):
            return None
        if self.grammars is not None:
            self.grammars.fill_bitmasks(plan, self.seqs)
        if plan.chunks and self.in_flight:
            computing = sum(1 for p in self.in_flight if p.plan.chunks)
            if computing:
                self.num_overlapped_launches += 1
            self.max_plans_in_flight = max(self.max_plans_in_flight, computing + 1)
        elif plan.chunks and not self.max_plans_in_flight:
            self.max_plans_in_flight = 1
        launched = PlanInFlight(plan, self._next_plan_seq)
        self._next_plan_seq += 1
        self.in_flight.append(launched)
        return launched

    def plan_around(self, p: PlanInFlight) -> None:
        """The scheduler skips ``p``'s sequences until ``p`` is applied (as it does with pp > 1): a
        plan launched while ``p`` is suspended must not compute them again (``engine.preemptible``)."""
        self.scheduler.in_flight.update(c.seq_id for c in p.plan.chunks)

    def observe(self, plan: StepPlan, seconds: float, num_lazy_decodes: int = 0, lazy_decode_ctx: int = 0) -> None:
        """How long ``plan`` (with its lazy decodes: ``launch``) took (measured, or modelled in the
        simulator): the step budget learns from it."""
        self.scheduler.observe_step(plan, seconds, num_lazy_decodes, lazy_decode_ctx)
        self.num_steps += 1
        if self.step_histograms:
            self.iteration_tokens.observe(plan.num_batched_tokens + num_lazy_decodes)
            self.step_seconds.observe(seconds)

    def apply_oldest(self, sampled: Seq[SampledToken], now: float) -> list[Sequence]:
        """Apply the oldest plan in flight: its sampled tokens, stop rules, the ops that waited for
        it. Returns the sequences that received a token (finished ones are forgotten here)."""
        return self.apply(self.in_flight[0], sampled, now)

    def apply(self, p: PlanInFlight, sampled: Seq[SampledToken], now: float) -> list[Sequence]:
        """``apply_oldest`` for plan ``p``, which may be younger than others in flight (a plan that
        ran while an older one was suspended: ``engine.preemptible``)."""
        if self.in_flight[0] is p:
            self.in_flight.popleft()
        else:
            self.in_flight.remove(p)
        self.num_prefill_tokens_computed += num_prefill_tokens(p.plan)
        if self._deferred:
            self.run_deferred()  # first: an aborted request gets no token from its last plan
        seqs = self.seqs
        updated = self.scheduler.update_from_output(p.plan, sampled, seqs, now)
        finished = SequenceStatus.FINISHED
        grammars = self.grammars
        for seq in updated:  # the simulator's hot loop: status compared inline
            if seq.status is finished:
                seqs.pop(seq.seq_id, None)
                if grammars is not None:
                    grammars.drop(seq.seq_id)
        return updated

    def step(self, execute: Callable[[StepPlan], list[SampledToken]], clock: Callable[[], float]) -> list[Sequence]:
        """Launch, execute and apply one plan at once (an in-process instance, pp = 1). A failure
        is a ``StepFailedError`` naming the plan's requests (``attributed_to``)."""
        launched = self.launch()
        if launched is None:
            return []
        with attributed_to(launched.plan):
            t0 = clock()
            sampled = execute(launched.plan)
            now = clock()
            self.observe(launched.plan, now - t0)
            updated = self.apply_oldest(sampled, now)
            self.step_ended(now - t0, now)
            return updated

    def step_ended(self, seconds: float, now: float) -> None:
        """A step that computed for ``seconds`` ended at ``now`` (the driver's clock; call it after the
        step's plan was applied): sets ``last_step_s``, ``step_interval_s`` and ``token_interval_s``
        (``StepIntervals``: the time a decoding request waits between its tokens, the driver's gaps between
        steps included)."""
        self.last_step_s = seconds
        self.step_interval_s, self.token_interval_s = self._intervals.ended(seconds, now, self.scheduler.num_running > 0)

    def delta(self, seq: Sequence) -> SeqUpdate:
        """The tokens ``seq`` got since its previous delta (for a driver that reports across processes)."""
        seen = self._reported.get(seq.seq_id, 0)
        self._reported[seq.seq_id] = seq.num_output_tokens
        awaiting = isinstance(self.scheduler, PrefillScheduler) and seq.seq_id in self.scheduler.awaiting_migration
        if seq.is_finished:
            self._reported.pop(seq.seq_id, None)
        return SeqUpdate(
            seq.seq_id, seq.output_token_ids[seen:], seq.logprobs[seen:] if seq.logprobs else [], seq.is_finished,
            seq.finish_reason, seq.num_cached_tokens, awaiting, seq.error,
            seq.top_logprobs[seen:] if seq.top_logprobs else [], seq.prompt_logprobs if not seen else None,
        )

    # ---- what the router and /metrics see ------------------------------------------------------
    def has_work(self) -> bool:
        """Something to compute, or to apply, or an op waiting for a plan."""
        return bool(self.scheduler.has_work() or self.in_flight or self._deferred)

    def load(self) -> int:
        """Routing signal: prompt tokens queued or running here."""
        s = self.scheduler
        return sum(q.num_uncomputed_tokens for q in s.waiting + s.running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def scheduler_count(self, key: str) -> int:
        """One of ``SCHEDULER_COUNTERS`` since the instance started (resets included)."""
        return self._counts_before_reset[key] + int(getattr(self.scheduler, key))

    @property
    def num_prefix_cache_hit_tokens(self) -> int:
        """Prompt tokens admissions here took from the prefix cache instead of computing them."""
        return self.scheduler_count("num_prefix_cache_hit_tokens")

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        out: dict[str, Any] = {
            "num_requests_waiting": s.num_waiting,
            "num_requests_running": s.num_running,
            "kv_cache_usage_perc": self.block_manager.usage,
            "num_free_blocks": self.block_manager.num_free_blocks,
            "step_seconds": self.last_step_s,
            "num_steps": self.num_steps,
            "prefill_tokens_computed_total": self.num_prefill_tokens_computed,
            "prefix_cache_hit_tokens_total": self.num_prefix_cache_hit_tokens,
            "prefix_cache_query_tokens_total": self.scheduler_count("num_prefix_cache_query_tokens"),
            "num_preemptions_total": self.scheduler_count("num_preemptions"),
            "iteration_tokens": self.iteration_tokens.as_dict(),
            "step_seconds_histogram": self.step_seconds.as_dict(),
            "cache_config": {"block_size": self.block_size, "num_gpu_blocks": self.num_blocks,
                             "enable_prefix_caching": self.enable_prefix_caching},
        }
        if isinstance(s, PrefillScheduler):
            out["num_requests_awaiting_migration"] = s.num_awaiting_migration
        if isinstance(s, DecodeScheduler):
            out["num_requests_migrating"] = len(s.migrating)
            out["reservations_held_total"] = s.num_held_reservations  # waits for a shared prefix arriving here
        return out


def num_prefill_tokens(plan: StepPlan) -> int:
    """Tokens ``plan`` computes that are not decodes: every token of a chunk, but the last of one that
    ends at a generated token (computing the newest sampled token is a decode, even in a recompute)."""
    total = 0
    for c in plan.chunks:
        n = len(c.token_ids)
        if c.sample and c.num_output_tokens:
            n -= 1
        total += n
    return total


__all__ = ["InstanceCore", "num_prefill_tokens", "PlanInFlight", "SCHEDULERS", "SeqUpdate"]
