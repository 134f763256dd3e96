"""Admission in the simulation (a mixin of ``Simulation``): arriving requests wait in the runtime's
admission queue (``distserve.cluster.admission``) until an entry (prefill or colocated) instance
accepts them under backpressure, and are routed by the runtime's rules (``distserve.cluster.routing``).

A dispatch attempt at the end of an instant reads the queue's head and the entry instances' loads
and takes no time into account; one that dispatched nothing is not repeated until the queue or an
entry instance changed (or a deadline or the TPOT rule calls for it): it would do nothing again
(``_admission_stale``; ``Simulation.run`` checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mypy_extensions import mypyc_attr

from distserve.cluster.admission import AdmissionItem, AdmissionQueue, EntryLoad, measured_tpot_s
from distserve.cluster.backpressure import decode_headroom, decode_room_tokens, held_prompt_tokens, held_requests
from distserve.cluster.routing import entry_hashes, pick_entry
from distserve.config import SamplingParams
from distserve.engine.block_manager import prefix_block_hashes
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import SampledToken
from distserve.errors import QueueFullError
from simulator.sim_config import SimConfig
from simulator.sim_instance import SharedCompute, SimInstance, route_of
from simulator.sim_migration import SimMigrations

if TYPE_CHECKING:
    from simulator.metrics import RequestRecord
    from simulator.workload import Request

SAMPLED_TOKEN = 1  # the token every simulated step "samples"; never an EOS (ignore_eos is set anyway)
_SAMPLING: dict[int, SamplingParams] = {}  # a synthetic request's sampling, by its output length
_FILLER_HASHES: dict[int, list[int]] = {}  # block size -> the chained hashes of SAMPLED_TOKEN blocks made so far


def filler_hashes(num_tokens: int, block_size: int) -> list[int]:
    """The content hashes of the full blocks of ``num_tokens`` SAMPLED_TOKENs (at least; a prefix of one
    list for every run, made once per process: every probe of a planner search reads it). Slice, don't change."""
    hashes = _FILLER_HASHES.get(block_size)
    if hashes is None or len(hashes) < num_tokens // block_size:
        hashes = _FILLER_HASHES[block_size] = prefix_block_hashes([SAMPLED_TOKEN] * num_tokens, block_size)
    return hashes


@mypyc_attr(allow_interpreted_subclasses=True)
class SimAdmission(SimMigrations):
    """``Simulation``'s admission: the attributes below are ``Simulation``'s."""

    config: SimConfig
    admission: AdmissionQueue
    records: dict[str, RequestRecord]
    entry: list[SimInstance]
    decodes: list[SimInstance]
    shared: SharedCompute | None
    _sampled: dict[str, SampledToken]
    _filler_hashes: list[int]
    _admit_due: bool
    _admission_stale: bool

    def _launch_at_end(self, inst: SimInstance) -> None: ...  # Simulation's

    def _push_completions(self, group: list[SimInstance]) -> None: ...  # Simulation's

    def _arrive(self, r: Request, now: float, prompts: dict[int, list[int]]) -> int:
        """Queue a request arriving at ``now`` for admission; returns 1 if it was refused (it ends here)."""
        if r.prompt_token_ids is not None:
            prompt = list(r.prompt_token_ids)
        else:
            cached = prompts.get(r.prompt_len)
            if cached is None:
                cached = prompts[r.prompt_len] = [SAMPLED_TOKEN] * r.prompt_len
            prompt = cached
        sampling = _SAMPLING.get(r.output_len)
        if sampling is None:  # frozen: one per output length, for every simulation
            sampling = _SAMPLING[r.output_len] = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        seq = Sequence(str(r.req_id), prompt, sampling, arrival_time=now, priority=r.priority, request_class=r.request_class)
        if r.prompt_token_ids is None:  # the hashes the block manager would compute, block by block (``_hashes_upto``)
            seq.prefix_hashes = self._filler_hashes[: (r.prompt_len + r.output_len) // self.config.block_size]
            seq.hashed_block_size = self.config.block_size
        item = AdmissionItem(seq.seq_id, r.request_class, r.prompt_len + r.output_len, now, r.priority, r.timeout_s, seq,
                             num_prompt_tokens=r.prompt_len)
        try:
            waiting = 0 if self.admission.max_queue_delay_s is None else sum(i.core.scheduler.num_waiting for i in self.entry)
            self.admission.push(item, now, waiting)
        except QueueFullError:
            self.records[seq.seq_id].dropped = "rejected"
            return 1
        self._admit_due = self._admission_stale = True
        return 0

    def _admit(self, now: float) -> int:
        """Drop the requests past their deadline, then dispatch while entry instances accept
        (``AdmissionQueue.dispatch``); returns how many were dropped."""
        self._admission_stale = False  # (a dispatched request's entry launches: stale again then)
        expired = self.admission.expire(now)
        for item in expired:
            rec = self.records[item.request_id]
            rec.dropped, rec.admission_wait_s = "rejected" if item.shed else "expired", item.wait_s
        block_size, prefix_caching, router = self.config.block_size, self.config.enable_prefix_caching, self.config.router
        tpot = room = headroom = None
        slo = self.config.admission.tpot_slo_s
        if slo is not None:
            # A stage takes ``last_step_s`` per micro-batch: a request's token comes every ``pp`` of them.
            decoding = [(i.core.scheduler.num_running, i.core.last_step_s * i.pp) for i in self.decodes or self.entry]
            tpot = measured_tpot_s(decoding)
            if self.decodes:
                room = decode_room_tokens((i.core.num_free_blocks * block_size for i in self.decodes),
                                          (held_prompt_tokens(i.core.scheduler) for i in self.entry))
                if self.config.decode_headroom:
                    headroom = decode_headroom(decoding, slo, sum(held_requests(i.core.scheduler) for i in self.entry))

        def load(inst: SimInstance) -> EntryLoad:
            return inst.entry_load(tpot, room, headroom)

        def place(item: AdmissionItem, accepting: list[SimInstance]) -> SimInstance:
            seq: Sequence = item.payload
            seq.dispatch_time, seq.admission_rank = now, item.rank  # the entry scheduler keeps the admission order
            hashes = entry_hashes(seq, block_size, prefix_caching)
            return pick_entry(accepting, route_of, hashes, router, seq.seq_id, seq.request_class)

        for item, inst in self.admission.dispatch(now, self.entry, load, place):
            seq = item.payload
            self._sampled[seq.seq_id] = SampledToken(seq.seq_id, SAMPLED_TOKEN)
            self.records[seq.seq_id].admission_wait_s = item.wait_s
            inst.core.add(seq)
            inst.last_load = None
            if inst.layered is not None:
                self._push_completions(inst.layered.arrived(inst, seq, now, self.shared))
            self._launch_at_end(inst)
        return len(expired)
