"""Structured output (constrained decoding) in the engines: every output matches its grammar, the in-process
disaggregated engine (the decode instance rebuilds each matcher by replaying the tokens the prefill instance
sampled) gives the colocated engine's output, ``n`` > 1 completions each follow the grammar, a complete
grammar ends the output without an extra step, and bad or too complex specs are refused naming their field."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from typing import Any

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
from distserve.engine.structured_output import MAX_PENDING_COMPILES, GrammarCompiler
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import InvalidConfigError, InvalidSamplingParamsError, QueueFullError
from distserve.runtime.local_disagg import LocalDisaggEngine
from distserve.serving.structured_request import structured_output_of

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


class HangingCompiler(GrammarCompiler):
    """A real llguidance compiler whose compiles of the regex ``hang...`` block until released: a compile that does
    not end, as a native library's could (only the hang is simulated; every other compile is real)."""

    def __init__(self, tiny: LoadedModel) -> None:
        super().__init__("llguidance", tiny.tokenizer, (1,), timeout_s=0.3)
        self.release = threading.Event()

    def _compile(self, spec: StructuredOutput) -> object:
        if spec.spec.startswith("hang"):
            self.release.wait(30)
        return super()._compile(spec)


def test_hung_compiles_cannot_starve_other_tenants(tiny: LoadedModel) -> None:
    """A tenant's compile that outlives its timeout keeps its thread, so each tenant gets one at most: its own next
    new spec is a 429, others' compile on the free thread; once every thread hangs, new specs are refused as busy
    (429, cancelled before they ran), never held; cached specs are always served."""
    compiler = HangingCompiler(tiny)
    compiler.backend()

    def check(owner: str, regex: str) -> None:
        asyncio.run(compiler.check_async(StructuredOutput("regex", regex, "guided_regex"), owner))

    try:
        with pytest.raises(InvalidSamplingParamsError, match="took longer than") as exc:
            check("mallory", "hang1")
        assert exc.value.param == "guided_regex" and compiler.num_in_flight("mallory") == 1
        with pytest.raises(QueueFullError, match="still compiling"):
            check("mallory", "[a-z]+")  # waited for mallory's earlier compile, in vain
        check("alice", "[0-9]{3}")  # the other thread
        with pytest.raises(InvalidSamplingParamsError, match="took longer than"):
            check("trudy", "hang2")  # now both threads hang
        t0 = time.monotonic()
        with pytest.raises(QueueFullError, match="busy compiling") as busy:
            check("bob", "[x-z]{2}")
        assert busy.value.param == "guided_regex" and time.monotonic() - t0 < 2
        check("bob", "[0-9]{3}")  # alice's, compiled: served from the cache
        for owner in range(MAX_PENDING_COMPILES - 2):  # queued behind the hung ones, up to the bound
            compiler.submit(StructuredOutput("regex", f"q{owner}", "guided_regex"), f"o{owner}")
        with pytest.raises(QueueFullError, match="grammars are compiling"):
            compiler.submit(StructuredOutput("regex", "one-too-many", "guided_regex"), "carol")
        compiler.release.set()
        assert wait_for(lambda: compiler.num_in_flight() == 0)
        check("mallory", "[a-z]+")
        check("bob", "[x-z]{2}")  # the cancelled compile was dropped from the cache, so it compiles now
    finally:
        compiler.release.set()
        compiler.close()


def wait_for(predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def test_schemas_nested_too_deeply_are_refused_before_compiling() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}  # two levels each
    for fields in ({"guided_json": deep}, {"guided_json": json.dumps(deep)}, {"guided_json": "[" * 100_000},
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}}):
        with pytest.raises(InvalidSamplingParamsError, match="nested more than 64 levels") as exc:
            structured_output_of(fields)
        assert exc.value.param in ("guided_json", "response_format.json_schema.schema")
