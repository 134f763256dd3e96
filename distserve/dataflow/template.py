"""Semantic functions: a prompt template with named ``{{placeholders}}``, parsed and checked once.

A semantic call (Parrot's ``POST /v1/semantic_call``) sends a ``template`` and one description per
placeholder: an **input** (a literal ``value``, an existing semantic variable ``var_id``, or
neither — a new variable the client sets later) or an **output** (generated, with its own
sampling settings, into a new variable or into the existing one its ``var_id`` names: a client
that creates its variables first can then submit a consumer before its producer, in one round). ``parse_call`` turns that into a ``SemanticCall``: the template split into
text and placeholder chunks, the placeholders by name, and the sampling of every output.

The rules, each refused with a ``DataflowError`` naming the problem (HTTP 400 with ``param``):
a placeholder is ``{{name}}`` with a Python-identifier name (anything else between ``{{ }}`` is a
malformed template); every placeholder in the template is described and every description is
used; an output appears exactly once and never right after another output (the boundary between
two generated texts would be unknown); an input is given a value or a variable, not both, and
may carry declarative ``transforms`` (``dataflow.transforms``). Text after the last output is
not sent (nothing reads it), as in Parrot.

``model_type`` (Parrot's field) says what the engine is sent: ``token_id`` (the default) — the
prompt as token ids built piece by piece at placeholder boundaries, so shared prefixes keep
their ids — or ``text``, the rendered string, tokenized by the engine as a whole
(``dataflow.prompts`` has the exact recipe). The template, and every literal value, may be at
most ``SessionLimits.max_value_chars`` long (``ValueTooLarge``, HTTP 413).

Both Parrot's field name (``placeholders``) and the name of its public API docs (``parameters``)
are accepted. Sampling uses Parrot's ``SamplingConfig`` fields (``max_gen_length``,
``ignore_tokenizer_eos``, ``stop_str``, ...) or ours (``max_tokens``, ``ignore_eos``, ``stop``,
``top_k``, ``seed``, ``min_tokens``); fields we do not implement are refused unless they carry
their no-op default, never ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distserve.config import SamplingParams
from distserve.dataflow.limits import DEFAULT_LIMITS, SessionLimits
from distserve.dataflow.transforms import Transform, parse_transforms
from distserve.errors import DataflowError, InvalidSamplingParamsError

PLACEHOLDER = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}")
MAX_PLACEHOLDERS = 256
MODEL_TYPES = ("token_id", "text")
DEFAULT_MAX_GEN_LENGTH = 512  # Parrot's SamplingConfig default

# Parrot's SamplingConfig fields -> ours (same meaning).
_PARROT_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "max_gen_length": "max_tokens",
    "ignore_tokenizer_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "stop_str": "stop",
}
_OUR_SAMPLING = {"temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "stop_token_ids", "stop", "seed", "min_tokens"}
# Parrot fields we do not implement, accepted only with the value that means "off".
_NO_OP_SAMPLING: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "n": 1, "best_of": 1, "logit_bias": None,
    "repetition_penalty": 0.0, "length_penalty": 0.0,
}


@dataclass(frozen=True)
class TextChunk:
    text: str


@dataclass(frozen=True)
class PlaceholderChunk:
    name: str


Chunk = TextChunk | PlaceholderChunk


@dataclass(frozen=True)
class Placeholder:
    """One described placeholder: an input (``value``, ``var_id`` or neither) or an output (``sampling``, optional ``var_id``)."""

    name: str
    is_output: bool
    var_id: str | None = None
    value: str | None = None
    sampling: SamplingParams | None = None  # outputs only
    transforms: tuple[Transform, ...] = ()  # inputs only: applied to the value when the call is rendered

    @property
    def needs_new_variable(self) -> bool:
        """No variable given and no literal value: the server creates the variable (an output's or an unset input's)."""
        return self.var_id is None and self.value is None


@dataclass(frozen=True)
class SemanticCall:
    """A parsed call: the chunks to send (text after the last output dropped) and its placeholders."""

    chunks: tuple[Chunk, ...]
    placeholders: Mapping[str, Placeholder] = field(default_factory=dict)
    model_type: str = "token_id"  # what the engine is sent: token ids built piecewise, or the rendered text

    @property
    def outputs(self) -> list[Placeholder]:
        """Output placeholders in template order."""
        return [self.placeholders[c.name] for c in self.chunks if isinstance(c, PlaceholderChunk) and self.placeholders[c.name].is_output]

    @property
    def inputs(self) -> list[Placeholder]:
        """Input placeholders, each once, in order of first use."""
        seen: dict[str, Placeholder] = {}
        for c in self.chunks:
            if isinstance(c, PlaceholderChunk) and not self.placeholders[c.name].is_output:
                seen.setdefault(c.name, self.placeholders[c.name])
        return list(seen.values())


def parse_call(template: object, placeholders: object, *, model_type: object = "token_id", limits: SessionLimits = DEFAULT_LIMITS) -> SemanticCall:
    """Parse and check a semantic call's ``template`` and placeholder descriptions (see the module docstring)."""
    if not isinstance(template, str) or not template:
        raise DataflowError("template must be a non-empty string", "template")
    limits.check_chars(template, "template", "template")
    if model_type not in MODEL_TYPES:
        raise DataflowError(f"model_type must be one of {list(MODEL_TYPES)}, got {model_type!r}", "model_type")
    if not isinstance(placeholders, Sequence) or isinstance(placeholders, (str, bytes)):
        raise DataflowError("placeholders must be a list of objects", "placeholders")
    if len(placeholders) > MAX_PLACEHOLDERS:
        raise DataflowError(f"at most {MAX_PLACEHOLDERS} placeholders, got {len(placeholders)}", "placeholders")
    described: dict[str, Placeholder] = {}
    for i, raw in enumerate(placeholders):
        ph = _placeholder(raw, i, limits)
        if ph.name in described:
            raise DataflowError(f"placeholder {ph.name!r} is described twice", "placeholders")
        described[ph.name] = ph

    chunks = _split(template)
    used = [c.name for c in chunks if isinstance(c, PlaceholderChunk)]
    for name in used:
        if name not in described:
            raise DataflowError(f"placeholder {{{{{name}}}}} in the template is not described in placeholders", "placeholders")
    unused = sorted(set(described) - set(used))
    if unused:
        raise DataflowError(f"placeholders {unused} are described but not in the template", "placeholders")
    outputs = [name for name in used if described[name].is_output]
    if not outputs:
        raise DataflowError("a semantic call needs at least one output placeholder", "placeholders")
    twice = sorted({n for n in outputs if outputs.count(n) > 1})
    if twice:
        raise DataflowError(f"output placeholders {twice} appear more than once in the template", "template")
    for prev, cur in zip(chunks, chunks[1:]):
        if isinstance(prev, PlaceholderChunk) and isinstance(cur, PlaceholderChunk) and described[prev.name].is_output and described[cur.name].is_output:
            raise DataflowError(f"outputs {{{{{prev.name}}}}} and {{{{{cur.name}}}}} are adjacent: put text between them", "template")
    last = max(i for i, c in enumerate(chunks) if isinstance(c, PlaceholderChunk) and described[c.name].is_output)
    return SemanticCall(tuple(chunks[: last + 1]), described, str(model_type))


