"""Structured output (constrained decoding) in the engines: every output matches its grammar, the in-process
disaggregated engine (the decode instance rebuilds each matcher by replaying the tokens the prefill instance
sampled) gives the colocated engine's output, ``n`` > 1 completions each follow the grammar, a complete
grammar ends the output without an extra step, and bad or too complex specs are refused naming their field."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from distserve.config import CacheConfig, SamplingParams, SchedulerConfig, StructuredOutput
from distserve.engine.grammar_backends import STRUCTURED_OUTPUT_BACKENDS, choice_regex
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.frontend import EngineBase
from distserve.engine.outputs import RequestOutput
from distserve.engine.sampler import process_logits
from distserve.engine.structured_output import GrammarCompiler
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import InvalidConfigError, InvalidSamplingParamsError
from distserve.runtime.local_disagg import LocalDisaggEngine

pytestmark = pytest.mark.timeout(180)
CACHE = CacheConfig(num_blocks=512, block_size=4)
PROMPTS = ["Hello, my name is", "The capital of France"]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "n", "color"], "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'  # GBNF


def spec_and_check() -> list[tuple[StructuredOutput, object]]:
    def valid_json(text: str) -> None:
        jsonschema.validate(json.loads(text), SCHEMA)

    return [
        (StructuredOutput("json", json.dumps(SCHEMA), "response_format"), valid_json),
        (StructuredOutput("regex", REGEX, "guided_regex"), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        (StructuredOutput("choice", json.dumps(CHOICES), "guided_choice"), lambda t: t in CHOICES or pytest.fail(t)),
        (StructuredOutput("grammar", GRAMMAR, "guided_grammar"), lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t) or pytest.fail(t)),
    ]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def engine_of(kind: str, tiny: LoadedModel, backend: str) -> EngineBase:
    config = SchedulerConfig(structured_output_backend=backend)
    if kind == "colocated":
        return LLMEngine(tiny, cache_config=CACHE, scheduler_config=config)
    return LocalDisaggEngine(tiny, cache_config=CACHE, decode_scheduler_config=config, prefill_scheduler_config=config)


def completions(engine: EngineBase, prompt: str, sampling: SamplingParams) -> list[RequestOutput]:
    """The last output of each completion of one request (``n`` of them)."""
    rid = engine.add_request(prompt, sampling)
    last: dict[int, RequestOutput] = {}
    while len(last) < sampling.n or not all(o.finish_reason for o in last.values()):
        for out in engine.step():
            if out.request_id == rid:
                last[out.index] = out
    return [last[i] for i in sorted(last)]


@pytest.mark.parametrize("backend", sorted(STRUCTURED_OUTPUT_BACKENDS))
def test_outputs_match_their_grammar_and_disaggregated_equals_colocated(tiny: LoadedModel, backend: str) -> None:
    colocated, disagg = engine_of("colocated", tiny, backend), engine_of("disagg", tiny, backend)
    for spec, check in spec_and_check():
        greedy = SamplingParams(max_tokens=48, temperature=0.0, structured=spec)
        ours = colocated.generate(PROMPTS, greedy)
        theirs = disagg.generate(PROMPTS, greedy)
        for a, b in zip(ours, theirs):
            assert a.finish_reason == "stop", (spec.kind, a.text)
            check(a.text)  # type: ignore[operator]
            assert a.token_ids == b.token_ids and b.finish_reason == "stop"
        # Sampled, n = 3: each completion has its own matcher (forked from the leader's first row).
        for engine in (colocated, disagg) if spec.kind == "regex" else (colocated,) if spec.kind != "json" else ():
            outs = completions(engine, PROMPTS[0], SamplingParams(max_tokens=32, temperature=1.0, seed=3, n=3, structured=spec))
            assert len(outs) == 3
            for out in outs:
                assert out.finish_reason == "stop", (spec.kind, out.text)
                check(out.text)  # type: ignore[operator]
    cores = [colocated.core, *(i.core for i in disagg.prefill + disagg.decode)]  # type: ignore[attr-defined]
    assert all(core.grammars is not None and len(core.grammars) == 0 for core in cores)  # every matcher dropped


def test_a_complete_grammar_ends_the_output_without_an_eos_step(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, cache_config=CACHE)
    spec = StructuredOutput("choice", json.dumps(["yes"]), "guided_choice")
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, structured=spec))[0]
    assert out.text == "yes" and out.finish_reason == "stop"
    assert out.token_ids == engine.tokenizer.encode("yes", add_special_tokens=False)  # no EOS sampled after it
    # An unconstrained request batched with it is unaffected.
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = engine.generate(PROMPTS[1], plain)[0].token_ids
    both = engine.generate(PROMPTS, [SamplingParams(max_tokens=20, temperature=0.0, structured=spec), plain])
    assert both[1].token_ids == alone and both[0].text == "yes"


@pytest.mark.parametrize("backend", sorted(STRUCTURED_OUTPUT_BACKENDS))
def test_bad_specs_are_refused_naming_their_field(tiny: LoadedModel, backend: str) -> None:
    engine = engine_of("colocated", tiny, backend)
    bad = [
        StructuredOutput("regex", "([a-z]", "guided_regex"),
        StructuredOutput("json", '{"type": "objectx"}', "response_format"),
        StructuredOutput("json", "not json", "guided_json"),
        StructuredOutput("grammar", "root ::= (", "guided_grammar"),
        StructuredOutput("choice", "[]", "guided_choice"),
    ]
    for spec in bad:
        with pytest.raises(InvalidSamplingParamsError) as exc:
            engine.add_request(PROMPTS[0], SamplingParams(structured=spec))
        assert exc.value.param == spec.param and spec.param in str(exc.value)
    assert engine.num_requests == 0
    with pytest.raises(InvalidSamplingParamsError):
        StructuredOutput("yaml", "x")
    with pytest.raises(InvalidConfigError):
        SchedulerConfig(structured_output_backend="outlines")


def test_a_grammar_too_slow_to_compile_is_refused(tiny: LoadedModel) -> None:
    # xgrammar precomputes a token cache per state: 3 x 40 bounded string fields take ~0.3 s on the tiny vocabulary.
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{1,%d}" % (i + 5)} for i in range(40)},
                         "required": [f"k{i}" for i in range(40)]} for _ in range(3)]}
    compiler = GrammarCompiler("xgrammar", tiny.tokenizer, (1,), timeout_s=0.02)
    compiler.backend()
    with pytest.raises(InvalidSamplingParamsError, match="took longer than") as exc:
        compiler.check(StructuredOutput("json", json.dumps(schema), "guided_json"))
    assert exc.value.param == "guided_json"
    compiler.close()


def test_bitmasks_set_disallowed_logits_to_minus_infinity() -> None:
    logits = torch.arange(2 * 70, dtype=torch.float32).reshape(2, 70)  # [2, 70]; the masks cover 64 tokens
    mask = np.array([(1 << 3) | (1 << 31), 1 << 0], dtype=np.uint32).view(np.int32)  # tokens 3, 31 and 32
    out = process_logits(logits, [SamplingParams(), SamplingParams()], [0, 0], [], None, [None, mask])  # the sampler's pipeline
    assert torch.equal(out[0], logits[0]) and out is not logits
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed == [3, 31, 32]  # bits past the mask's 64 tokens are disallowed too
    assert torch.equal(logits, torch.arange(2 * 70, dtype=torch.float32).reshape(2, 70))  # not mutated


def test_choice_regex_escapes_metacharacters() -> None:
    pattern = choice_regex(json.dumps(["a.b", "(x|y)", "1+1=2"]))
    assert [bool(re.fullmatch(pattern, s)) for s in ("a.b", "(x|y)", "1+1=2", "axb", "x")] == [True, True, True, False, False]
