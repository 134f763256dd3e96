"""``n`` > 1: the prompt is prefilled once and its KV forked (copy-on-write) to n completions,
in the colocated engine and the in-process disaggregated engine."""

from __future__ import annotations

import pytest

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.frontend import EngineBase
from distserve.engine.outputs import RequestOutput
from distserve.engine.sequence import Sequence, completion_sampling
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import InvalidSamplingParamsError
from distserve.runtime.local_disagg import LocalDisaggEngine

CACHE = CacheConfig(num_blocks=256, block_size=4)
PROMPT = "Hello, my name is something quite long"  # 39 tokens: 9 full blocks and a partly filled one
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, n=3)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def run(engine: EngineBase, request_id: str) -> dict[int, list[RequestOutput]]:
    """Every output of ``request_id`` until it finishes, by completion index."""
    by_index: dict[int, list[RequestOutput]] = {}
    done = False
    while not done:
        for out in engine.step():
            if out.request_id == request_id:
                by_index.setdefault(out.index, []).append(out)
                done = out.finished
    return by_index


def prefill_tokens(engine: EngineBase) -> int:
    stats = engine.stats()
    return int(stats["prefill_tokens_computed_total"])  # type: ignore[arg-type]


def alone(engine: EngineBase, sampling: SamplingParams) -> list[int]:
    return engine.generate(PROMPT, sampling)[0].token_ids


@pytest.mark.parametrize("kind", ["colocated", "disagg"])
def test_prompt_prefilled_once_and_each_completion_matches_its_own_seeded_run(tiny: LoadedModel, kind: str) -> None:
    engine: EngineBase = LLMEngine(tiny, cache_config=CACHE) if kind == "colocated" else LocalDisaggEngine(tiny, cache_config=CACHE)
    num_prompt = len(engine.tokenizer.encode(PROMPT))
    engine.add_request(PROMPT, SEEDED, request_id="r")
    outs = run(engine, "r")
    assert prefill_tokens(engine) == num_prompt  # not n * num_prompt: computed once
    assert sorted(outs) == [0, 1, 2]
    finals = {i: o[-1] for i, o in outs.items()}
    assert all(f.finish_reason == "length" and len(f.token_ids) == 8 for f in finals.values())
    assert sum(o.finished for o in sum(outs.values(), [])) == 1  # the request finishes once, with its last completion
    assert len({tuple(f.token_ids) for f in finals.values()}) == 3  # each samples its own tokens
    # Forked KV is the prompt's KV: completion i equals a request of its own with completion i's seed
    # (prefilled by itself), and completion 0 is what n = 1 gives.
    for i, final in finals.items():
        assert final.token_ids == alone(engine, completion_sampling(SEEDED, i)), i
    assert alone(engine, completion_sampling(SEEDED, 0)) == alone(engine, SamplingParams(max_tokens=8, seed=7, ignore_eos=True))
    # Same seed, same n: the same completions again.
    engine.add_request(PROMPT, SEEDED, request_id="again")
    assert {i: o[-1].token_ids for i, o in run(engine, "again").items()} == {i: f.token_ids for i, f in finals.items()}


def test_disagg_migrates_the_full_blocks_once(tiny: LoadedModel) -> None:
    engine = LocalDisaggEngine(tiny, cache_config=CACHE)
    engine.add_request(PROMPT, SEEDED, request_id="r")
    run(engine, "r")
    stats = engine.stats()
    # 39 tokens in blocks of 4: completion 0 moves 10 blocks; each other completion only the partly
    # filled last one (its 9 full blocks are on the decode instance already, shared by content hash).
    assert stats["kv_migration_blocks_total"] == 10 + 1 + 1
    assert stats["kv_migration_blocks_skipped_total"] == 9 + 9
    assert all(i.core.block_manager.usage == 0 for i in (*engine.prefill, *engine.decode))


def test_greedy_completions_share_blocks_copy_on_write(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, cache_config=CACHE)
    copies: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def spy(plan):  # type: ignore[no-untyped-def]
        copies.extend(plan.block_copies)
        return execute(plan)

    engine.runner.execute = spy  # type: ignore[method-assign]
    free = engine.block_manager.num_free_blocks
    engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, n=4), request_id="g")
    engine.step()  # the one prefill, four first tokens
    seqs = [engine._seqs[s] for s in ("g", "g#1", "g#2", "g#3")]
    assert len({tuple(s.block_table) for s in seqs}) == 1  # all four hold the prompt's 10 blocks
    assert free - engine.block_manager.num_free_blocks == 10
    outs = run(engine, "g")
    # Each of the four copied the shared partly filled block before writing its first generated token
    # (the last to write found it no longer shared), and all decoded the same greedy tokens.
    assert len(copies) == 3
    assert len({tuple(o[-1].token_ids) for o in outs.values()}) == 1
    assert engine.block_manager.num_free_blocks == free


def test_abort_aborts_every_completion_and_frees_the_blocks(tiny: LoadedModel) -> None:
    for engine in (LLMEngine(tiny, cache_config=CACHE), LocalDisaggEngine(tiny, cache_config=CACHE)):
        engine.add_request(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True, n=3), request_id="a")
        for _ in range(3):
            engine.step()
        engine.abort_request("a")
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.num_requests == 0
        cores = [engine.core] if isinstance(engine, LLMEngine) else [i.core for i in (*engine.prefill, *engine.decode)]
        assert all(c.block_manager.usage == 0 and not c.seqs for c in cores)


