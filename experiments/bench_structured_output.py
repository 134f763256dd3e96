"""Structured-output grammar backends measured on one tokenizer: llguidance vs xgrammar.

On SmolLM2-135M's tokenizer (49,152 tokens; the tiny test tokenizer with --quick), for each backend of
``distserve.engine.grammar_backends``:

1. set-up: the backend's tables for the vocabulary (once per process);
2. compile: each case compiled afresh (no cache) — three JSON schemas, json_object, two regexes, a
   choice list, a GBNF grammar and a large schema (``anyOf`` of wide objects with bounded string
   patterns: the kind a hostile client sends) — plus its first mask, since llguidance compiles lazily
   and does part of its work there;
3. mask: a valid document of each case replayed token by token (fill the bitmask, accept the token):
   mean and p99 per token, the median over repeats;
4. end to end: a batch of chat requests on the real engine (``LLMEngine``), greedy, each run to the same
   number of tokens, unconstrained and under a JSON schema with each backend (the fastest of interleaved
   rounds): output tokens/s; and, under a bounded schema, whether every answer parses and validates.

The machine is shared: the CPU others used while each part ran is reported next to it. Prints a table,
writes JSON + markdown, ends with one JSON line of the figures.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import jsonschema
import numpy as np
import torch

import harness
from distserve.cli.arg_types import positive_int
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig, StructuredOutput
from distserve.engine.grammar_backends import DEFAULT_STRUCTURED_OUTPUT_BACKEND, STRUCTURED_OUTPUT_BACKENDS
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.structured_output import bitmask_width
from distserve.engine.weights import LoadedModel, load_model
from harness import Outputs

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]}}, "required": ["name", "age", "city"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"]}},
    "paid": {"type": "boolean"}, "note": {"type": ["string", "null"]}}, "required": ["id", "items", "paid"]}
PEOPLE = {"type": "array", "minItems": 1000, "items": PERSON}  # never complete within max_tokens: every run is max_tokens long
EVENT = {"type": "object", "properties": {
    "title": {"type": "string"}, "date": {"type": "string", "format": "date"},
    "attendees": {"type": "array", "items": {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                                                            "role": {"enum": ["host", "guest"]}}}},
    "location": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}}]}},
    "required": ["title", "date"]}


def wide_schema(num_fields: int, num_branches: int) -> dict[str, Any]:
    branch = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{1,{i + 5}}}"} for i in range(num_fields)},
              "required": [f"k{i}" for i in range(num_fields)]}
    return {"anyOf": [branch] * num_branches}


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))  # the one JSON layout both backends constrain to


def cases(quick: bool) -> list[tuple[str, StructuredOutput, str]]:
    """(name, spec, a valid output to replay)."""
    wide = wide_schema(8 if quick else 30, 3)
    wide_doc = {f"k{i}": "abcde" for i in range(8 if quick else 30)}
    return [
        ("json person", StructuredOutput("json", json.dumps(PERSON)), dumps({"name": "Ada Lovelace", "age": 36, "city": "London"})),
        ("json order", StructuredOutput("json", json.dumps(ORDER)),
         dumps({"id": "ABC-1234", "items": [{"sku": "x-1", "qty": 2, "price": 9.5}, {"sku": "y-22", "qty": 1, "price": 120.0}],
                "paid": True, "note": None})),
        ("json event", StructuredOutput("json", json.dumps(EVENT)),
         dumps({"title": "Launch review", "date": "2025-03-14", "attendees": [{"email": "ada@example.com", "role": "host"}],
                "location": {"lat": 48.85, "lon": 2.35}})),
        ("json_object", StructuredOutput("json_object"), dumps({"answer": "forty-two", "steps": [1, 2, 3], "ok": True})),
        ("regex phone", StructuredOutput("regex", r"\+[0-9]{1,3} [0-9]{3}-[0-9]{3}-[0-9]{4}"), "+44 207-946-0958"),
        ("regex email", StructuredOutput("regex", r"[a-z0-9._]{1,20}@[a-z0-9]{1,12}\.(com|org|net)"), "grace.hopper@navy.org"),
        ("choice", StructuredOutput("choice", json.dumps(["positive", "negative", "neutral", "mixed"])), "neutral"),
        ("gbnf arith", StructuredOutput("grammar", 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= num | "(" expr ")"\nnum ::= [0-9]+'),
         "(12+7)-(3+40)"),
        ("json wide (hostile)", StructuredOutput("json", json.dumps(wide)), dumps(wide_doc)),
    ]


def bench_backend(name: str, loaded: LoadedModel, stop_ids: tuple[int, ...], repeats: int, quick: bool) -> dict[str, Any]:
    tok = loaded.tokenizer
    vocab = tok.vocab_size
    t0 = time.perf_counter()
    backend = STRUCTURED_OUTPUT_BACKENDS[name](tok.hf, vocab, stop_ids)
    result: dict[str, Any] = {"setup_s": time.perf_counter() - t0, "cases": {}}
    row = np.zeros(bitmask_width(vocab), dtype=np.int32)
    for case, spec, doc in cases(quick):
        t0 = time.perf_counter()
        compiled = backend.compile(spec)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        backend.matcher(compiled).fill_bitmask(row)
        first_mask_s = time.perf_counter() - t0
        ids = tok.encode(doc, add_special_tokens=False)
        means, p99s = [], []
        for _ in range(repeats):
            matcher = backend.matcher(compiled)
            per_token = []
            for token in ids:
                t0 = time.perf_counter()
                matcher.fill_bitmask(row)
                ok = matcher.accept(token)
                per_token.append(time.perf_counter() - t0)
                assert ok, f"{name}: {case}: the valid document's token {token} was refused"
            means.append(statistics.fmean(per_token))
            p99s.append(float(np.percentile(per_token, 99)))
        result["cases"][case] = {"compile_ms": compile_s * 1e3, "first_mask_ms": first_mask_s * 1e3, "num_tokens": len(ids),
                                 "mask_us_mean": statistics.median(means) * 1e6, "mask_us_p99": statistics.median(p99s) * 1e6}
    return result


def engine_for(loaded: LoadedModel, backend: str) -> LLMEngine:
    return LLMEngine(loaded, cache_config=CacheConfig(kv_cache_memory_gb=0.25), scheduler_config=SchedulerConfig(structured_output_backend=backend))


def throughput(engines: dict[str, LLMEngine], prompts: list[list[int]], max_tokens: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Output tokens/s of ``prompts`` in one batch, each run to exactly ``max_tokens`` tokens: unconstrained
    (EOS ignored) and under PEOPLE with each backend (a list longer than ``max_tokens`` can hold, so the
    grammar never ends it). Rounds interleave the runs; each keeps its fastest round (the machine is shared)."""
    runs = {key: SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=key == "unconstrained",
                                structured=None if key == "unconstrained" else StructuredOutput("json", json.dumps(PEOPLE)))
            for key in engines}
    for key, engine in engines.items():
        engine.generate(prompts[:1], runs[key])  # warm-up (and the backend's tables and the grammar, once)
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for key, engine in engines.items():
            (seconds, num_tokens), others = harness.watched(lambda: timed_generate(engine, prompts, runs[key]))
            assert num_tokens == len(prompts) * max_tokens, (key, num_tokens)
            if key not in best or seconds < best[key]["seconds"]:
                best[key] = {"seconds": seconds, "tok_s": num_tokens / seconds, "num_tokens": num_tokens, "other_cores": round(others, 2)}
    return best