def _split(template: str) -> list[Chunk]:
    chunks: list[Chunk] = []
    pos = 0
    for m in PLACEHOLDER.finditer(template):
        if m.start() > pos:
            chunks.append(TextChunk(template[pos : m.start()]))
        chunks.append(PlaceholderChunk(m.group(1)))
        pos = m.end()
    if pos < len(template):
        chunks.append(TextChunk(template[pos:]))
    for c in chunks:
        if isinstance(c, TextChunk) and "{{" in c.text:
            start = c.text.index("{{")
            snippet = c.text[start : start + 40]
            raise DataflowError(f"malformed placeholder {snippet!r}: a placeholder is {{{{name}}}} with a letter, digit or _ name", "template")
    return chunks


def _placeholder(raw: object, index: int, limits: SessionLimits) -> Placeholder:
    where = f"placeholders[{index}]"
    if not isinstance(raw, Mapping):
        raise DataflowError(f"{where} must be an object", "placeholders")
    unknown = sorted(set(raw) - {"name", "is_output", "var_id", "value", "sampling_config", "transforms"})
    if unknown:
        raise DataflowError(f"{where} has unknown fields {unknown}", "placeholders")
    name, is_output = raw.get("name"), raw.get("is_output", False)
    if not isinstance(name, str) or not PLACEHOLDER.fullmatch(f"{{{{{name}}}}}"):
        raise DataflowError(f"{where}.name must be an identifier, got {name!r}", "placeholders")
    if not isinstance(is_output, bool):
        raise DataflowError(f"{where}.is_output must be true or false", "placeholders")
    var_id, value, sampling = raw.get("var_id"), raw.get("value"), raw.get("sampling_config")
    if var_id is not None and (not isinstance(var_id, str) or not var_id):
        raise DataflowError(f"{where}.var_id must be a variable id string", "placeholders")
    if value is not None and not isinstance(value, str):
        raise DataflowError(f"{where}.value must be a string", "placeholders")
    if value is not None:
        limits.check_chars(value, f"{where}.value", "placeholders")
    if is_output:
        if value is not None or raw.get("transforms") is not None:
            raise DataflowError(f"output {name!r} is generated: it takes no value or transforms", "placeholders")
        return Placeholder(name, True, var_id=var_id, sampling=sampling_params(sampling, f"{where}.sampling_config"))
    if sampling is not None:
        raise DataflowError(f"input {name!r} is not generated: it takes no sampling_config", "placeholders")
    if var_id is not None and value is not None:
        raise DataflowError(f"input {name!r} takes a var_id or a value, not both", "placeholders")
    transforms = parse_transforms(raw.get("transforms"), f"{where}.transforms")
    return Placeholder(name, False, var_id=var_id, value=value, transforms=transforms)


def sampling_params(raw: object, where: str = "sampling_config") -> SamplingParams:
    """Our ``SamplingParams`` from Parrot's ``SamplingConfig`` fields or ours (``None``: Parrot's defaults)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise DataflowError(f"{where} must be an object", "sampling_config")
    kwargs: dict[str, Any] = {"max_tokens": DEFAULT_MAX_GEN_LENGTH}
    for key, value in raw.items():
        if key in _NO_OP_SAMPLING:
            if value != _NO_OP_SAMPLING[key]:
                raise DataflowError(f"{where}.{key} is not supported (only {_NO_OP_SAMPLING[key]!r})", "sampling_config")
            continue
        ours = _PARROT_SAMPLING.get(key, key if key in _OUR_SAMPLING else None)
        if ours is None:
            raise DataflowError(f"{where} has unknown field {key!r}", "sampling_config")
        if ours == "stop" and value is None:
            continue
        kwargs[ours] = value
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParamsError as exc:
        raise DataflowError(f"{where}: {exc}", "sampling_config") from exc
    except TypeError as exc:  # e.g. a list where a number belongs
        raise DataflowError(f"{where}: {exc}", "sampling_config") from exc
