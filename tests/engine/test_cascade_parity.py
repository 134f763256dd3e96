"""Cascade decode attention in the real engines: greedy tokens are identical with cascade on and off
(fp32), on a two-level tree of shared prompts, colocated and disaggregated (where prefix-aware
migration places the shared blocks once on the decode instance and cascade reads them there); the
cascade path really ran (counted plans); SmolLM2 too (slow tier)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from distserve.config import CacheConfig, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.local_disagg import LocalDisaggEngine
from kernels.backends import get_decode_attention
from kernels.cascade_attention import ALWAYS, CascadeDecodeAttention, CascadePlan

BS = 16
SYSTEM = [(11 * i) % 240 + 3 for i in range(20 * BS)]  # 320 tokens shared by all eight
DOCS = [[(13 * i + 5 * d) % 240 + 3 for i in range(22 * BS)] for d in range(2)]  # 352 more per half
PROMPTS = [SYSTEM + DOCS[i % 2] + [200 + i, 30 + 7 * i, 99] for i in range(8)]
GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny", "float32")


@pytest.fixture
def cascade_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CascadePlan]]:
    """The cascade plans the shared ``cascade`` backend runs (one per layer per step), every shared
    node kept: parity is the point here, not whether these short prompts pay (``CascadeRule``)."""
    backend = get_decode_attention("cascade")
    assert isinstance(backend, CascadeDecodeAttention)
    monkeypatch.setattr(backend, "rule", ALWAYS)
    seen: list[CascadePlan] = []
    forward = backend.forward

    def spy(query, k_cache, v_cache, plan, scale):  # type: ignore[no-untyped-def]
        if isinstance(plan, CascadePlan):
            seen.append(plan)
        return forward(query, k_cache, v_cache, plan, scale)

    monkeypatch.setattr(backend, "forward", spy)
    yield seen


def outputs(engine: LLMEngine | LocalDisaggEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs, after one request that leaves the system prompt in the prefix cache (so every
    prompt shares its blocks: two prompts that differ after it would compute it side by side)."""
    engine.generate([SYSTEM + [7]], SamplingParams(max_tokens=1, temperature=0.0))
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


def test_colocated_greedy_identical_with_cascade_on_and_off(tiny: LoadedModel, cascade_steps: list[CascadePlan]) -> None:
    def engine(backend: str) -> LLMEngine:
        return LLMEngine(tiny, cache_config=CacheConfig(num_blocks=256, block_size=BS, decode_attention=backend))

    off = outputs(engine("exact"), PROMPTS)
    assert not cascade_steps
    on = outputs(engine("cascade"), PROMPTS)
    assert on == off
    assert cascade_steps, "no step ran the cascade path"
    # The two-level tree: the system prompt for all eight, each document for its four.
    deepest = max(cascade_steps, key=lambda p: (len(p.nodes), p.num_decodes))
    assert sorted(len(n.members) for n in deepest.nodes) == [4, 4, 8]
    assert deepest.num_parts == 3


def test_disaggregated_cascade_reads_migrated_shared_blocks(tiny: LoadedModel, cascade_steps: list[CascadePlan]) -> None:
    """Prefix-aware migration places the shared prompt once on the decode instance; cascade finds
    those shared blocks there."""
    def engine(backend: str) -> LocalDisaggEngine:
        return LocalDisaggEngine(tiny, cache_config=CacheConfig(num_blocks=256, block_size=BS, decode_attention=backend))

    off = outputs(engine("exact"), PROMPTS)
    on_engine = engine("cascade")
    on = outputs(on_engine, PROMPTS)
    assert on == off
    assert cascade_steps
    assert any(len(p.nodes) == 3 for p in cascade_steps)
    decode_blocks = {b for p in cascade_steps for t in p.node_blocks for b in t.tolist()}
    assert len(decode_blocks) >= len(SYSTEM) // BS  # the system prompt's blocks, each once


def test_default_backend_is_cascade_and_a_lone_request_runs_exact(tiny: LoadedModel, cascade_steps: list[CascadePlan]) -> None:
    engine = LLMEngine(tiny, cache_config=CacheConfig(num_blocks=64, block_size=BS))
    assert engine.runner.decode_attention == "cascade"
    outputs(engine, PROMPTS[:1])
    assert not cascade_steps  # nothing shared: every step planned the exact path


@pytest.mark.slow
def test_smollm2_greedy_identical_with_cascade_on_and_off(cascade_steps: list[CascadePlan]) -> None:
    loaded = load_model("smollm2-135m", "float32")
    tok = loaded.tokenizer
    system = "You are a careful assistant for a hardware store. " * 30  # ~300 tokens shared by all
    questions = ["How do I fix a leaking tap?", "Which drill for concrete?", "Best glue for wood?",
                 "How to paint a door?", "What size screws for shelves?", "How to cut tiles?",
                 "Do I need a primer?", "How to unclog a drain?"]
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}]) for q in questions]

    def engine(backend: str) -> LLMEngine:
        return LLMEngine(loaded, cache_config=CacheConfig(num_blocks=512, block_size=BS, decode_attention=backend))

    sp = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)
    off = [o.token_ids for o in engine("exact").generate(prompts, sp)]
    on = [o.token_ids for o in engine("cascade").generate(prompts, sp)]
    assert on == off
    assert cascade_steps and max(len(p.nodes[0].members) for p in cascade_steps) == len(prompts)


def test_backend_names_are_checked_where_configured() -> None:
    from distserve.errors import InvalidConfigError
    from distserve.serving.app_config import ServeAppConfig

    with pytest.raises(InvalidConfigError, match="decode_attention must be one of"):
        CacheConfig(decode_attention="flash9")
    app = ServeAppConfig.from_args({"decode_attention": "exact", "model": "tiny"}).resolve()
    assert app.deployment.cache_config is not None and app.deployment.cache_config.decode_attention == "exact"


def test_a_backend_that_cannot_run_here_is_refused_at_start(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU: flashinfer (CUDA only) and triton without its interpreter fail when the engine is
    built, as a DistServeError naming ``decode_attention`` (the CLI prints it, exit code 2) — not at
    every step."""
    from distserve.errors import InvalidConfigError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for backend in ("flashinfer", "triton"):
        with pytest.raises(InvalidConfigError, match=f"decode attention '{backend}'") as err:
            LLMEngine(tiny, cache_config=CacheConfig(num_blocks=16, block_size=BS, decode_attention=backend))
        assert err.value.param == "decode_attention"
