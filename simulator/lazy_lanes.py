"""Lazy decodes on a pipelined (pp > 1) instance: every micro-batch in flight is a lane, kept compact.

A pp-stage instance keeps up to pp plans in flight. Here each of them is a *lane*: a ``LazyBatch``
of decoding members (``simulator.lazy_batch``) plus, where its plan also computed something else
(a prompt, a request that just joined), that part as a real plan (the lane's ``rest``). While the
instance only decodes, a lane whose plan ends is launched again, as soon as stage 0 is free, with
the same members one token further — ``schedule()`` takes the running sequences no plan in flight
computes — and with fewer lanes than stages a launch that plans nothing follows each launch. The
members of all lanes are the head of the scheduler's ``running`` list (the sequences that joined
since come after them), so ``Scheduler.schedule(num_lazy_decodes=..., num_lazy_in_flight=...)`` plans
around them: a launch that could change anything — a sequence joined, a request waits — asks the
real scheduler, which plans the rest (admissions, prompt chunks, joined sequences that are not plain
decodes) with the launching lane's members holding their places; the plain decodes that joined
become members of the launching lane first. Where the scheduler might do anything lanes do not
cover (preempt, two lanes launching as one plan, prefix groups, ...) the lanes are handed back as
real plans in flight (``drop``) and the step is planned as usual.

Between such launches ``advance`` replays the instance's own events — plan ends, launches waiting
for stage 0 — in the event loop's order and with its clock arithmetic (``Simulation._try_launch``),
up to the ``horizon`` (``simulator.fast_forward``'s rules); it stops before the oldest
lane's end when that lane has a rest (its update is the real ``InstanceCore``'s, in the event loop),
when another lane ends at the same instant or one waits already (they would share a plan), and
before a finish that frees room something waiting could take. One marker event (a ``STEP_DONE``
without a plan) at the oldest lane's end and the instance's ``LAUNCH`` event (a launch waiting for
stage 0) carry it on from there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from distserve.engine.instance_core import PlanInFlight
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import StepPlan
from simulator.fast_forward import horizon
from simulator.latency import BatchShape
from simulator.lazy_batch import LazyBatch, plain, usable
from simulator.sim_events import LAUNCH, STEP_DONE

if TYPE_CHECKING:
    from simulator.simulation import Simulation
    from simulator.sim_instance import SimInstance

Finished = Callable[["SimInstance", float, list[Sequence]], None]
_NO_PLAN = StepPlan()


class LazyLanes:
    """The lanes of a pipelined instance (see the module docstring)."""

    __slots__ = ("inst", "core", "sched", "bm", "pp", "token_id", "lanes", "free", "marker_s", "num_members")

    def __init__(self, inst: SimInstance, token_id: int) -> None:
        self.inst = inst  # (the run breaks the cycle at its end: ``Simulation.run``)
        self.core, self.pp, self.token_id = inst.core, inst.pp, token_id
        self.sched = inst.core.scheduler
        self.bm = self.sched.block_manager
        self.lanes: list[LazyBatch] = []  # in flight, oldest first (stages finish in launch order)
        self.free: list[LazyBatch] = []  # applied, waiting for their launch (two: they would share a plan)
        self.marker_s: float | None = None  # the latest marker queued (at the then oldest lane's end)
        self.num_members = 0  # of all lanes: the head of ``running``

    @classmethod
    def enter(cls, sim: Simulation, inst: SimInstance, token_id: int) -> LazyLanes | None:
        """Right after a launch at ``now``: every plan in flight (each decodes, together all running
        sequences) becomes a lane; None if they are not all steady lanes (nothing changed then)."""
        core = inst.core
        sched = core.scheduler
        flights, ends = core.in_flight, inst.plan_ends
        running = sched.running
        if (not usable(sim, inst) or not sched._running_sorted or len(ends) != len(flights)  # noqa: SLF001
                or sum(len(p.plan.chunks) for p in flights) != len(running)):
            return None
        lazy = cls(inst, token_id)
        bs = lazy.bm.block_size
        position = {seq.seq_id: i for i, seq in enumerate(running)}
        for p, end_s in zip(flights, ends):
            plan = p.plan
            if not plan.chunks or plan.block_copies or plan.preempted_seq_ids or len(plan.chunks) > sched.config.max_num_batched_tokens:
                return None
            lane = LazyBatch(core, token_id)
            last = -1
            for chunk in plan.chunks:
                at = position.get(chunk.seq_id)
                if at is None or at <= last:
                    return None
                last = at
                seq, start = running[at], chunk.start_pos
                if (len(chunk.token_ids) != 1 or seq.num_computed_tokens != start or len(seq.token_ids) != start + 1
                        or len(seq.block_table) != (start + bs) // bs or not lane.plain(seq, start, chunk.num_output_tokens)):
                    return None
                lane._add(seq, start, chunk.num_output_tokens)  # noqa: SLF001
            lane.in_flight, lane.end_s, lane.plan_seq = True, end_s, p.plan_seq
            lazy.lanes.append(lane)
            lazy.num_members += lane.num_alive
        flights.clear()
        sched.in_flight.clear()  # only the rests' sequences are the scheduler's to skip now
        inst.step_version += 1  # the plans' queued ends are the lanes' now
        return lazy

    # ---- events ---------------------------------------------------------------------------------
    def on_marker(self, sim: Simulation, now: float) -> int:
        """The oldest lane's plan ends at ``now``: its members' update, then its rest's; returns how
        many requests finished. (A marker whose lane a jump applied since is void.)"""
        if not self.lanes or self.lanes[0].end_s != now:
            return 0
        inst = self.inst
        inst.fast_forward_log = None
        lane = self.lanes.pop(0)
        inst.plan_ends.popleft()
        ended = lane.land(now)
        self.num_members -= len(ended)
        for seq in ended:
            sim._record_finish(inst, seq, now)  # noqa: SLF001
        num_finished = len(ended)
        rest, lane.rest = lane.rest, None
        if rest is not None:
            tokens = sim._sampled  # noqa: SLF001
            sampled = [tokens[c.seq_id] for c in rest.plan.chunks if c.sample]
            num_finished += sim._updated(inst, self.core.apply(rest, sampled, now), now)  # noqa: SLF001
        if lane.num_alive:
            self.free.append(lane)
        self._mark(sim)
        sim._launch_at_end(inst)  # noqa: SLF001
        return num_finished

    def _mark(self, sim: Simulation) -> None:
        """Queue the marker at the oldest lane's end, unless it is queued."""
        lanes = self.lanes
        if lanes and self.marker_s != lanes[0].end_s:
            self.marker_s = end = lanes[0].end_s
            inst = self.inst
            sim._push(end, STEP_DONE, (inst, None, inst.step_version))  # noqa: SLF001

    def try_launch(self, sim: Simulation, now: float, finished: Finished) -> bool:
        """``Simulation._try_launch`` at ``now`` with lanes; False (the lanes handed back) where the
        launch is the real scheduler's alone: the caller plans it as usual."""
        inst, sched, bm, core = self.inst, self.sched, self.bm, self.core
        if len(self.lanes) >= self.pp or inst.launch_pending:
            return True
        if inst.stage_free[0] > now:  # stage 0 still busy with the previous micro-batch
            inst.launch_pending = True
            sim._push(inst.stage_free[0], LAUNCH, inst)  # noqa: SLF001
            return True
        running = sched.running
        if not usable(sim, inst) or not sched._running_sorted or len(self.free) > 1:  # noqa: SLF001
            self.drop(sim)
            return False
        free = self.free[0] if self.free else None
        head = self.num_members
        in_flight = sched.in_flight
        if len(running) == head and not sched.waiting:  # nothing for the scheduler to decide
            if free is None:  # every sequence in flight: schedule() plans nothing
                sched._finished_since_plan = []  # noqa: SLF001
                return True
            crossing = free.buckets[-free.k % free.bs]
            if len(crossing) > bm.num_free_blocks or free.num_alive > sched.config.max_num_batched_tokens:
                self.drop(sim)  # the real scheduler preempts, or leaves members out
                return False
            if crossing:
                free._take_blocks(crossing)  # noqa: SLF001
            launch_at = self._launch(sim, free, None, now, free.ctx)
            self.advance(sim, now, launch_at, finished)
            return True
        lane = free
        lane_n = free.num_alive if free is not None else 0
        crossing = free.buckets[-free.k % free.bs] if free is not None else []
        need = len(crossing)  # free blocks the plan may take: no preemption below
        j = head
        token, eos, bs = self.token_id, sched.eos_token_ids, bm.block_size
        while j < len(running):  # the plain decodes at the head of the joined ones join the launching lane
            seq = running[j]
            start = seq.num_computed_tokens
            if (seq.seq_id in in_flight or len(seq.token_ids) != start + 1
                    or not plain(seq, start, seq.num_output_tokens, token, eos, bs)):
                break
            grow, cow = bm._slots_needed(seq, 1)  # noqa: SLF001 — read only
            need += grow + cow
            j += 1
        decoding = []  # the other sequences that decode (the "slo" budget counts them, in flight or not)
        num_rest = 0
        for seq in running[j:]:
            left = len(seq.token_ids) - seq.num_computed_tokens
            if left <= 1:
                decoding.append(len(seq.token_ids))
            if seq.seq_id not in in_flight:
                num_rest += 1
                grow, cow = bm._slots_needed(seq, max(left, 1))  # noqa: SLF001 — at most what its chunk takes
                need += grow + cow
        joined_ctx = sum(len(seq.token_ids) for seq in running[head:j])
        in_flight_ctx = sum(other.ctx for other in self.lanes)
        n = lane_n + j - head
        ctx = (free.ctx if free is not None else 0) + joined_ctx
        cfg = sched.config
        budget = cfg.max_num_batched_tokens if sched._static_budget else sched.step_budget.tokens(  # noqa: SLF001
            j + len(decoding), ctx + in_flight_ctx + sum(decoding))
        if n + num_rest > min(cfg.max_num_seqs, budget) or need > bm.num_free_blocks:
            self.drop(sim)
            return False
        if crossing:
            free._take_blocks(crossing)  # type: ignore[union-attr]  # noqa: SLF001
        if lane is None and j > head:
            lane = LazyBatch(core, token)
        for seq in running[head:j]:
            bm.append_slots(seq, 1)
            lane._add(seq, seq.num_computed_tokens, seq.num_output_tokens)  # type: ignore[union-attr]  # noqa: SLF001
        self.num_members = j
        rest = core.launch(send_finished=False, num_lazy_decodes=n, lazy_decode_ctx=ctx, num_lazy_in_flight=head - lane_n,
                           lazy_in_flight_ctx=in_flight_ctx)
        if rest is None and not n:  # nothing to compute: no launch
            return True
        if lane is None:  # the plan has no members: a lane holding its rest
            lane = LazyBatch(core, token)
        if free is None:
            self.free.append(lane)
        launch_at = self._launch(sim, lane, rest, now, ctx)
        self.advance(sim, now, launch_at, finished)
        return True

    def _launch(self, sim: Simulation, lane: LazyBatch, rest: PlanInFlight | None, now: float, ctx: int) -> float | None:
        """Launch free ``lane`` (its step k, with ``rest``) at ``now`` as ``Simulation._try_launch``
        does; returns when the launch after it waits for stage 0 (None: the pipeline is full)."""
        inst, core = self.inst, self.core
        n = lane.num_alive
        max_ctx = lane.max_base + lane.k + 1
        if rest is None:
            t = inst.decode_time(n, ctx, max_ctx)
            core.observe(_NO_PLAN, t, n, ctx)
            lane.plan_seq = core._next_plan_seq  # noqa: SLF001
            core._next_plan_seq += 1  # noqa: SLF001
            if self.sched._finished_since_plan:  # noqa: SLF001 — the plan takes them
                self.sched._finished_since_plan = []  # noqa: SLF001
        else:
            s = inst.batch_shape(rest.plan)
            t = inst.step_time(BatchShape(s.num_prefill, s.prefill_tokens, s.prefill_sq, n + s.num_decode, ctx + s.decode_ctx,
                                          max(max_ctx, s.decode_max_ctx) if n else s.decode_max_ctx))
            core.observe(rest.plan, t, n, ctx)
            lane.plan_seq = rest.plan_seq
        core.last_step_s = t
        inst.busy_s += t
        sim.num_fast_forward_steps += 1  # its members were not planned one by one
        stage_free = inst.stage_free
        end = now
        for s_ in range(self.pp):
            begin = stage_free[s_] if stage_free[s_] > end else end
            end = begin + t
            stage_free[s_] = end
        inst.plan_ends.append(end)
        lane.in_flight, lane.end_s, lane.rest = True, end, rest
        self.free.remove(lane)
        self.lanes.append(lane)
        return stage_free[0] if len(self.lanes) < self.pp else None

    def advance(self, sim: Simulation, now: float, launch_at: float | None, finished: Finished) -> None:
        """After a launch at ``now``: replay the instance's steady events up to the ``horizon``, then
        queue the marker and the launch waiting for stage 0 (the instance's ``LAUNCH`` event)."""
        inst, sched, bm, core = self.inst, self.sched, self.bm, self.core
        lanes, free_lanes, pp = self.lanes, self.free, self.pp
        waiting = sched.waiting
        static = sched._static_budget  # noqa: SLF001
        max_seqs = sched.config.max_num_seqs
        h = float("-inf")
        num = self.num_members
        if len(sched.running) == num and not free_lanes and (not waiting or (static and (
                num >= sched.max_running or (len(lanes) == pp and not sched._prompts_alone  # noqa: SLF001
                                             and all(lane.num_alive >= max_seqs for lane in lanes))
                or (not bm.enable_prefix_caching and not bm.can_allocate(waiting[0]))))):
            h = horizon(sim, inst, now)  # (with requests waiting, none can be admitted while no one finishes)
        hold = bool(waiting) or bool(sim.pending)
        stage_free = inst.stage_free
        observe = None if static else sched.step_budget.observe
        decode_time = inst.decode_time
        log = None
        inf = float("inf")
        left = sim.finishes_left()  # no jumping past a finish that may end the run (``stop_when``)
        while True:
            t_end = lanes[0].end_s if lanes else inf
            t = t_end if launch_at is None or t_end < launch_at else launch_at
            if t >= h:
                break
            if t == t_end:  # the oldest lane's plan ends
                lane = lanes[0]
                if free_lanes or lane.rest is not None or (len(lanes) > 1 and lanes[1].end_s == t):
                    break  # two lanes would share the next plan; a rest's update is the event loop's
                done = lane.finish_at.get(lane.k)
                if done and (hold or len(done) == lane.num_alive or left <= 0):
                    break
            # A launch at this instant's end needs a block for each member crossing a boundary; with
            # fewer free (before the update's finishes: a bound) the real scheduler preempts: stop before.
            nxt = lanes[0] if t == t_end else (free_lanes[0] if free_lanes else None)
            if nxt is not None and (launch_at is None or launch_at == t) and stage_free[0] <= t:
                if len(nxt.buckets[-(nxt.k + (t == t_end)) % nxt.bs]) > bm.num_free_blocks:
                    break
            if log is None and sim.stop_when_set:
                log = inst.fast_forward_log = []
            if t == t_end:
                lanes.pop(0)
                inst.plan_ends.popleft()
                ended = lane.land(t)
                if ended:
                    self.num_members -= len(ended)
                    left -= len(ended)
                    finished(inst, t, ended)
                if lane.num_alive:
                    free_lanes.append(lane)
            if launch_at == t:
                launch_at = None
            # The instant's end: ``Simulation._try_launch``.
            if len(lanes) >= pp or launch_at is not None:
                continue
            if stage_free[0] > t:  # stage 0 still busy: the launch waits for it (a LAUNCH event)
                launch_at = stage_free[0]
                continue
            if not free_lanes:  # every lane in flight: schedule() plans nothing (and drops the finished ids)
                sched._finished_since_plan = []  # noqa: SLF001
                continue
            lane = free_lanes.pop()
            crossing = lane.buckets[-lane.k % lane.bs]
            if crossing:
                lane._take_blocks(crossing)  # noqa: SLF001
            if sched._finished_since_plan:  # noqa: SLF001 — this plan takes them
                sched._finished_since_plan = []  # noqa: SLF001
            n = lane.num_alive
            ctx = lane.ctx
            d = decode_time(n, ctx, lane.max_base + lane.k + 1)
            if log is not None:
                log.append((t, core.num_steps, inst.busy_s))
            if observe is not None:
                observe(n, ctx, 0, d)
            core.num_steps += 1
            core.last_step_s = d
            if lanes:
                core.num_overlapped_launches += 1
            inst.busy_s += d
            sim.num_fast_forward_steps += 1
            end = t
            for s_ in range(pp):
                begin = stage_free[s_] if stage_free[s_] > end else end
                end = begin + d
                stage_free[s_] = end
            inst.plan_ends.append(end)
            lane.in_flight, lane.end_s = True, end
            lane.plan_seq = core._next_plan_seq  # noqa: SLF001
            core._next_plan_seq += 1  # noqa: SLF001
            lanes.append(lane)
            if len(lanes) < pp:
                launch_at = stage_free[0]
        self._mark(sim)
        if launch_at is not None:
            inst.launch_pending = True
            sim._push(launch_at, LAUNCH, inst)  # noqa: SLF001

    def drop(self, sim: Simulation) -> None:
        """Hand the lanes back at ``now`` (between launches): each lane in flight becomes its real plan
        in flight (members' chunks, then its rest's), ending when it does."""
        inst, core, sched = self.inst, self.core, self.sched
        flights: deque[PlanInFlight] = deque()
        for lane in self.lanes:
            lane.bring_up()
            plan = lane.plan([])
            if lane.rest is not None:
                plan.chunks.extend(lane.rest.plan.chunks)
            flights.append(PlanInFlight(plan, lane.plan_seq))
        for lane in self.free:
            lane.bring_up()
        core.in_flight = flights
        sched.in_flight = {c.seq_id for p in flights for c in p.plan.chunks}
        inst.step_version += 1  # the queued marker is void: the plans' ends are real events again
        for p, lane in zip(flights, self.lanes):
            sim._push(lane.end_s, STEP_DONE, (inst, p.plan, inst.step_version))  # noqa: SLF001
        inst.lazy = None
