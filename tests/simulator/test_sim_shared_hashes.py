"""A synthetic request's block hashes are computed once per simulation (``Simulation._filler_hashes``),
not once per request, and they are the ones the block manager computes from the tokens: the same
requests with their prompt tokens spelled out (hashed block by block by the ``BlockManager``) give
the same records, with and without a prefix cache."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from distserve.engine.block_manager import prefix_block_hashes
from distserve.engine.sequence import Sequence
from distserve.placement import Placement
from simulator.latency import RooflineLatencyModel
from simulator.metrics import RequestRecord, SimResult
from simulator.simulation import SAMPLED_TOKEN, SimConfig, Simulation
from simulator.sim_instance import SimInstance
from simulator.workload import generate_requests


class CheckedSimulation(Simulation):
    """Checks every finished request's hash cache against its tokens."""

    num_checked = 0

    def _record_finish(self, inst: SimInstance, seq: Sequence, now: float) -> None:
        bs = self.config.block_size
        n = min(len(seq.prefix_hashes), seq.num_tokens // bs)  # (the last token's block has no KV: maybe never hashed)
        # Its prompt's blocks at least: without a prefix cache a lazy decode's blocks are committed (hashed)
        # only if it is handed back, as nothing reads their hashes (``simulator.lazy_batch``).
        need = (seq.num_tokens - 1) // bs if self.config.enable_prefix_caching else len(seq.prompt_token_ids) // bs
        assert n >= need and (seq.hashed_block_size == bs or not seq.prefix_hashes)
        assert seq.prefix_hashes[:n] == prefix_block_hashes(seq.token_ids, bs)[:n]
        self.num_checked += 1
        super()._record_finish(inst, seq, now)


def records(res: SimResult) -> list[tuple[object, ...]]:
    return [tuple(getattr(r, f.name) for f in fields(RequestRecord)) for r in res.records]


@pytest.mark.parametrize("placement", [Placement.colocated_instances(1), Placement.disaggregated(1, 1)], ids=["colocated", "1p1d"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_shared_filler_hashes_change_nothing(placement: Placement, prefix_caching: bool) -> None:
    latency = RooflineLatencyModel("facebook/opt-13b", "a100-80g")
    config = SimConfig(enable_prefix_caching=prefix_caching)
    synthetic = generate_requests("chatbot", 8.0, 120, seed=3, max_total_len=2048)
    spelled = [replace(r, prompt_token_ids=(SAMPLED_TOKEN,) * r.prompt_len) for r in synthetic]
    sim = CheckedSimulation(placement, latency, config)
    fast = sim.run(synthetic)
    assert sim.num_checked == len(synthetic) and sim.num_fast_forward_steps > 0
    slow = CheckedSimulation(placement, latency, config).run(spelled)
    assert records(fast) == records(slow)
    assert fast.instances == slow.instances and fast.duration_s == slow.duration_s
    assert fast.num_prefix_cache_hit_tokens == slow.num_prefix_cache_hit_tokens
    assert (fast.num_prefix_cache_hit_tokens > 0) == prefix_caching  # identical prompts: the cache hits, if on