def timed_generate(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sampling)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def validity(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[int, str]:
    """How many answers under PERSON parse and validate (greedy), and the first answer."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=StructuredOutput("json", json.dumps(PERSON))))
    valid = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o.text), PERSON)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid, outs[0].text


def main() -> None:
    ap = harness.parser(__doc__, "tiny tokenizer and model, small cases, 2 repeats")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--num-prompts", type=positive_int, default=8)
    ap.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per request in the throughput runs")
    ap.add_argument("--valid-max-tokens", type=positive_int, default=96, help="token limit of the validity run (the answers end before it)")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    args = ap.parse_args()
    if args.quick:
        args.model, args.repeats, args.num_prompts, args.max_tokens, args.rounds = "tiny", 2, 2, 16, 1
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    stop_ids = tuple(sorted(set(loaded.config.eos_token_ids) | set(tok.eos_token_ids)))
    backends = sorted(STRUCTURED_OUTPUT_BACKENDS)
    figures: dict[str, Any] = {"quick": args.quick, "model": args.model, "vocab_size": tok.vocab_size, "backends": backends,
                               "default_backend": DEFAULT_STRUCTURED_OUTPUT_BACKEND, "repeats": args.repeats}
    micro: dict[str, dict[str, Any]] = {}
    for name in backends:
        micro[name], others = harness.watched(lambda: bench_backend(name, loaded, stop_ids, args.repeats, args.quick))
        micro[name]["other_cores"] = round(others, 2)
    topics = ["a violinist", "a sailor", "a chemist", "a gardener", "a pilot", "a baker", "a poet", "a judge"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe {topics[i % len(topics)]} as JSON with name, age and city."}])
               for i in range(args.num_prompts)]
    engines = {key: engine_for(loaded, DEFAULT_STRUCTURED_OUTPUT_BACKEND if key == "unconstrained" else key)
               for key in ["unconstrained", *backends]}
    runs = throughput(engines, prompts, args.max_tokens, args.rounds)
    for name in backends:
        runs[name]["num_valid"], runs[name]["sample"] = validity(engines[name], prompts, args.valid_max_tokens)

    case_names = list(micro[backends[0]]["cases"])
    for name in backends:
        figures[f"{name}_setup_s"] = round(micro[name]["setup_s"], 3)
        figures[f"{name}_other_cores_micro"] = micro[name]["other_cores"]
        for field in ("compile_ms", "first_mask_ms", "mask_us_mean", "mask_us_p99"):
            figures[f"{name}_{field}"] = {c: round(micro[name]["cases"][c][field], 3) for c in case_names}
        figures[f"{name}_compile_plus_first_mask_ms_total"] = round(
            sum(micro[name]["cases"][c]["compile_ms"] + micro[name]["cases"][c]["first_mask_ms"] for c in case_names), 2)
        figures[f"{name}_mask_us_mean_geomean"] = round(
            float(np.exp(np.mean([np.log(micro[name]["cases"][c]["mask_us_mean"]) for c in case_names]))), 2)
    for key, run in runs.items():
        figures[f"e2e_{key}_tok_s"] = round(run["tok_s"], 2)
        figures[f"e2e_{key}_num_tokens"] = run["num_tokens"]
        figures[f"e2e_{key}_other_cores"] = run["other_cores"]
        if key != "unconstrained":
            figures[f"e2e_{key}_num_valid"] = run["num_valid"]
            figures[f"e2e_{key}_tok_s_vs_unconstrained"] = round(run["tok_s"] / runs["unconstrained"]["tok_s"], 3)
    figures["e2e_num_prompts"] = args.num_prompts
    figures["e2e_sample"] = runs[DEFAULT_STRUCTURED_OUTPUT_BACKEND]["sample"]
    figures["faster_compile"] = min(backends, key=lambda b: figures[f"{b}_compile_plus_first_mask_ms_total"])
    figures["faster_mask"] = min(backends, key=lambda b: figures[f"{b}_mask_us_mean_geomean"])
    figures["faster_e2e"] = max(backends, key=lambda b: figures[f"e2e_{b}_tok_s"])

    rows = [[case, *(f"{micro[b]['cases'][case]['compile_ms']:.1f} + {micro[b]['cases'][case]['first_mask_ms']:.1f}" for b in backends),
             *(f"{micro[b]['cases'][case]['mask_us_mean']:.0f} / {micro[b]['cases'][case]['mask_us_p99']:.0f}" for b in backends)]
            for case in case_names]
    columns = ["case", *(f"{b} compile + 1st mask ms" for b in backends), *(f"{b} mask µs/token mean / p99" for b in backends)]
    harness.rich_table(f"{args.model} ({tok.vocab_size} tokens): compile and per-token mask", columns, rows, left=("case",))
    e2e_rows = [[key, f"{run['tok_s']:.1f}", str(run["num_tokens"]), "-" if key == "unconstrained" else f"{run['num_valid']}/{args.num_prompts}",
                 f"{run['other_cores']:.2f}"] for key, run in runs.items()]
    harness.rich_table(f"end to end: {args.num_prompts} chat requests x {args.max_tokens} tokens, greedy (valid: a run under a bounded schema)",
                       ["run", "tok/s", "tokens", "valid JSON", "others' cores"], e2e_rows, left=("run",))

    out = Outputs.for_run(args, "bench_structured_output")
    out.json(figures)
    md = [f"Model {args.model} ({tok.vocab_size} tokens), {args.repeats} repeats, {args.threads} torch threads. "
          f"Others' CPU during the micro-benchmarks: " + ", ".join(f"{b} {micro[b]['other_cores']:.2f} cores" for b in backends) + ".",
          "", "| case | " + " | ".join(columns[1:]) + " |", "|---" * len(columns) + "|"]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ["", "| run | tok/s | tokens | valid JSON | others' cores |", "|---|---|---|---|---|"]
    md += ["| " + " | ".join(r) + " |" for r in e2e_rows]
    md += ["", "Backend set-up (vocabulary tables): " + ", ".join(f"{b} {micro[b]['setup_s']:.2f} s" for b in backends) + "."]
    out.markdown(md)
    harness.finish(figures)


if __name__ == "__main__":
    main()
