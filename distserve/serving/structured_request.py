"""The request fields that constrain a completion's output, as the engine's ``StructuredOutput``: OpenAI's
``response_format``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
its newer ``structured_outputs`` object, and the JSON schema a forced tool call must match (``tool_choice``
"required" or a named function, built as vLLM builds it).

A request gives at most one constraint. Malformed fields raise ``InvalidSamplingParamsError`` naming the
field (HTTP 400); whether a schema, regex or grammar compiles is checked by the grammar backend
(``engine.structured_output.GrammarCompiler``), which names the same field.
"""

from __future__ import annotations

import json
from typing import Any

from distserve.config import StructuredOutput
from distserve.errors import DistServeError, InvalidSamplingParamsError

# Objects and arrays nested in a schema: llguidance's parser stops near 128, xgrammar's compile time and memory grow
# with depth (2,000 levels: seconds and gigabytes); OpenAI allows 10 levels of nested objects (~20 here).
MAX_SCHEMA_DEPTH = 64
# structured_outputs keys -> our kinds (vLLM's ``StructuredOutputsParams``); ``json_object`` is a flag there.
_STRUCTURED_OUTPUTS_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _bad(message: str, param: str) -> InvalidSamplingParamsError:
    return InvalidSamplingParamsError(message, param)


def _spec(kind: str, text: str, param: str) -> StructuredOutput:
    try:
        return StructuredOutput(kind, text, param)
    except DistServeError as exc:
        raise _bad(str(exc), param) from None


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object (or JSON text of one), as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _bad(f"{param} must be a JSON schema (an object), got text that is not JSON: {exc}", param) from None
        except RecursionError:
            raise _bad(f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep", param) from None
    if not isinstance(value, (dict, bool)):
        raise _bad(f"{param} must be a JSON schema (an object), got {type(value).__name__}", param)
    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise _bad(f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep", param)
    return json.dumps(value, ensure_ascii=False)


def _depth(value: Any) -> int:
    """How deeply JSON objects and arrays nest in ``value`` (a scalar: 0); iterative, for any depth."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(f"{param} must be a non-empty string", param)
    return value


def _choices(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _bad(f"{param} must be a non-empty list of non-empty strings", param)
    return json.dumps(value, ensure_ascii=False)


def _response_format(value: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise _bad(f"{param} must be an object with a type", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("json_object", "", param)
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise _bad(f'{param} of type "json_schema" needs json_schema.schema', f"{param}.json_schema.schema")
        return _spec("json", _schema_text(body["schema"], f"{param}.json_schema.schema"), param)
    raise _bad(f'{param}.type must be "text", "json_object" or "json_schema", got {kind!r}', f"{param}.type")


def _structured_outputs(value: Any) -> list[StructuredOutput]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise _bad(f"{param} must be an object", param)
    out: list[StructuredOutput] = []
    for key, item in value.items():
        if item is None or item is False:
            continue
        name = f"{param}.{key}"
        if key == "json_object":
            out.append(_spec("json_object", "", name))
        elif key == "json":
            out.append(_spec("json", _schema_text(item, name), name))
        elif key == "choice":
            out.append(_spec("choice", _choices(item, name), name))
        elif key in _STRUCTURED_OUTPUTS_KINDS:
            out.append(_spec(_STRUCTURED_OUTPUTS_KINDS[key], _text(item, name), name))
        elif key not in ("disable_any_whitespace", "disable_fallback"):  # JSON has no free whitespace here; nothing falls back
            raise _bad(f"{name} is not supported (json, regex, choice, grammar or json_object)", name)
    return out


def structured_output_of(fields: dict[str, Any]) -> StructuredOutput | None:
    """The constraint a request's fields ask for (``response_format``, ``guided_*``, ``structured_outputs``),
    or None; more than one is refused, naming the second."""
    found: list[StructuredOutput] = []
    if fields.get("response_format") is not None:
        spec = _response_format(fields["response_format"])
        if spec is not None:
            found.append(spec)
    if fields.get("guided_json") is not None:
        found.append(_spec("json", _schema_text(fields["guided_json"], "guided_json"), "guided_json"))
    if fields.get("guided_regex") is not None:
        found.append(_spec("regex", _text(fields["guided_regex"], "guided_regex"), "guided_regex"))
    if fields.get("guided_choice") is not None:
        found.append(_spec("choice", _choices(fields["guided_choice"], "guided_choice"), "guided_choice"))
    if fields.get("guided_grammar") is not None:
        found.append(_spec("grammar", _text(fields["guided_grammar"], "guided_grammar"), "guided_grammar"))
    if fields.get("structured_outputs") is not None:
        found.extend(_structured_outputs(fields["structured_outputs"]))
    if len(found) > 1:
        raise _bad(f"a request may constrain its output one way only; got {', '.join(s.param for s in found)}", found[1].param)
    return found[0] if found else None


def tool_call_output(tools: list[dict[str, Any]], name: str | None, parallel_tool_calls: bool | None) -> StructuredOutput:
    """The JSON a forced call must be: a named function's arguments (its ``parameters`` schema), or for
    "required" a list of at least one ``{"name": ..., "parameters": {...}}`` of the given tools (at most
    one unless parallel calls are allowed)."""
    def parameters(function: dict[str, Any]) -> Any:
        return function.get("parameters") or {"type": "object", "properties": {}}

    functions = [t["function"] for t in tools]
    if name is not None:
        function = next(f for f in functions if f["name"] == name)
        return _spec("json", _schema_text(parameters(function), "tool_choice"), "tool_choice")
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": parameters(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return _spec("json", json.dumps(schema, ensure_ascii=False), "tool_choice")


__all__ = ["structured_output_of", "tool_call_output"]
