"""Lazy decodes on a pp = 1 instance: its decoding sequences kept compact from step to step.

The head of the scheduler's ``running`` list that only decodes is a ``LazyBatch``
(``simulator.lazy_batch``): its steps cost O(1) plus the members crossing a block boundary or
finishing. The real scheduler still plans every step that could change anything: at each launch
(``resume``) the sequences that joined ``running`` since (a prompt just prefilled, a migration just
arrived) join the members if they are plain decodes, and ``Scheduler.schedule(num_lazy_decodes=...)``
plans the rest — admissions, prompt chunks, anything that is not a member — around the members,
which hold their places in the budget and the batch cap. That plan (the *rest*) is launched and
applied by the real ``InstanceCore``, after the members' update, in the plan's order. Where the
scheduler might do anything the members do not cover — preempt (not enough free blocks), leave a
member out (budget, ``max_num_seqs``), reorder the batch (a join out of policy order, prefix groups),
isolate a crash suspect, fork — the batch is handed back first (``drop``) and the step is planned
as usual.

Between launches that need the scheduler, ``advance`` applies the steady steps (``horizon``: no
event reads or changes the instance before then) in one go, as ``simulator.fast_forward`` describes:
step times added one at a time (bit-identical clocks), finishes recorded by events at their step's
end, the jump stopping before a finish that frees room a waiting request or migration could take.
It ends with a step in flight or at a step boundary; a marker event there (``Simulation``: a
``STEP_DONE`` without a plan) applies the step in flight (``LazyBatch.land``) and launches the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from distserve.engine.instance_core import PlanInFlight
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import StepPlan
from simulator.fast_forward import horizon
from simulator.latency import BatchShape
from simulator.lazy_batch import LazyBatch, usable
from simulator.sim_events import STEP_DONE

if TYPE_CHECKING:
    from simulator.simulation import Simulation
    from simulator.sim_instance import SimInstance

_NO_PLAN = StepPlan()  # what observe_step sees of a step of lazy decodes alone


class LazyDecodes(LazyBatch):
    """The decoding head of ``inst``'s running list (see the module docstring)."""

    __slots__ = ("inst",)

    def __init__(self, inst: SimInstance, token_id: int) -> None:
        super().__init__(inst.core, token_id)
        self.inst = inst  # (the run breaks the cycle at its end: ``Simulation.run``)

    @property
    def num_members(self) -> int:
        """The live members: the head of ``running`` (as ``LazyLanes.num_members``)."""
        return self.num_alive

    @classmethod
    def enter(cls, sim: Simulation, inst: SimInstance, plan: StepPlan, end_s: float, token_id: int) -> LazyDecodes | None:
        """From ``plan``, just launched (step 0, ending at ``end_s``): its leading decodes of the head
        of ``running`` become members, the rest of it stays a real plan in flight; None if none can."""
        core = inst.core
        sched = core.scheduler
        if inst.pp != 1 or not usable(sim, inst) or plan.preempted_seq_ids or plan.block_copies:
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

    def drop(self) -> None:
        """Hand the batch back at a step boundary: every member's ``Sequence`` as the step-by-step run has it."""
        self.bring_up()
        self.inst.lazy = None

    # ---- events -----------------------------------------------------------------------------------
    def on_marker(self, sim: Simulation, now: float) -> int:
        """The marker at ``end_s``: step k's update (the members', then its rest's, in plan order) if it
        is in flight; the next launch at the instant's end. Returns how many requests finished."""
        inst = self.inst
        inst.fast_forward_log = None
        if not self.in_flight:
            sim._launch_at_end(inst)  # noqa: SLF001
            return 0
        ended = self.land(now)
        for seq in ended:
            sim._record_finish(inst, seq, now)  # noqa: SLF001
        rest, self.rest = self.rest, None
        if rest is None:
            sim._launch_at_end(inst)  # noqa: SLF001
            return len(ended)
        tokens = sim._sampled  # noqa: SLF001
        sampled = [tokens[c.seq_id] for c in rest.plan.chunks if c.sample]
        return len(ended) + sim._updated(inst, self.core.apply(rest, sampled, now), now)  # noqa: SLF001

    def try_launch(self, sim: Simulation, now: float, finished: Callable[[SimInstance, float, list[Sequence]], None]) -> bool:
        """``Simulation._try_launch``: nothing while step k is in flight (its marker launches next), else
        ``resume``; False where the batch was handed back."""
        return self.in_flight or self.resume(sim, now, finished)

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
        sim.num_fast_forward_steps += 1  # its members were not planned one by one
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
            left = sim.finishes_left()  # no jumping past a finish that may end the run (``stop_when``)
            in_flight, d = not launch, 0.0
            while True:
                if in_flight:  # step k's update at t
                    if k in finish_at or (commits and buckets[-(k + 1) % bs]):
                        self.k = k
                        ended = self.land(t)
                        buckets, k, n = self.buckets, self.k, self.num_alive
                        if ended:
                            finished(inst, t, ended)
                            left -= len(ended)
                            if hold or left <= 0:
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
