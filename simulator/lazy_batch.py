"""A batch of lazy decodes: sequences that only decode, kept in a compact form from step to step.

While a sequence only decodes, each step computes one more token of it at the next position, and
nothing else about it changes until it reaches its length. A ``LazyBatch`` holds such sequences —
a pp = 1 instance's decoding head of the scheduler's ``running`` list (``simulator.lazy_decodes``),
or one micro-batch of a pipelined instance (``simulator.lazy_lanes``) — as (sequence, base
position) pairs, in batch order: in step ``k`` member ``i`` computes position ``bases[i] + k``. A
step costs O(1) plus the members that cross a KV block boundary (the real ``BlockManager`` gives
them their block in batch order; with a prefix cache it also commits the block they filled, in
the update's order) or finish (the real ``Scheduler.finish``, in the step that reaches their known
length). Their ``Sequence`` objects are brought up to date only then, or when the batch is handed
back (``bring_up``): until then a member's ``token_ids`` and ``num_computed_tokens`` are those it
joined with, so what other code reads of them (``pending_prompt_tokens``: one token to compute)
stays true.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distserve.engine.instance_core import InstanceCore, PlanInFlight
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import ScheduledChunk, StepPlan, chunk_history
from simulator.fast_forward import apply_update

if TYPE_CHECKING:
    from simulator.simulation import Simulation
    from simulator.sim_instance import SimInstance

_COMPACT_MIN = 64  # finished members are kept (as dead slots) until they outnumber the live ones this much


class LazyBatch:
    """Members in batch order (see the module docstring); ``k``: the step in flight, or the next; ``rest``:
    the real plan of the other sequences of step k (in the instance's ``in_flight``), applied after
    the members' update."""

    __slots__ = ("core", "sched", "bm", "bs", "commits", "token_id", "seqs", "bases", "alive", "num_alive", "sum_bases",
                 "max_base", "buckets", "finish_at", "k", "in_flight", "rest", "end_s", "plan_seq")

    def __init__(self, core: InstanceCore, token_id: int) -> None:
        self.core = core
        self.sched = core.scheduler
        self.bm = core.scheduler.block_manager
        self.bs = self.bm.block_size
        # Commits only matter to a prefix cache (they register the block's hash there); without one
        # a member's filled blocks are committed when it is handed back (``bring_up``) or never (a
        # finish frees them), and its ``Sequence`` is not touched at all between its join and then.
        self.commits = self.bm.enable_prefix_caching
        self.token_id = token_id  # every simulated step samples it
        self.seqs: list[Sequence] = []
        self.bases: list[int] = []  # member i computes position bases[i] + k in step k
        self.alive: list[bool] = []
        self.num_alive = 0
        self.sum_bases = 0  # over the live members: step k's Σ context is sum_bases + num_alive·(k + 1)
        self.max_base = -(1 << 62)
        self.buckets: list[list[int]] = [[] for _ in range(self.bs)]  # members by bases[i] % block size
        self.finish_at: dict[int, list[int]] = {}  # step -> members whose update in that step finishes them
        self.k = 0
        self.in_flight = False  # step k is launched and not applied
        self.rest: PlanInFlight | None = None
        self.end_s = 0.0  # when step k ends (in flight), or the boundary the batch waits at
        self.plan_seq = 0  # step k's plan number (a pipeline's launches number their plans)

    @property
    def ctx(self) -> int:
        """Σ context of the live members in step k (each one's ``len(token_ids)`` then)."""
        return self.sum_bases + self.num_alive * (self.k + 1)

    # ---- membership ----------------------------------------------------------------------------
    def plain(self, seq: Sequence, start: int, num_output_tokens: int) -> bool:
        """Whether ``seq``, decoding position ``start`` next, can be a member (``plain``)."""
        return plain(seq, start, num_output_tokens, self.token_id, self.sched.eos_token_ids, self.bs)

    def _add(self, seq: Sequence, start: int, num_output_tokens: int) -> None:
        """``seq`` joins, computing position ``start`` in step k (its blocks cover it)."""
        i = len(self.seqs)
        base = start - self.k
        self.seqs.append(seq)
        self.bases.append(base)
        self.alive.append(True)
        self.num_alive += 1
        self.sum_bases += base
        if base > self.max_base:
            self.max_base = base
        # Step k + j leaves it with num_output_tokens + j + 1 outputs and start + j + 2 tokens.
        last = self.k + min(seq.sampling.max_tokens - num_output_tokens, self.sched.max_model_len - start - 1) - 1
        at = self.finish_at.get(last)
        if at is None:
            self.finish_at[last] = [i]
        else:
            at.append(i)
        self.buckets[base % self.bs].append(i)

    # ---- a step's update, and handing the batch back --------------------------------------------
    def land(self, now: float) -> list[Sequence]:
        """Step k's update for the members (the rest's is the caller's, after it); the finished, in batch order."""
        k = self.k
        done = self.finish_at.pop(k, None)
        if self.commits:
            _, ended, ended_ctx = apply_update(self.seqs, self.bases, self.alive, self.buckets, k + 1, done, now, self.token_id,
                                               self.bm.commit, self.sched, self.core.seqs)
        elif done:
            ended, ended_ctx = self._finish(sorted(done), k + 1, now)
        else:
            ended, ended_ctx = [], 0
        if ended:
            self.num_alive -= len(ended)
            self.sum_bases -= ended_ctx - len(ended) * (k + 1)
            if not self.num_alive:
                self.max_base = -(1 << 62)
            elif any(self.bases[i] == self.max_base for i in done):  # type: ignore[union-attr]
                self.max_base = max(b for b, a in zip(self.bases, self.alive) if a)
            if len(self.seqs) > _COMPACT_MIN and len(self.seqs) > 4 * self.num_alive:
                self._compact()
        self.k = k + 1
        self.in_flight = False
        return ended

    def _finish(self, done: list[int], computed: int, now: float) -> tuple[list[Sequence], int]:
        """Members ``done`` (batch order) reached their length in the step whose update leaves ``bases[i]
        + computed`` tokens computed: brought up to date and finished (``apply_update`` without commits)."""
        token, sched, seqs_by_id, bs = self.token_id, self.sched, self.core.seqs, self.bs
        ended = []
        ctx = 0
        for i in done:
            seq = self.seqs[i]
            n = self.bases[i] + computed
            token_ids = seq.token_ids
            token_ids.extend([token] * (n + 1 - len(token_ids)))
            seq.num_computed_tokens = n
            seq.finish_time = now
            sched.finish(seq, "length")
            del seqs_by_id[seq.seq_id]
            ended.append(seq)
            self.alive[i] = False
            self.buckets[self.bases[i] % bs].remove(i)
            ctx += n
        return ended, ctx

    def _take_blocks(self, crossing: list[int]) -> None:
        """Step k's launch: a new block for each member in ``crossing`` (batch order), as ``append_slots`` gives it."""
        seqs = self.seqs
        if self.commits:
            append_slots = self.bm.append_slots
            for i in crossing:
                append_slots(seqs[i], 1)
            return
        for i, block_id in zip(crossing, self.bm.allocate_blocks(len(crossing))):  # type: ignore[arg-type]
            seqs[i].block_table.append(block_id)

    def _compact(self) -> None:
        """Renumber the live members 0.. in order (dead slots dropped), their buckets and finish steps with them."""
        new = {}
        seqs: list[Sequence] = []
        bases: list[int] = []
        alive: list[bool] = []
        for i, (seq, base, a) in enumerate(zip(self.seqs, self.bases, self.alive)):
            if a:
                new[i] = len(seqs)
                seqs.append(seq)
                bases.append(base)
                alive.append(True)
        self.seqs, self.bases, self.alive = seqs, bases, alive
        self.buckets = [[new[i] for i in b] for b in self.buckets]
        self.finish_at = {step: [new[i] for i in members] for step, members in self.finish_at.items()}

    def bring_up(self) -> None:
        """Every live member's ``Sequence`` as the step-by-step run has it with step k not applied."""
        k, token = self.k, self.token_id
        for seq, base, a in zip(self.seqs, self.bases, self.alive):
            if a:
                n = base + k
                token_ids = seq.token_ids
                token_ids.extend([token] * (n + 1 - len(token_ids)))
                seq.num_computed_tokens = n
                if not self.commits:
                    self.bm.commit(seq)

    def plan(self, finished_seq_ids: list[str]) -> StepPlan:
        """Step k's plan for the members, as ``schedule()`` made it (after ``bring_up``)."""
        token, k = self.token_id, self.k
        chunks = []
        for seq, base, a in zip(self.seqs, self.bases, self.alive):
            if a:
                sp, outputs = seq.sampling, seq.num_output_tokens
                history = chunk_history(seq.token_ids, sp, outputs) if sp.needs_history else None
                chunks.append(ScheduledChunk(seq.seq_id, [token], base + k, seq.block_table[:], True, sp, outputs, history))
        return StepPlan(chunks, finished_seq_ids=finished_seq_ids)


def plain(seq: Sequence, start: int, num_output_tokens: int, token_id: int, eos_token_ids: tuple[int, ...], block_size: int) -> bool:
    """Whether ``seq``, decoding position ``start`` next with ``num_output_tokens`` outputs, is a plain
    decode a batch can hold: nothing but its length stops it (every step samples ``token_id``; no
    grammar), no crash suspicion or forks, its full blocks committed."""
    sp = seq.sampling
    return (num_output_tokens >= 1 and not seq.isolate and not seq.forks and token_id not in sp.stop_token_ids
            and (sp.ignore_eos or token_id not in eos_token_ids) and sp.structured is None
            and len(seq.block_hashes) == start // block_size)


def usable(sim: Simulation, inst: SimInstance) -> bool:
    """Whether ``inst``'s next steps may run with lazy decodes: a decode instance, or a colocated one
    with no prefill waiting for a decode instance, whose scheduler isolates, forks, defers, groups
    by prefix and holds prompts back for prompt-only steps nothing."""
    sched = inst.core.scheduler
    return (inst.cascade is None and inst.layered is None
            and (inst.kind == "decode" or (inst.kind == "colocated" and not sim.pending))
            and not sched.isolated and not sched.forking and not inst.core._deferred  # noqa: SLF001
            and sched.prefix_grouping._order is None  # noqa: SLF001 — no prefix groups to order a plan
            and not (sched._prompts_alone and sched.waiting))  # noqa: SLF001
