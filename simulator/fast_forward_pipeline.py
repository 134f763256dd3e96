"""Fast-forward for pipelined instances (pp > 1): their micro-batches jump as lanes, exactly.

A pp-stage instance keeps up to pp plans in flight; while it only decodes, each plan in flight is a
*lane* — a fixed set of sequences relaunched, one token further, as soon as stage 0 is free. The
jump (``fast_forward_pipeline``) replays the instance's own events in the event loop's order, with
the rules of ``simulator.fast_forward`` (bit-identical clocks, the real ``BlockManager`` and
``Scheduler`` for commits, finishes and new blocks, a ``horizon`` it never passes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from distserve.engine.instance_core import PlanInFlight
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import ScheduledChunk, StepPlan
from simulator.fast_forward import apply_update, horizon
from simulator.latency import BatchShape

if TYPE_CHECKING:
    from simulator.simulation import Simulation
    from simulator.sim_instance import SimInstance


def fast_forward_pipeline(sim: Simulation, inst: SimInstance, now: float, token_id: int,
                          finished: Callable[[SimInstance, float, list[Sequence]], None],
                          push: Callable[[float, int, object], None]) -> bool:
    """A pipelined instance (pp > 1) that just launched at ``now``: apply its steady steps in one
    jump; False if the stretch is not steady (nothing changed then).

    Its micro-batches cycle: each plan in flight is a *lane* (a fixed set of decoding sequences);
    when a lane's plan ends, its update is applied and the lane is launched again, as soon as stage 0
    is free, with the same sequences one token further, since ``schedule()`` takes the running
    sequences no plan in flight computes (``Scheduler.in_flight``). With fewer lanes than stages
