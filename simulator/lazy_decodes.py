"""Lazy decodes: a pp = 1 instance's decoding sequences, kept in a compact form from step to step.

While a sequence only decodes, each step computes one more token of it at the next position, and
nothing else about it changes until it reaches its length. ``LazyDecodes`` holds such sequences —
the head of the scheduler's ``running`` list, in its order — as (sequence, base position) pairs: in
step ``k`` member ``i`` computes position ``bases[i] + k``. A step costs O(1) plus the members that
cross a KV block boundary (the real ``BlockManager`` gives them their block, and commits the block
they filled, in batch order) or finish (the real ``Scheduler.finish``, in the step that reaches
their known length); their ``Sequence`` objects are brought up to date only then, or when the
batch is handed back (``drop``).

The real scheduler still plans every step that could change anything: at each launch
(``resume``) the sequences that joined ``running`` since (a prompt just prefilled, a migration just
arrived) join the members if they are plain decodes, and ``Scheduler.schedule(num_lazy_decodes=...)``
plans the rest — admissions, prompt chunks, anything that is not a member — around the members,
which hold their places in the budget and the batch cap. That plan (the *rest*) is launched and
applied by the real ``InstanceCore``, after the members' update, in the plan's order. Where the
scheduler might do anything the members do not cover — preempt (not enough free blocks), leave a
member out (budget, ``max_num_seqs``), reorder the batch (a join out of policy order, prefix groups),
isolate a crash suspect, fork — the batch is handed back first and the step is planned as usual.

Between launches that need the scheduler, ``advance`` applies the steady steps (``horizon``: no
event reads or changes the instance before then) in one go, as ``simulator.fast_forward`` describes:
step times added one at a time (bit-identical clocks), finishes recorded by events at their step's
end, the jump stopping before a finish that frees room a waiting request or migration could take.
It ends with a step in flight or at a step boundary; a marker event there (``Simulation``: a
``STEP_DONE`` without a plan) applies the step in flight (``land``) and launches the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from distserve.engine.instance_core import PlanInFlight
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import StepPlan
from simulator.fast_forward import apply_update, horizon
from simulator.latency import BatchShape
from simulator.sim_events import STEP_DONE

if TYPE_CHECKING:
    from simulator.simulation import Simulation
    from simulator.sim_instance import SimInstance

_NO_PLAN = StepPlan()  # what observe_step sees of a step of lazy decodes alone
_COMPACT_MIN = 64  # finished members are kept (as dead slots) until they outnumber the live ones this much


class LazyDecodes:
    """The decoding head of ``inst``'s running list (see the module docstring); ``k``: the step in flight or next."""

    __slots__ = ("inst", "core", "sched", "bm", "bs", "commits", "token_id", "seqs", "bases", "alive", "num_alive", "sum_bases",
                 "max_base", "buckets", "finish_at", "k", "in_flight", "rest", "end_s")

    def __init__(self, inst: SimInstance, token_id: int) -> None:
        self.inst = inst
        self.core = core = inst.core
        self.sched = core.scheduler
        self.bm = core.scheduler.block_manager
        self.bs = self.bm.block_size
        # Commits only matter to a prefix cache (they register the block's hash there); without one
        # a member's filled blocks are committed when it is handed back (``drop``) or never (a
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
        self.rest: PlanInFlight | None = None  # the real plan of the other sequences in step k
        self.end_s = 0.0  # when step k ends (in flight), or the boundary the batch waits at

    # ---- membership ----------------------------------------------------------------------------
    def plain(self, seq: Sequence, start: int, num_output_tokens: int) -> bool:
        """Whether ``seq``, decoding position ``start`` next, can be a member: nothing but its length stops it."""
        sp = seq.sampling
        token = self.token_id
        return (num_output_tokens >= 1 and not seq.isolate and not seq.forks and token not in sp.stop_token_ids
                and (sp.ignore_eos or token not in self.sched.eos_token_ids) and len(seq.block_hashes) == start // self.bs)

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

    @classmethod
    def enter(cls, sim: Simulation, inst: SimInstance, plan: StepPlan, end_s: float, token_id: int) -> LazyDecodes | None:
        """From ``plan``, just launched (step 0, ending at ``end_s``): its leading decodes of the head
        of ``running`` become members, the rest of it stays a real plan in flight; None if none can."""
        core = inst.core
        sched = core.scheduler
        if not usable(sim, inst) or plan.preempted_seq_ids or plan.block_copies:
            return None
        lazy = cls(inst, token_id)
        bs = lazy.bs
        chunks, running = plan.chunks, sched.running
        m = 0
        for chunk, seq in zip(chunks, running):
            start = chunk.start_pos
            if (seq.seq_id != chunk.seq_id or len(chunk.token_ids) != 1 or len(seq.block_table) != (start + bs) // bs
                    or not lazy.plain(seq, start, chunk.num_output_tokens)):
                break
            m += 1
        if m == 0:
            return None
        for chunk, seq in zip(chunks[:m], running):
            lazy._add(seq, chunk.start_pos, chunk.num_output_tokens)
        first = core.in_flight.popleft()
        if m < len(chunks):
            lazy.rest = PlanInFlight(StepPlan(chunks[m:], finished_seq_ids=plan.finished_seq_ids), first.plan_seq)
            core.in_flight.append(lazy.rest)
        lazy.in_flight, lazy.end_s = True, end_s
        return lazy

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
        seqs, bases, alive = [], [], []
        for i, (seq, base, a) in enumerate(zip(self.seqs, self.bases, self.alive)):
            if a:
                new[i] = len(seqs)
                seqs.append(seq)
                bases.append(base)
                alive.append(True)
        self.seqs, self.bases, self.alive = seqs, bases, alive
        self.buckets = [[new[i] for i in b] for b in self.buckets]
        self.finish_at = {step: [new[i] for i in members] for step, members in self.finish_at.items()}

    def drop(self) -> None:
        """Hand the batch back at a step boundary: every member's ``Sequence`` as the step-by-step run has it."""
        k, token = self.k, self.token_id
        for seq, base, a in zip(self.seqs, self.bases, self.alive):
            if a:
                n = base + k
                token_ids = seq.token_ids
                token_ids.extend([token] * (n + 1 - len(token_ids)))
                seq.num_computed_tokens = n
                if not self.commits:
                    self.bm.commit(seq)
        self.inst.lazy = None

    # ---- launches --------------------------------------------------------------------------------
    def resume(self, sim: Simulation, now: float, finished: Callable[[SimInstance, float, list[Sequence]], None]) -> bool:
        """Launch the next step at ``now`` (a boundary): the joined plain decodes become members, the
        real scheduler plans the rest around them. False (the batch handed back) where the step
        might not keep every member as one token each, in order: the caller plans it as usual."""
        inst, sched, bm, core = self.inst, self.sched, self.bm, self.core
        running = sched.running
        if not usable(sim, inst) or not sched._running_sorted or len(running) > sched.config.max_num_seqs:  # noqa: SLF001
            self.drop()
            return False
        num, k = self.num_alive, self.k
        crossing = self.buckets[-k % self.bs]
        if len(running) == num and not sched.waiting:  # nothing for the scheduler to decide: the members' step alone
            if not num or len(crossing) > bm.num_free_blocks:  # idle, or the real scheduler preempts
                self.drop()
                return False
            self.in_flight, self.end_s = True, now
            self.advance(sim, now, finished, launch=True)
            return True
        need = len(crossing)  # free blocks the step may take: no preemption below
        j = num
        while j < len(running):  # the plain decodes at the head of the joined ones become members
            seq = running[j]
            start = seq.num_computed_tokens
            if len(seq.token_ids) != start + 1 or not self.plain(seq, start, seq.num_output_tokens):
                break
            grow, cow = bm._slots_needed(seq, 1)  # noqa: SLF001 — read only
            need += grow + cow
            j += 1
        decoding = []  # the other sequences that decode (the "slo" budget counts them)
        for seq in running[j:]:
            left = len(seq.token_ids) - seq.num_computed_tokens
            if left <= 1:
                decoding.append(len(seq.token_ids))
            grow, cow = bm._slots_needed(seq, max(left, 1))  # noqa: SLF001 — at most what its chunk takes
            need += grow + cow
        ctx = self.sum_bases + num * (k + 1) + sum(len(seq.token_ids) for seq in running[num:j])
        budget = sched.config.max_num_batched_tokens if sched._static_budget else sched.step_budget.tokens(  # noqa: SLF001
            j + len(decoding), ctx + sum(decoding))
        if j == 0 or len(running) > budget or need > bm.num_free_blocks:
            self.drop()
            return False
        if crossing:
            self._take_blocks(crossing)
        for seq in running[num:j]:
            bm.append_slots(seq, 1)
            self._add(seq, seq.num_computed_tokens, seq.num_output_tokens)
        n = self.num_alive
        max_ctx = self.max_base + k + 1
        rest = core.launch(send_finished=False, num_lazy_decodes=n, lazy_decode_ctx=ctx)
        if rest is None:
            t = inst.decode_time(n, ctx, max_ctx)
            core.observe(_NO_PLAN, t, n, ctx)
        else:
            s = inst.batch_shape(rest.plan)
            t = inst.step_time(BatchShape(s.num_prefill, s.prefill_tokens, s.prefill_sq, n + s.num_decode, ctx + s.decode_ctx,
                                          max(max_ctx, s.decode_max_ctx)))
            core.observe(rest.plan, t, n, ctx)
        core.last_step_s = t
        inst.busy_s += t
        self.rest, self.in_flight, self.end_s = rest, True, now + t
        self.advance(sim, now, finished)
        return True

    def advance(self, sim: Simulation, now: float, finished: Callable[[SimInstance, float, list[Sequence]], None],
                launch: bool = False) -> None:
        """From step k, in flight since ``now`` (``launch``: to be launched at ``now``, the members
        alone), apply the steady steps up to the ``horizon``; then queue the marker event where the
        batch stops (step k's end, or a boundary). The steps launched here ask the scheduler
        nothing: each is the last one's members less the finished, one token further."""
        inst, sched, bm, core = self.inst, self.sched, self.bm, self.core
        waiting = sched.waiting
        static = sched._static_budget  # noqa: SLF001
        h = float("-inf")
        if self.rest is None and len(sched.running) == self.num_alive and (not waiting or (static and (
                self.num_alive >= sched.max_running or self.num_alive >= sched.config.max_num_seqs
                or (not bm.enable_prefix_caching and not bm.can_allocate(waiting[0]))))):
            h = horizon(sim, inst, now)  # (with requests waiting, none can be admitted while no one finishes)
        t = self.end_s
        if t <= h or launch:
            # A finish frees a slot and blocks that a waiting request or migration (``_no_room_for_pending``) could take.
            hold = bool(waiting) or bool(sim.pending)
            log = inst.fast_forward_log = [] if sim.stop_when_set else None
            observe = None if static else sched.step_budget.observe
            bs, decode_time, finish_at, commits = self.bs, inst.decode_time, self.finish_at, self.commits
            buckets, k, n = self.buckets, self.k, self.num_alive
            num_steps, busy_s, num_launched = core.num_steps, inst.busy_s, 0
            in_flight, d = not launch, 0.0
            while True:
                if in_flight:  # step k's update at t
                    if k in finish_at or (commits and buckets[-(k + 1) % bs]):
                        self.k = k
                        ended = self.land(t)
                        buckets, k, n = self.buckets, self.k, self.num_alive
                        if ended:
                            finished(inst, t, ended)
                            if hold:
                                in_flight = False
                                break
                    else:
                        k += 1
                    in_flight = False
                    if not n or not h > t:
                        break
                # Step k's launch at t: the members, one token further, the next block for those crossing.
                crossing = buckets[-k % bs]
                if crossing:
                    if len(crossing) > bm.num_free_blocks:  # the real scheduler preempts: hand the batch back there
                        break
                    self._take_blocks(crossing)
                if sched._finished_since_plan:  # noqa: SLF001 — step k's plan takes them
                    sched._finished_since_plan = []  # noqa: SLF001
                ctx = self.sum_bases + n * (k + 1)
                d = decode_time(n, ctx, self.max_base + k + 1)
                if log is not None:
                    log.append((t, num_steps, busy_s))
                if observe is not None:
                    observe(n, ctx, 0, d)
                num_steps += 1
                busy_s += d
                num_launched += 1
                t += d
                in_flight = True
                if t > h:
                    break
            self.k, self.in_flight = k, in_flight
            core.num_steps, inst.busy_s = num_steps, busy_s
            if num_launched:
                core.last_step_s = d
                sim.num_fast_forward_steps += num_launched
        self.end_s = t
        inst.stage_free[0] = t
        sim._push(t, STEP_DONE, (inst, None, inst.step_version))  # noqa: SLF001


def usable(sim: Simulation, inst: SimInstance) -> bool:
    """Whether ``inst``'s next steps may run with lazy decodes: a pp = 1 decode instance, or a colocated
    one with no prefill waiting for a decode instance, whose scheduler isolates, forks, defers and
    holds prompts back for prompt-only steps nothing."""
    sched = inst.core.scheduler
    return (inst.pp == 1 and inst.cascade is None and inst.layered is None
            and (inst.kind == "decode" or (inst.kind == "colocated" and not sim.pending))
            and not sched.isolated and not sched.forking and not inst.core._deferred  # noqa: SLF001
            and not (sched._prompts_alone and sched.waiting))  # noqa: SLF001