def test_abort_before_the_prefill_aborts_the_riding_completions(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, cache_config=CACHE)
    engine.add_request(PROMPT, SamplingParams(max_tokens=5, n=3), request_id="a")
    engine.abort_request("a")
    assert engine.step() == [] and not engine.has_unfinished_requests() and engine.num_requests == 0
    assert prefill_tokens(engine) == 0


def test_admission_counts_n_sequences_and_blocks(tiny: LoadedModel) -> None:
    # Batches of 4 sequences: an n = 3 request does not start while two other sequences run.
    engine = LLMEngine(tiny, cache_config=CACHE, scheduler_config=SchedulerConfig(max_num_seqs=4))
    engine.add_request("a b", SamplingParams(max_tokens=6, ignore_eos=True, temperature=0, n=2), request_id="two")
    engine.step()
    engine.add_request(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0, n=3), request_id="three")
    first_tokens: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            first_tokens.setdefault(out.request_id, step)
        assert engine.scheduler.num_running <= 4
    assert first_tokens["three"] >= 5  # waited for "two" (2 sequences) to finish its 6 tokens
    with pytest.raises(InvalidSamplingParamsError) as exc:
        engine.add_request(PROMPT, SamplingParams(n=5))
    assert exc.value.param == "n"
    with pytest.raises(InvalidSamplingParamsError) as exc:
        engine.generate(PROMPT, SamplingParams(n=2))  # one output per prompt: refused, not one completion of two
    assert exc.value.param == "n"


def test_block_manager_reserves_a_block_per_fork() -> None:
    bm = BlockManager(num_blocks=11, block_size=4)
    seq = Sequence("s", list(range(39)), SamplingParams())
    assert bm.can_allocate(seq)  # 10 blocks
    seq.forks = [Sequence("s#1", list(range(39)), SamplingParams()), Sequence("s#2", list(range(39)), SamplingParams())]
    assert not bm.can_allocate(seq)  # 10 + one per fork > 11


def test_n_is_validated() -> None:
    with pytest.raises(InvalidSamplingParamsError) as exc:
        SamplingParams(n=0)
    assert exc.value.param == "n"
    assert completion_sampling(SamplingParams(seed=3, n=4), 0).seed == 3
    seeds = {completion_sampling(SamplingParams(seed=3, n=4), i).seed for i in range(4)}
    assert len(seeds) == 4 and all(completion_sampling(SamplingParams(seed=3, n=4), i).n == 1 for i in range(4))


def test_many_forked_requests_under_preemption_match_n1(tiny: LoadedModel) -> None:
    # A cache too small for all of them at once: sequences are preempted and recomputed, forked
    # blocks freed and copied; greedy completions all equal the n = 1 answer of their prompt.
    prompts = [f"request {i}: " + "tell me something " * (i % 3 + 1) for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = [out.token_ids for out in LLMEngine(tiny, cache_config=CACHE).generate(prompts, greedy)]
    engine = LLMEngine(tiny, cache_config=CacheConfig(num_blocks=48, block_size=4))
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=3), request_id=f"r{i}")
    finals: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finish_reason is not None:
                finals[(out.request_id, out.index)] = out.token_ids
    assert engine.scheduler.num_preemptions > 0
    assert finals == {(f"r{i}", k): reference[i] for i in range(6) for k in range(3)}
    assert engine.block_manager.num_free_blocks == 48 and engine.num_requests == 0


def test_a_failed_step_reruns_every_completion(tiny: LoadedModel) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = LLMEngine(tiny, cache_config=CACHE).generate(PROMPT, greedy)[0].token_ids
    engine = LLMEngine(tiny, cache_config=CACHE)
    engine.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=3), request_id="g")
    engine.add_request("poison", SamplingParams(max_tokens=6), request_id="p")
    engine.runner.inject_step_fault("p")  # every step computing "p" fails: the engine resets and re-runs all
    finals: dict[tuple[str, int], RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step_or_recover():
            if out.finish_reason is not None:
                finals[(out.request_id, out.index)] = out
    assert finals[("p", 0)].finish_reason == "error"
    assert {k: o.token_ids for k, o in finals.items() if k[0] == "g"} == {("g", i): reference for i in range(3)}
    assert engine.num_requests == 0 and engine.block_manager.num_free_blocks == CACHE.num_blocks


def test_prefill_instances_admit_a_prompt_of_n_completions_as_one_prefill(tiny: LoadedModel) -> None:
    # Prefill batches of 2 sequences, n = 4: the completions wait for migration, not in the batch.
    engine = LocalDisaggEngine(tiny, cache_config=CACHE, prefill_scheduler_config=SchedulerConfig(max_num_seqs=2))
    engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, n=4), request_id="r")
    outs = run(engine, "r")
    assert sorted(outs) == [0, 1, 2, 3] and prefill_tokens(engine) == len(engine.tokenizer.encode(PROMPT))
