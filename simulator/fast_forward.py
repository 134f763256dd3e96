"""Fast-forward: a simulated instance skips a steady stretch of decode steps in one jump, exactly.

While an instance only decodes the same sequences, step after step, each plan is the last one
with every context one token longer: no prompt is admitted, nothing finishes, nobody is preempted.
Running the real ``schedule()``/``update_from_output()`` for each of those steps costs O(batch)
Python per step; here the steps are applied in one go, and the real scheduler plans again at the
first step where anything could change.

``fast_forward`` is called when an instance launches a plan ``P`` (step 0) at ``t0``. If the
stretch is steady it applies steps ``0 .. V-1`` at once and returns ``t_V``, the end of step
``V - 1``, where the simulation relaunches the instance (``Simulation`` queues a marker event
there in place of ``P``'s completion). For the result to equal the step-by-step one:

* Step times are the latency model's, evaluated per step on each step's shape (``decode_ctx``
  grows by the batch size, ``decode_max_ctx`` by one) and added one at a time, as the event loop
  adds them, so every clock is bit-identical (a closed form would round differently).
* No step in the jump finishes a request (``max_tokens``, ``max_model_len``; sampled tokens never
  stop a simulated request), so every record is written by the real scheduler's last step.
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
* The waiting queue: a stretch with requests waiting is steady only where their admission cannot
  change (the batch is at its cap, or the first waiting prompt's blocks do not fit, without a
  prefix cache, as free blocks only shrink in the jump), with the static step budget.

Not jumped (the step-by-step path runs): pipelined instances (pp > 1), shared compute, cascade
attention (its savings depend on block tables), observers of every plan (``Simulation.on_plan``),
a non-empty admission queue or migration queue (each step's end retries them), crash suspects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distserve.engine.step_plan import StepPlan
from simulator.latency import BatchShape

if TYPE_CHECKING:
    from simulator.simulation import Simulation
    from simulator.sim_instance import SimInstance


def horizon(sim: Simulation, inst: SimInstance) -> float:
    """The earliest instant an event could read or change ``inst`` (inf: none is scheduled);
    -inf when that cannot be bounded cheaply (a pipelined prefill instance is busy)."""
    h = sim.next_arrival_s()
    if inst.kind != "decode":
        return h
    for other in sim.instances:
        if other.kind == "prefill" and other.core.in_flight:
            if other.pp > 1 or other.launch_pending:
                return float("-inf")  # its micro-batches end at times not kept here
            if other.stage_free[0] < h:
                h = other.stage_free[0]
    for dst in sim.decodes:
        if dst.rx_ends and dst.rx_ends[0] < h:
            h = dst.rx_ends[0]
    return h


def fast_forward(sim: Simulation, inst: SimInstance, plan: StepPlan, t1: float, token_id: int) -> float | None:
    """Apply the steady steps starting with ``plan`` (launched now, ending at ``t1``); returns the
    instant the instance launches next (``t_V``), or None if the stretch is not steady (nothing
    changed then). ``token_id``: the token every simulated step samples."""
    core = inst.core
    sched = core.scheduler
    chunks = plan.chunks
    running = sched.running
    num_seqs = len(chunks)
    if (not chunks or plan.block_copies or plan.preempted_seq_ids or len(running) != num_seqs or sched.isolated
            or core._deferred or sched.in_flight):  # noqa: SLF001 — read only: ops waiting for a step boundary
        return None
    h = horizon(sim, inst)
    if t1 > h:
        return None
    bm = sched.block_manager
    bs = bm.block_size
    static_budget = sched._static_budget  # noqa: SLF001 — read only
    if sched.waiting:  # admission must stay impossible for the whole stretch
        if not static_budget:
            return None
        if not (num_seqs >= sched.max_running or num_seqs >= sched.config.max_num_seqs
                or (not bm.enable_prefix_caching and not bm.can_allocate(sched.waiting[0]))):
            return None
    elif not static_budget and sched.config.max_num_batched_tokens < num_seqs:
        return None
    max_model_len = sched.max_model_len
    eos = sched.eos_token_ids
    seqs = []
    starts = []
    max_steps = max_model_len
    decode_ctx = max_ctx = 0
    for chunk, seq in zip(chunks, running):
        start = chunk.start_pos
        sp = seq.sampling
        if (seq.seq_id != chunk.seq_id or len(chunk.token_ids) != 1 or chunk.num_output_tokens < 1 or seq.isolate
                or token_id in sp.stop_token_ids or (not sp.ignore_eos and token_id in eos)
                or len(seq.block_table) != (start + bs) // bs or len(seq.block_hashes) != start // bs):
            return None
        # Step k (0-based) leaves it with num_output_tokens + k + 1 outputs and start + k + 2 tokens:
        # it finishes at the step where either reaches its limit; only the steps before may be jumped.
        left = min(sp.max_tokens - chunk.num_output_tokens, max_model_len - start - 1)
        if left < max_steps:
            max_steps = left
        seqs.append(seq)
        starts.append(start)
        decode_ctx += start + 1
        if start + 1 > max_ctx:
            max_ctx = start + 1
    max_steps -= 1  # steps that finish nothing
    if max_steps < 1:
        return None
    # Sequences by the step offset at which they cross a block boundary: at step k, those with
    # (start + k) % bs == 0 filled a block in step k - 1's update and need a new one for step k.
    buckets: list[list[int]] = [[] for _ in range(bs)]
    for i, start in enumerate(starts):
        buckets[start % bs].append(i)
    step_time = inst.step_time
    observe = None if static_budget else sched.step_budget.observe
    log = inst.fast_forward_log = [] if sim.stop_when_set else None
    commit, append_slots = bm.commit, bm.append_slots
    t = t1
    k = 1
    while True:
        crossing = buckets[-k % bs]
        for i in crossing:  # step k - 1's update: these sequences filled a block
            seq = seqs[i]
            n = starts[i] + k
            token_ids = seq.token_ids
            token_ids.extend([token_id] * (n - len(token_ids)))
            seq.num_computed_tokens = n
            commit(seq)
        if k >= max_steps:
            break
        decode_ctx += num_seqs
        max_ctx += 1
        d = step_time(BatchShape(0, 0, 0, num_seqs, decode_ctx, max_ctx))
        t_next = t + d
        if t_next > h or len(crossing) > bm.num_free_blocks:
            break
        for i in crossing:  # step k's launch: the next block of each, in batch order
            append_slots(seqs[i], 1)
        if log is not None:
            log.append((t, core.num_steps, inst.busy_s))
        if observe is not None:
            observe(num_seqs, decode_ctx, 0, d)
        core.num_steps += 1
        core.last_step_s = d
        inst.busy_s += d
        t = t_next
        k += 1
    # Steps 0 .. k-1 applied: each sequence has k more tokens, all but the newest computed.
    for seq, start in zip(seqs, starts):
        token_ids = seq.token_ids
        token_ids.extend([token_id] * (start + 1 + k - len(token_ids)))
        seq.num_computed_tokens = start + k
    core.in_flight.popleft()
    inst.stage_free[0] = t
    return t


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
