"""Fast-forward: a simulated instance skips a steady stretch of decode steps in one jump, exactly.

While an instance only decodes, step after step, each plan is the last one with every context one
token longer, minus the requests that reached their length: no prompt is admitted, nobody is
preempted. Running the real ``schedule()``/``update_from_output()`` for each of those steps costs
O(batch) Python per step; here the steps are applied in one go, and the real scheduler plans again
at the first step where anything else could change.

``fast_forward`` is called when an instance launches a plan ``P`` (step 0) at ``t0``. If the
stretch is steady it applies steps ``0 .. V-1`` at once and launches step ``V`` with the plan
``schedule()`` would make for it, which ``Simulation`` applies at its end like any step; or, where
an event at ``t_V`` must see the instance before that launch, it stops at ``t_V`` and the
simulation relaunches the instance then (a marker event in place of ``P``'s completion). For the
result to equal the step-by-step one:

* Step times are the latency model's, evaluated per step on each step's shape (``decode_ctx``
  grows by the batch size, ``decode_max_ctx`` by one) and added one at a time, as the event loop
  adds them, so every clock is bit-identical (a closed form would round differently).
* A request stops at its length (``max_tokens`` or ``max_model_len``; sampled tokens never stop a
  simulated request), known in advance: the jump finishes it through the scheduler's own
  ``finish`` in the step that reaches it, and ``Simulation`` records it by an event at that step's
  end, so ``stop_when`` sees finishes in time order. With requests waiting, a finish (a free slot,
  free blocks) could admit one: the jump stops before the first finish then.
* KV blocks: at a block boundary the real ``BlockManager.append_slots`` takes the sequence's next
  block, and the block that filled is ``commit``-ted, in the order the step-by-step run does them
  (commits of step ``k - 1``'s update, then allocations of step ``k``'s launch, each in batch
  order), so block ids, prefix-cache hashes and evictions are the same. A step that would need
  more blocks than are free (the real scheduler would preempt) is not jumped over.
* Nothing outside the instance may look at or change it during the jump: the jump ends at or
  before the next event that could (``horizon``): the next arrival (admission, dispatch), and for
  a decode instance the next end of a prefill step (it may migrate a request here) and the next
  completed migration anywhere. An interacting event at exactly ``t_V`` is fine: events at one
  instant see the instance after its steps ending then and before its next launch, as here.
* Retries: every step's end retries the admission queue and the migration queue. A jump runs
  only where each retry would do nothing, as the last one did: no entry instance accepts the
  admission queue's head (dispatch reads no clock; its next deadline and the other entries'
  events bound the jump), and no decode instance can reserve a waiting prefill's room (the
  other decode instances' events bound it, and the instance stops before its first finish).
* The waiting queue: a stretch with requests waiting is steady only where their admission cannot
  change (the batch is at its cap, or the first waiting prompt's blocks do not fit, without a
  prefix cache, as free blocks only shrink in the jump), with the static step budget.

Pipelined instances (pp > 1) jump their micro-batches by ``simulator.fast_forward_pipeline``.
Not jumped (the step-by-step path runs): shared compute, cascade
attention (its savings depend on block tables), observers of every plan (``Simulation.on_plan``),
TPOT backpressure (it reads each step's time), a colocated instance next to decode instances
while prefills wait for room, crash suspects. ``_next_plan_seq`` (plan numbers, which only the Ray
runtime reads) is not advanced by the jumped steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distserve.cluster.backpressure import entry_load
from distserve.engine.instance_core import PlanInFlight
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import ScheduledChunk, StepPlan
from simulator.latency import BatchShape

if TYPE_CHECKING:
    from simulator.simulation import Simulation
    from simulator.sim_instance import SimInstance


def horizon(sim: Simulation, inst: SimInstance, now: float) -> float:
    """The earliest instant an event could read or change ``inst`` (inf: none is scheduled);
    -inf when that cannot be bounded cheaply (a busy prefill instance waiting to launch, or the admission
    queue could dispatch at the end of one of the jumped steps)."""
    h = sim.next_arrival_s()
    adm = sim.admission
    if adm:
        # Every step's end retries dispatch: each retry must do what the last one did, nothing.
        # Dispatch reads the queue's head and the entry instances' loads, and takes no time into
        # account; the entries change only at their own events (bounds below), the head only by
        # an arrival, a dispatch or a deadline.
        item = adm.policy.peek()
        if sim.config.admission.tpot_slo_s is not None or item is None or any(
                adm.backpressure.accepts(entry_load(e.core.scheduler, None), item.tier, item.rank) for e in sim.entry):
            return float("-inf")
        h = min(h, adm.next_deadline())
        if inst.kind != "decode":
            for other in sim.entry:
                if other is inst:
                    continue
                if other.layered is not None and other.pp > 1 and other.core.in_flight:
                    return float("-inf")
                if other.pp > 1:  # its next plan end, or its launch waiting for stage 0
                    if other.plan_ends:
                        h = min(h, other.plan_ends[0])
                    if other.launch_pending:
                        h = min(h, other.stage_free[0])
                elif other.core.in_flight or other.stage_free[0] > now:  # a step, or a jump's end
                    if other.launch_pending:
                        return float("-inf")
                    h = min(h, other.stage_free[0])
    if inst.kind != "decode":
        return h
    if sim.pending and not _no_room_for_pending(sim, inst, now):
        return float("-inf")
    for other in sim.instances:
        if other.kind != "prefill":
            continue
        if other.pp > 1:  # its plans in flight end at ``plan_ends``; a launch waiting for stage 0 comes first
            if other.layered is not None and other.core.in_flight:
                return float("-inf")
            ends = other.plan_ends
            if ends and ends[0] < h:
                h = ends[0]
            if other.launch_pending and other.stage_free[0] < h:
                h = other.stage_free[0]
        elif other.core.in_flight:
            if other.launch_pending:
                return float("-inf")
            if other.stage_free[0] < h:
                h = other.stage_free[0]
    for dst in sim.decodes:
        if dst.rx_ends and dst.rx_ends[0] < h:
            h = dst.rx_ends[0]
        if sim.pending and dst is not inst and (dst.core.in_flight or dst.stage_free[0] > now) and dst.stage_free[0] < h:
            h = dst.stage_free[0]  # its step's (or jump's) end: its finishes may make room
    return h


def _no_room_for_pending(sim: Simulation, inst: SimInstance, now: float) -> bool:
    """With finished prefills waiting for a decode instance, every step's end retries them: each
    retry must fail as the last one did, without side effects. True if no decode instance can
    ``reserve`` any lane's head now (a read-only check) and none changes before ``inst``'s jump
    ends: the others' events bound it (``horizon`` adds them here), ``inst`` frees no room in it
    (the jump stops before its first finish; its free blocks only shrink) and no other decode
    instance launches later at this instant."""
    heads: dict[object, tuple[SimInstance, Sequence, Sequence]] = {}
    lane = sim.lane_of
    for entry in sim.pending:
        heads.setdefault(lane(entry) if lane is not None else None, entry)
    for dst in sim.decodes:
        if dst is not inst and (dst.launch_due or dst.pp > 1 or dst.launch_pending):
            return False
        core = dst.core
        for _, _, copy in heads.values():
            if copy.seq_id not in core.seqs and core.decode.can_reserve(copy):
                return False
    return True


def fast_forward(sim: Simulation, inst: SimInstance, plan: StepPlan, now: float, t1: float, token_id: int,
                 finished: Callable[[SimInstance, float, list[Sequence]], None]) -> tuple[float, StepPlan | None] | None:
    """Apply the steady steps starting with ``plan`` (launched at ``now``, ending at ``t1``); None if the
    stretch is not steady (nothing changed then). Else ``(end_s, in_flight)``: the jump's last step,
    launched and in flight (``in_flight``, the plan ``schedule()`` makes for it), ends at ``end_s``
    for the caller to apply as any step; or ``in_flight`` is None and the instance launches its
    next step at ``end_s``. ``token_id``: the token every simulated step samples; ``finished(inst,
    end_s, seqs)``: the requests a jumped step ending at ``end_s`` finished (recorded then)."""
    core = inst.core
    sched = core.scheduler
    chunks = plan.chunks
    running = sched.running
    num_alive = len(chunks)
    # Prompts are planned after the decodes: a plan with one ends with it (checked first, it is the common no).
    if (not chunks or len(chunks[-1].token_ids) != 1 or plan.block_copies or plan.preempted_seq_ids
            or len(running) != num_alive or sched.isolated
            or core._deferred or sched.in_flight):  # noqa: SLF001 — read only: ops waiting for a step boundary
        return None
    h = horizon(sim, inst, now)
    if t1 > h:
        return None
    bm = sched.block_manager
    bs = bm.block_size
    static_budget = sched._static_budget  # noqa: SLF001 — read only
    waiting = sched.waiting
    # A finish frees a slot and blocks, which a waiting request or a migration waiting for room
    # (``_no_room_for_pending``) could take: then the jump stops before the first finish.
    hold = bool(waiting) or bool(sim.pending)
    if waiting:  # admission must stay impossible for the whole stretch
        if not static_budget:
            return None
        if not (num_alive >= sched.max_running or num_alive >= sched.config.max_num_seqs
                or (not bm.enable_prefix_caching and not bm.can_allocate(waiting[0]))):
            return None
    elif not static_budget and sched.config.max_num_batched_tokens < num_alive:
        return None
    max_model_len = sched.max_model_len
    eos = sched.eos_token_ids
    seqs: list[Sequence] = []
    starts: list[int] = []
    # The step (0-based) in which each sequence finishes: step k leaves it with num_output_tokens +
    # k + 1 outputs and start + k + 2 tokens; it stops where either reaches its limit.
    finish_at: dict[int, list[int]] = {}
    first_finish = last_finish = -1
    decode_ctx = 0
    max_start = -1
    for i, (chunk, seq) in enumerate(zip(chunks, running)):
        start = chunk.start_pos
        sp = seq.sampling
        if (seq.seq_id != chunk.seq_id or len(chunk.token_ids) != 1 or chunk.num_output_tokens < 1 or seq.isolate
                or token_id in sp.stop_token_ids or (not sp.ignore_eos and token_id in eos)
                or len(seq.block_table) != (start + bs) // bs or len(seq.block_hashes) != start // bs):
            return None
        f = min(sp.max_tokens - chunk.num_output_tokens, max_model_len - start - 1) - 1
        at = finish_at.get(f)
        if at is None:
            finish_at[f] = [i]
        else:
            at.append(i)
        if first_finish < 0 or f < first_finish:
            first_finish = f
        if f > last_finish:
            last_finish = f
        seqs.append(seq)
        starts.append(start)
        decode_ctx += start + 1
        if start > max_start:
            max_start = start
    limit = first_finish if hold else last_finish + 1  # steps applied before the last one
    if limit < 1:
        return None
    alive = [True] * num_alive
    # Sequences by the step at which they cross a block boundary: at step k, those with
    # (start + k) % bs == 0 filled a block in step k - 1's update and need a new one for step k.
    buckets: list[list[int]] = [[] for _ in range(bs)]
    for i, start in enumerate(starts):
        buckets[start % bs].append(i)
    step_time = inst.step_time
    observe = None if static_budget else sched.step_budget.observe
    log = inst.fast_forward_log = [] if sim.stop_when_set else None
    commit, append_slots = bm.commit, bm.append_slots
    seqs_by_id = core.seqs
    t = t1
    k = 1
    launched = False  # whether the jump ends with step k in flight (else the instance launches at t_k)
    while True:
        # Step k - 1's update, in batch order: the sequences that filled a block commit it, those
        # that reached their limit finish (and free their blocks).
        done = finish_at.get(k - 1)
        crossing, ended, ended_ctx = apply_update(seqs, starts, alive, buckets, k, done, t, token_id, commit, sched, seqs_by_id)
        if done:
            num_alive -= len(ended)
            decode_ctx -= ended_ctx  # their contexts in step k - 1
            finished(inst, t, ended)
            if num_alive and max_start in (starts[i] for i in done):
                max_start = max(s for s, a in zip(starts, alive) if a)
        if num_alive == 0:
            break
        # Step k's launch: the same batch, every context one longer, the next block for those crossing.
        decode_ctx += num_alive
        d = step_time(BatchShape(0, 0, 0, num_alive, decode_ctx, max_start + k + 1))
        t_next = t + d
        # The last step of the stretch is launched for real (in flight until t_next, applied by the
        # scheduler's own update), unless an event at t_k itself must see the instance before it.
        last = k >= limit or t_next > h
        if (last and not h > t) or len(crossing) > bm.num_free_blocks:  # (else the real scheduler preempts)
            break
        for i in crossing:
            append_slots(seqs[i], 1)
        taken = sched._finished_since_plan  # noqa: SLF001 — step k's plan takes them
        if taken:
            sched._finished_since_plan = []  # noqa: SLF001
        if log is not None:
            log.append((t, core.num_steps, inst.busy_s))
        if observe is not None:
            observe(num_alive, decode_ctx, 0, d)
        core.num_steps += 1
        core.last_step_s = d
        inst.busy_s += d
        if last:
            launched = True
            break
        t = t_next
        k += 1
    # Steps 0 .. k-1 applied: each running sequence has k more tokens, all but the newest computed.
    for seq, start, a in zip(seqs, starts, alive):
        if a:
            token_ids = seq.token_ids
            token_ids.extend([token_id] * (start + 1 + k - len(token_ids)))
            seq.num_computed_tokens = start + k
    first = core.in_flight.popleft()
    if not launched:
        inst.stage_free[0] = t
        return t, None
    # Step k in flight: the plan ``schedule()`` makes for it (decodes in batch order).
    step_k = StepPlan([
        ScheduledChunk(seq.seq_id, [token_id], start + k, seq.block_table[:], True, seq.sampling, chunk.num_output_tokens + k)
        for seq, start, a, chunk in zip(seqs, starts, alive, chunks) if a
    ], finished_seq_ids=taken)
    core.in_flight.append(PlanInFlight(step_k, first.plan_seq + k))
    inst.stage_free[0] = t_next
    return t_next, step_k


def undo_after(inst: SimInstance, stop_s: float) -> None:
    """The run stopped at ``stop_s`` in the middle of ``inst``'s jump: count only its steps launched
    before then, as the step-by-step run (which stops before that instant's launches) does."""
    log = inst.fast_forward_log
    if not log:
        return
    for launched_s, num_steps, busy_s in log:
        if launched_s >= stop_s:
            inst.core.num_steps, inst.busy_s = num_steps, busy_s
            break
    inst.fast_forward_log = None


def apply_update(seqs: list[Sequence], starts: list[int], alive: list[bool], buckets: list[list[int]], offset: int,
                 done: list[int] | None, now: float, token_id: int, commit: Callable[[Sequence], None], sched: Any,
                 seqs_by_id: dict[str, Sequence]) -> tuple[list[int], list[Sequence], int]:
    """A jumped step's update, in batch order, as ``update_from_output`` makes it: the sequences that
    filled a block (``buckets``: indices by start % block size) commit it, those in ``done`` reached
    their limit and finish (their blocks freed). ``offset``: the step's sequences have ``starts[i] +
    offset`` tokens computed. Returns the crossing indices (the bucket, finished ones removed), the
    finished sequences and the sum of their contexts."""
    bs = len(buckets)
    crossing = buckets[-offset % bs]
    order = sorted(set(done).union(crossing)) if done else crossing
    ended: list[Sequence] = []
    ended_ctx = 0
    for i in order:
        seq = seqs[i]
        n = starts[i] + offset
        token_ids = seq.token_ids
        token_ids.extend([token_id] * (n - len(token_ids)))
        seq.num_computed_tokens = n
        commit(seq)
        if done and i in done:
            token_ids.append(token_id)
            seq.finish_time = now
            sched.finish(seq, "length")
            del seqs_by_id[seq.seq_id]
            ended.append(seq)
            alive[i] = False
            buckets[starts[i] % bs].remove(i)  # crosses no more boundaries
            ended_ctx += n
    return crossing, ended, ended_ctx
