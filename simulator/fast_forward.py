"""Fast-forward: simulated instances go through steady stretches of decode steps without planning
each one, exactly — the rules every jump follows, and the ``horizon`` it never passes.

While an instance only decodes, step after step, each plan is the last one with every context one
token longer, minus the requests that reached their length: no prompt is admitted, nobody is
preempted. Running the real ``schedule()``/``update_from_output()`` for each of those steps costs
O(batch) Python per step. Instead the decoding sequences are kept in a compact form
(``simulator.lazy_batch``) from step to step — on a pp = 1 instance by ``simulator.lazy_decodes``,
each micro-batch of a pipelined one as a lane by ``simulator.lazy_lanes`` — and the real scheduler
plans only what else a step computes (``Scheduler.schedule(num_lazy_decodes=...)``), at the launches
where anything could change. Between those, the steady steps are applied in one go (a *jump*). For
the result to equal the step-by-step one:

* Step times are the latency model's, evaluated per step on each step's shape (``decode_ctx``
  grows by the batch size, ``decode_max_ctx`` by one; ``LatencyModel.decode_step_fn`` computes the
  same float without a ``BatchShape``) and added one at a time, as the event loop adds them, so
  every clock is bit-identical (a closed form would round differently).
* A request stops at its length (``max_tokens`` or ``max_model_len``; sampled tokens never stop a
  simulated request), known in advance: the jump finishes it through the scheduler's own
  ``finish`` in the step that reaches it, and ``Simulation`` records it by an event at that step's
  end, so ``stop_when`` sees finishes in time order. With requests waiting, a finish (a free slot,
  free blocks) could admit one: the jump stops before the first finish then.
* KV blocks: at a block boundary the real ``BlockManager`` gives the sequence its next block, and
  (with a prefix cache) the block that filled is ``commit``-ted, in the order the step-by-step run
  does them (commits of step ``k - 1``'s update, then allocations of step ``k``'s launch, each in
  batch order), so block ids, prefix-cache hashes and evictions are the same. A step that would
  need more blocks than are free (the real scheduler would preempt) is planned by it.
* Nothing outside the instance may look at or change it during the jump: the jump ends at or
  before the next event that could (``horizon``): the next arrival (admission, dispatch), and for
  a decode instance the next end of a prefill step (it may migrate a request here) and the next
  completed migration anywhere. An interacting event at exactly the stop is fine: events at one
  instant see the instance after its steps ending then and before its next launch, as here.
* Retries: every step's end retries the admission queue and the migration queue. A jump runs
  only where each retry would do nothing, as the last one did: no entry instance accepts the
  admission queue's head (dispatch reads no clock; its next deadline and the other entries'
  events bound the jump), and no decode instance can reserve a waiting prefill's room (the
  other decode instances' events bound it, and the instance stops before its first finish).
* The waiting queue: a stretch with requests waiting is steady only where their admission cannot
  change (the batch is at its cap, or the first waiting prompt's blocks do not fit, without a
  prefix cache, as free blocks only shrink in the jump), with the static step budget.

Not fast-forwarded (the step-by-step path runs): shared compute, cascade attention (its savings
depend on block tables), observers of every plan (``Simulation.on_plan``), prefill instances, a
colocated instance next to decode instances while prefills wait for room, crash suspects, forks
(``n`` > 1), live prefix groups. With TPOT backpressure (it reads each step's time) nothing is
jumped, but the decodes stay compact. ``_next_plan_seq`` (plan numbers, which only the Ray
runtime reads) is not advanced by a pp = 1 instance's lazy steps, and the instance core's step
histograms (``iteration_tokens``, ``step_seconds``: the runtime's /metrics) do not count jumped
steps: a simulation reports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distserve.engine.sequence import Sequence

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
                adm.backpressure.accepts(e.entry_load(None), item.tier, item.rank) for e in sim.entry):
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