(one micro-batch holds every sequence), a launch waiting for stage 0 follows each launch and plans
nothing. The jump replays the instance's
    own events (plan ends, launches waiting for stage 0) in the event loop's order and with its
    arithmetic (step times per step, the stage clocks of ``Simulation._try_launch``), and applies
    updates and launches as ``fast_forward`` does: commits, finishes and new blocks through the real
    ``BlockManager``/``Scheduler`` in batch order. It stops before the first instant at or after the
    ``horizon``, or where a lane's plan would change (a lane empties, two lanes wait for stage 0 at
    once, a finish while a request could take its room, a launch that may need more free blocks than
    there are: the real scheduler preempts then). It always stops between instants, so what other
    instances' ``horizon`` reads (``plan_ends``, a launch waiting for stage 0) tells when it acts next.
    On stopping, the lanes in flight become real plans again (events at
    their ends, the older ones superseded: ``step_version``); ``push(time, kind, payload)`` queues an
    event. Unlike ``fast_forward``, jumped launches advance the plan numbers.
    """
    from simulator.sim_events import LAUNCH, STEP_DONE

    core = inst.core
    sched = core.scheduler
    pp = inst.pp
    flights = core.in_flight
    ends = inst.plan_ends
    if (len(ends) != len(flights) or sched.isolated or core._deferred  # noqa: SLF001 — read only
            or not sched._running_sorted):  # noqa: SLF001
        return False
    running = sched.running
    num_running = len(running)
    total = 0
    for p in flights:
        plan = p.plan
        if not plan.chunks or len(plan.chunks[-1].token_ids) != 1 or plan.block_copies or plan.preempted_seq_ids:
            return False
        total += len(plan.chunks)
    if total != num_running or sched.config.max_num_batched_tokens < num_running:
        return False
    h = horizon(sim, inst, now)
    if ends[0] >= h:
        return False
    bm = sched.block_manager
    bs = bm.block_size
    waiting = sched.waiting
    hold = bool(waiting) or bool(sim.pending)
    max_seqs = sched.config.max_num_seqs
    # Admission must stay impossible at every launch (an empty one too, with fewer lanes than stages).
    if waiting and not (
        sched._static_budget  # noqa: SLF001
        and (num_running >= sched.max_running
             or (len(flights) == pp and not sched._prompts_alone and all(len(p.plan.chunks) >= max_seqs for p in flights))  # noqa: SLF001
             or (not bm.enable_prefix_caching and not bm.can_allocate(waiting[0])))):
        return False
    # A prefix grouping kept for this running list orders the lanes' plans: it must agree with the policy order.
    grouping = sched.prefix_grouping
    group_rank = ({id(s): i for i, s in enumerate(grouping._order)}  # noqa: SLF001
                  if grouping._order is not None and grouping._made_for == running else None)  # noqa: SLF001
    position = {seq.seq_id: i for i, seq in enumerate(running)}
    max_model_len = sched.max_model_len
    eos = sched.eos_token_ids
    lanes: list[_Lane] = []
    for p in flights:
        lane = _Lane(p)
        last = last_rank = -1
        for i, chunk in enumerate(p.plan.chunks):
            at = position.get(chunk.seq_id)
            if at is None or at <= last:
                return False
            last = at
            seq = running[at]
            if group_rank is not None:
                r = group_rank.get(id(seq), -1)
                if r <= last_rank:
                    return False
                last_rank = r
            start = chunk.start_pos
            sp = seq.sampling
            if (len(chunk.token_ids) != 1 or chunk.num_output_tokens < 1 or seq.isolate or seq.num_computed_tokens != start
                    or len(seq.token_ids) != start + 1 or token_id in sp.stop_token_ids or (not sp.ignore_eos and token_id in eos)
                    or len(seq.block_table) != (start + bs) // bs or len(seq.block_hashes) != start // bs):
                return False
            lane.add(i, seq, start, chunk.num_output_tokens,
                     min(sp.max_tokens - chunk.num_output_tokens, max_model_len - start - 1) - 1, bs)
        lanes.append(lane)

    # The jump: the instance's own events, instant by instant.
    commit, append_slots = bm.commit, bm.append_slots
    seqs_by_id = core.seqs
    step_time = inst.step_time
    observe = None if sched._static_budget else sched.step_budget.observe  # noqa: SLF001
    stage_free = inst.stage_free
    num_lanes = len(flights)
    order = list(range(num_lanes))  # lanes in flight, launch order (oldest first)
    lane_end = list(ends)
    free: int | None = None  # the lane whose update is applied and that waits for its launch
    # A launch waiting for stage 0 (a LAUNCH event): with fewer lanes than stages, one follows every launch.
    launch_at: float | None = stage_free[0] if num_lanes < pp else None
    started = False
    log: list[tuple[float, int, float]] | None = None
    inf = float("inf")
    while True:
        t_end = lane_end[order[0]] if order else inf
        t = t_end if launch_at is None or t_end < launch_at else launch_at
        if t >= h:
            break
        if t == t_end:  # the oldest lane's plan ends: its update
            lane = lanes[order[0]]
            if free is not None or (len(order) > 1 and lane_end[order[1]] == t):
                break  # two lanes free at once would share the next plan
            done = lane.finish_at.get(lane.k)
            if done and (hold or len(done) == lane.num_alive):
                break
        # A launch at this instant's end needs a block for each lane member crossing a boundary; with
        # fewer free (before the update's finishes: a bound) the real scheduler preempts: stop before.
        nxt = order[0] if t == t_end else free
        if nxt is not None and (launch_at is None or launch_at == t) and stage_free[0] <= t:
            upcoming = lanes[nxt]
            if len(upcoming.buckets[-(upcoming.k + 1) % bs]) > bm.num_free_blocks:  # type: ignore[index]
                break
        if not started:
            started = True
            inst.step_version += 1  # the older lanes' queued ends are replayed here
            log = inst.fast_forward_log = [] if sim.stop_when_set else None
        if t == t_end:
            ended = lane.update(t, done, token_id, commit, sched, seqs_by_id)
            if ended:
                finished(inst, t, ended)
            free = order.pop(0)
        if launch_at == t:
            launch_at = None
        # The instant's end: ``Simulation._try_launch``.
        if len(order) >= pp or launch_at is not None:
            continue
        if stage_free[0] > t:  # stage 0 still busy: the launch waits for it (a LAUNCH event)
            launch_at = stage_free[0]
            continue
        if free is None:  # every lane in flight: schedule() plans nothing (and drops the finished ids)
            if sched._finished_since_plan:  # noqa: SLF001
                sched._finished_since_plan = []  # noqa: SLF001
            continue
        # The free lane's next plan, launched at t.
        lane = lanes[free]  # type: ignore[index]
        crossing = lane.buckets[-(lane.k + 1) % bs]
        lane.k += 1
        lane.ctx += lane.num_alive
        d = step_time(BatchShape(0, 0, 0, lane.num_alive, lane.ctx, lane.max_start + lane.k + 1))
        for i in crossing:
            append_slots(lane.seqs[i], 1)
        lane.taken = sched._finished_since_plan  # noqa: SLF001 — this plan takes them
        if lane.taken:
            sched._finished_since_plan = []  # noqa: SLF001
        if log is not None:
            log.append((t, core.num_steps, inst.busy_s))
        if observe is not None:
            observe(lane.num_alive, lane.ctx, 0, d)
        core.num_steps += 1
        core.last_step_s = d
        if order:
            core.num_overlapped_launches += 1
        inst.busy_s += d
        end = t
        for s in range(pp):
            begin = stage_free[s] if stage_free[s] > end else end
            end = begin + d
            stage_free[s] = end
        lane_end[free] = end  # type: ignore[index]
        lane.plan = None
        lane.plan_seq = core._next_plan_seq  # noqa: SLF001
        core._next_plan_seq += 1  # noqa: SLF001
        order.append(free)  # type: ignore[arg-type]
        free = None
        if len(order) < pp:
            launch_at = stage_free[0]
    if not started:
        return False
    # The lanes in flight become real plans again, each ending at its time; the rest as the event loop has them.
    flights.clear()
    ends.clear()
    in_flight = sched.in_flight
    in_flight.clear()
    for lane_id in order:
        lane = lanes[lane_id]
        p = lane.in_flight(token_id)
        flights.append(p)
        ends.append(lane_end[lane_id])
        in_flight.update(c.seq_id for c in p.plan.chunks)
        push(lane_end[lane_id], STEP_DONE, (inst, p.plan, inst.step_version))
    if free is not None:
        lanes[free].applied(token_id)
    if launch_at is not None:
        inst.launch_pending = True
        push(launch_at, LAUNCH, inst)
    return True




class _Lane:
    """One micro-batch of a pipelined instance in a jump: its sequences, as of the plan in flight
    when the jump began (step 0), and its step ``k`` (the plan launched last)."""

    __slots__ = ("first", "plan", "plan_seq", "taken", "seqs", "starts", "outputs", "alive", "num_alive", "ctx",
                 "max_start", "finish_at", "buckets", "k", "applied_k")

    def __init__(self, first: PlanInFlight) -> None:
        self.first = first
        self.plan: StepPlan | None = first.plan  # None once relaunched: built anew when the jump ends
        self.plan_seq = first.plan_seq
        self.taken: list[str] = []
        self.seqs: list[Sequence] = []
        self.starts: list[int] = []
        self.outputs: list[int] = []
        self.alive: list[bool] = []
        self.num_alive = 0
        self.ctx = 0  # Σ context of the alive sequences in step k
        self.max_start = -1
        self.finish_at: dict[int, list[int]] = {}  # step -> the sequences whose update in that step finishes them
        self.buckets: list[list[int]] | None = None
        self.k = 0
        self.applied_k = -1

    def add(self, i: int, seq: Sequence, start: int, outputs: int, finish_step: int, bs: int) -> None:
        if self.buckets is None:
            self.buckets = [[] for _ in range(bs)]
        self.seqs.append(seq)
        self.starts.append(start)
        self.outputs.append(outputs)
        self.alive.append(True)
        self.num_alive += 1
        self.ctx += start + 1
        if start > self.max_start:
            self.max_start = start
        self.finish_at.setdefault(finish_step, []).append(i)
        self.buckets[start % bs].append(i)

    def update(self, now: float, done: list[int] | None, token_id: int, commit: Callable[[Sequence], None], sched: object,
               seqs_by_id: dict[str, Sequence]) -> list[Sequence]:
        """Step k's update at ``now`` (as ``update_from_output``, ``apply_update``); returns the finished sequences."""
        _, ended, ended_ctx = apply_update(self.seqs, self.starts, self.alive, self.buckets, self.k + 1, done, now, token_id,  # type: ignore[arg-type]
                                           commit, sched, seqs_by_id)
        self.num_alive -= len(ended)
        self.ctx -= ended_ctx  # their contexts in step k
        if ended and self.num_alive and self.max_start in (self.starts[i] for i in done):  # type: ignore[union-attr]
            self.max_start = max(s for s, a in zip(self.starts, self.alive) if a)
        self.applied_k = self.k
        return ended

    def in_flight(self, token_id: int) -> PlanInFlight:
        """The lane's plan in flight (step k), as ``schedule()`` made it, its sequences brought up to it."""
        k = self.k
        self._bring_up(token_id, k)
        if self.plan is not None:
            return self.first
        plan = StepPlan([
            ScheduledChunk(seq.seq_id, [token_id], start + k, seq.block_table[:], True, seq.sampling, outputs + k)
            for seq, start, outputs, a in zip(self.seqs, self.starts, self.outputs, self.alive) if a
        ], finished_seq_ids=self.taken)
        return PlanInFlight(plan, self.plan_seq)

    def applied(self, token_id: int) -> None:
        """The lane waits for its launch: step k's update applied (its sampled token appended)."""
        self._bring_up(token_id, self.k + 1)

    def _bring_up(self, token_id: int, computed: int) -> None:
        """Every alive sequence with ``start + computed`` tokens computed and one more sampled."""
        for seq, start, a in zip(self.seqs, self.starts, self.alive):
            if a:
                token_ids = seq.token_ids
                token_ids.extend([token_id] * (start + computed + 1 - len(token_ids)))
                seq.num_computed_tokens = start + computed
