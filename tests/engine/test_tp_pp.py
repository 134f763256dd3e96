"""Real tensor and pipeline parallelism over gloo: TP=2, PP=2 and both give the TP=1/PP=1 greedy tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distserve.config import SamplingParams, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.model_runner import ModelRunner
from distserve.engine.parallel import build_parallel_state
from distserve.engine.shard import ShardSpec
from distserve.engine.scheduler import Scheduler
from distserve.engine.sequence import Sequence
from distserve.engine.weights import load_model
from distserve.errors import InvalidConfigError
from distserve.ports import free_port

PROMPTS = ["Hello, my name is", "The capital of France is", "a b c d e f g h i j k l m n o p"]
SP = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
NUM_BLOCKS, BLOCK_SIZE = 128, 4


def worker(rank: int, tp: int, pp: int, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * pp)
    try:
        shard = ShardSpec(tp=tp, pp=pp, tp_rank=rank % tp, pp_rank=rank // tp)
        state = build_parallel_state(shard, list(range(tp * pp)))
        loaded = load_model("tiny")
        runner = ModelRunner(loaded.config, loaded.state_dict, NUM_BLOCKS, BLOCK_SIZE, parallel=state)
        # Every rank runs the same deterministic scheduler; the driver's tokens are broadcast back.
        sched = Scheduler(SchedulerConfig(), BlockManager(NUM_BLOCKS, BLOCK_SIZE), 1024)
        seqs = {}
        for i, p in enumerate(PROMPTS):
            seq = Sequence(f"r{i}", loaded.tokenizer.encode(p), SP, arrival_time=float(i))
            seqs[seq.seq_id] = seq
            sched.add(seq)
        driver = (pp - 1) * tp
        while sched.has_unfinished():
            plan = sched.schedule()
            sampled = runner.execute(plan)
            box = [sampled]
            dist.broadcast_object_list(box, src=driver)
            sched.update_from_output(plan, box[0], seqs, 0.0)
        if rank == driver:
            results.put([seqs[f"r{i}"].output_token_ids for i in range(len(PROMPTS))])
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    engine = LLMEngine(load_model("tiny"))
    return [o.token_ids for o in engine.generate(PROMPTS, SP)]


@pytest.mark.integration  # spawns processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_matches_single_worker(tp: int, pp: int, reference: list[list[int]]) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, tp, pp, free_port_once(tp, pp), results)) for r in range(tp * pp)]
    for p in procs:
        p.start()
    got = results.get(timeout=200)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == reference


_PORTS: dict[tuple[int, int], int] = {}


def free_port_once(tp: int, pp: int) -> int:
    """One port per configuration, shared by its processes."""
    if (tp, pp) not in _PORTS:
        _PORTS[(tp, pp)] = free_port()
    return _PORTS[(tp, pp)]


def test_shard_spec_rejects_bad_splits() -> None:
    cfg = load_model("tiny").config  # 4 heads, 2 KV heads, 2 layers, intermediate 128
    with pytest.raises(InvalidConfigError):
        ShardSpec(tp=3).validate(cfg)
    with pytest.raises(InvalidConfigError):
        ShardSpec(pp=3).validate(cfg)
    ShardSpec(tp=4, pp=2).validate(cfg)  # KV heads replicated over 4 ranks
