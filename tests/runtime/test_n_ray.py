"""``n`` > 1 on the Ray runtime (1P1D): one prefill on the prefill instance samples the n first tokens,
each completion migrates (the shared full blocks once) and decodes on the decode instance; abort ends all;
penalties and logprobs give what the colocated engine gives."""

from __future__ import annotations

from typing import Any

import pytest

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.outputs import RequestOutput
from distserve.engine.weights import load_model
from distserve.placement import Placement
from serving_util import ControllerRuntime, wait_until

pytestmark = pytest.mark.timeout(300)

CACHE = CacheConfig(num_blocks=256, block_size=4)
PROMPT = "Hello, my name is something quite long"  # 39 tokens: 9 full blocks and a partly filled one
N = 3
SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=N)


def test_n_completions_on_ray(ray_cluster: Any) -> None:
    reference = LLMEngine(load_model("tiny", "float32"), cache_config=CACHE).generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    rt = ControllerRuntime(Placement.disaggregated(), CACHE, SP)
    try:
        async def collect(request_id: str, sampling: SamplingParams) -> list[RequestOutput]:
            return [out async for out in rt.controller.generate(PROMPT, sampling, request_id)]

        outs: list[RequestOutput] = rt.run(collect("n3", SP), timeout_s=120)
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        finals = {o.index: o for o in outs if o.finish_reason is not None}
        assert sorted(finals) == list(range(N)) and all(o.error is None for o in finals.values())
        # Greedy: every completion decodes the n = 1 answer from the forked KV.
        assert all(o.token_ids == reference.token_ids for o in finals.values())
        stats = rt.stats()
        assert stats["prefill_tokens_computed_total"] == len(reference.prompt_token_ids)  # prefilled once, not N times
        assert stats["num_migrations"] == N  # each completion migrates, prompt KV and its own first token
        assert stats["kv_migration_blocks_skipped_total"] >= 9  # the shared full blocks crossed at most twice
        assert wait_until(rt.all_freed, 20)

        async def abort_midway() -> None:
            stream = rt.controller.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True, n=N), "long")
            got = 0
            async for out in stream:
                got += bool(out.new_token_ids)
                if got >= 2 * N:
                    break
            await stream.aclose()  # closing the stream aborts every completion

        rt.run(abort_midway(), timeout_s=120)
        assert wait_until(rt.all_freed, 30), rt.stats()
        assert not rt.controller._seqs and not rt.controller._groups

        # Penalties, bias, min_p and logprobs: the prefill instance computes the prompt logprobs and the first
        # tokens, the decode workers the rest from the token history in their plans; the same as colocated.
        features = SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True, n=2, repetition_penalty=1.3,
                                  frequency_penalty=0.5, presence_penalty=0.5, min_p=0.05, logit_bias={9: -5.0},
                                  logprobs=True, top_logprobs=3, prompt_logprobs=2)
        colocated = LLMEngine(load_model("tiny", "float32"), cache_config=CACHE)
        colocated.add_request(PROMPT, features, request_id="ref")
        expected = {}
        while colocated.has_unfinished_requests():
            expected.update({o.index: o for o in colocated.step() if o.finish_reason is not None})
        got = {o.index: o for o in rt.run(collect("features", features), timeout_s=120) if o.finish_reason is not None}
        assert sorted(got) == sorted(expected) == [0, 1]
        for index, out in got.items():
            ref = expected[index]
            assert out.error is None and out.token_ids == ref.token_ids
            assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            assert out.top_logprobs is not None and ref.top_logprobs is not None
            assert [[t for t, _ in top] for top in out.top_logprobs] == [[t for t, _ in top] for top in ref.top_logprobs]
            assert out.prompt_logprobs is not None and ref.prompt_logprobs is not None
            assert out.prompt_logprobs.logprobs == pytest.approx(ref.prompt_logprobs.logprobs, abs=1e-4)
            assert out.prompt_logprobs.ranks == ref.prompt_logprobs.ranks
    finally:
        rt.close()
