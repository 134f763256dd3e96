"""Declarative output transforms: how a generated variable's text is shaped before a later call reads it.

Parrot lets clients run Python on the server to post-process outputs; we never execute client
code. Instead a call's input may carry a list of transforms, applied in order to the variable's
value when the call is rendered:

==================  ========================================================================
``strip``           trim whitespace (or the characters in ``chars``)
``regex``           the first match of ``pattern`` (at most ``MAX_PATTERN_CHARS``, and at most
                    ``MAX_PATTERN_EXPANSION`` atoms with its counted repeats unrolled), its group
                    ``group`` (default 0); searched with a time limit (``MATCH_TIMEOUT_S``)
``json_parse``      the text as JSON (object, array, string, number, ...)
``json_path``       a value inside parsed JSON: ``$.key``, ``$.list[2]``, ``$["odd key"]``
``split``           the text split on ``sep``; with ``index``, one piece
``join``            a list joined with ``sep``
``truncate_tokens`` the first ``max_tokens`` tokens of the text (the model's tokenizer)
==================  ========================================================================

``parse_transforms`` checks a list when the call is submitted (a ``DataflowError``: HTTP 400);
``apply_transforms`` runs it when the input is ready, and a ``TransformFailed`` (no match, not
JSON, no such key, ...) becomes the failure of the call that reads the variable. A result that is
not a string is passed on as compact JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import regex

from distserve.errors import DataflowError

MAX_TRANSFORMS = 16
MAX_PATTERN_CHARS = 512
# The regex module unrolls counted repeats when it compiles: ``((a{1000}){1000}){1000}`` (23 characters) takes
# ~250 bytes per unrolled atom, i.e. all the memory of the machine. 20k atoms is ~5 MB at most.
MAX_PATTERN_EXPANSION = 20_000
_COUNTED_REPEAT = regex.compile(r"\{(\d*)(?:,(\d*))?\}")
MATCH_TIMEOUT_S = 0.1
MAX_PATH_CHARS = 256

_FIELDS: dict[str, set[str]] = {
    "strip": {"chars"}, "regex": {"pattern", "group"}, "json_parse": set(), "json_path": {"path"},
    "split": {"sep", "index"}, "join": {"sep"}, "truncate_tokens": {"max_tokens"},
}


class TransformFailed(ValueError):
    """A transform did not apply to the value it was given (the reading call fails with this message)."""


@dataclass(frozen=True)
class Transform:
    op: str
    args: tuple[tuple[str, Any], ...] = ()

    def arg(self, name: str, default: Any = None) -> Any:
        return dict(self.args).get(name, default)


def parse_transforms(raw: object, where: str = "transforms") -> tuple[Transform, ...]:
    """Check a list of transform objects (``{"op": "regex", "pattern": "...", "group": 1}``, ...)."""
    if raw is None:
        return ()
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise DataflowError(f"{where} must be a list of objects", "transforms")
    if len(raw) > MAX_TRANSFORMS:
        raise DataflowError(f"{where}: at most {MAX_TRANSFORMS} transforms, got {len(raw)}", "transforms")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("op"), str):
            raise DataflowError(f"{at} must be an object with an 'op'", "transforms")
        op = item["op"]
        if op not in _FIELDS:
            raise DataflowError(f"{at}: unknown op {op!r}; known: {sorted(_FIELDS)}", "transforms")
        args = {k: v for k, v in item.items() if k != "op"}
        unknown = sorted(set(args) - _FIELDS[op])
        if unknown:
            raise DataflowError(f"{at}: {op} takes no {unknown}", "transforms")
        _check(op, args, at)
        out.append(Transform(op, tuple(sorted(args.items()))))
    return tuple(out)


def _check(op: str, args: dict[str, Any], at: str) -> None:
    def bad(message: str) -> DataflowError:
        return DataflowError(f"{at}: {op} {message}", "transforms")

    if op == "strip" and "chars" in args and not isinstance(args["chars"], str):
        raise bad("chars must be a string")
    if op == "regex":
        pattern = args.get("pattern")
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
            raise bad(f"pattern must be a non-empty string of at most {MAX_PATTERN_CHARS} characters")
        size = pattern_expansion(pattern)
        if size > MAX_PATTERN_EXPANSION:
            raise bad(f"pattern unrolls to {size} atoms (its counted repeats {{m}}/{{m,n}} multiplied out); at most {MAX_PATTERN_EXPANSION}")
        try:
            compiled = regex.compile(pattern)
        except regex.error as exc:
            raise bad(f"pattern does not compile: {exc}") from None
        group = args.get("group", 0)
        if not _is_int(group) or not 0 <= group <= compiled.groups:
            raise bad(f"group must be an integer in [0, {compiled.groups}], got {group!r}")
    if op == "json_path":
        path = args.get("path")
        if not isinstance(path, str) or len(path) > MAX_PATH_CHARS:
            raise bad(f"path must be a string of at most {MAX_PATH_CHARS} characters")
        _path_steps(path, at)
    if op in ("split", "join"):
        sep = args.get("sep")
        if not isinstance(sep, str) or (op == "split" and not sep):
            raise bad("sep must be a " + ("non-empty " if op == "split" else "") + "string")
        if op == "split" and "index" in args and not _is_int(args["index"]):
            raise bad("index must be an integer")
    if op == "truncate_tokens":
        n = args.get("max_tokens")
        if not _is_int(n) or n < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {n!r}")


def pattern_expansion(pattern: str) -> int:
    """An upper bound on the atoms of ``pattern`` once every counted repeat is unrolled (nested ones multiply;
    ``*``, ``+`` and ``?`` are not unrolled). Syntax it does not know counts as literal atoms, which only overcounts."""
    pos, end = 0, len(pattern)

    def sequence() -> int:
        nonlocal pos
        total = last = 0
        while pos < end and pattern[pos] != ")":
            ch = pattern[pos]
            if ch == "{" and (m := _COUNTED_REPEAT.match(pattern, pos)) and (m.group(1) or m.group(2)):
                count = max(int(m.group(1) or 0), int(m.group(2) or 0))
                total += last * (count - 1)
                last *= count
                pos = m.end()
                continue
            if ch in "*+?|":
                pos += 1
                last = 0 if ch == "|" else last
                continue
            if ch == "(":
                pos += 1
                atom = sequence() + 1
                pos += 1  # its ")"
            elif ch == "[":
                pos = _class_end(pattern, pos)
                atom = 1
            else:
                pos += 2 if ch == "\\" else 1
                atom = 1
            total += atom
            last = atom
        return total

    size = 0
    while pos < end:  # an unbalanced ")" ends a sequence early: go on after it
        size += sequence()
        pos += 1
    return size


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opening at ``start`` (nested classes of the regex module included)."""
    depth, pos = 0, start
    while pos < len(pattern):
        ch = pattern[pos]
        if ch == "\\":
            pos += 2
            continue
        if ch == "[":
            depth += 1
            pos += 1
            if pos < len(pattern) and pattern[pos] == "^":
                pos += 1
            if pos < len(pattern) and pattern[pos] == "]":
                pos += 1  # a leading "]" is literal
            continue
        pos += 1
        if ch == "]":
            depth -= 1
            if depth == 0:
                return pos
    return pos


def apply_transforms(value: str, transforms: Sequence[Transform], count_tokens: Callable[[str, int], str] | None = None) -> str:
    """``value`` through ``transforms``; ``count_tokens(text, n)`` returns the first n tokens' text (for ``truncate_tokens``)."""
    current: Any = value
    for t in transforms:
        current = _apply(t, current, count_tokens)
    if isinstance(current, str):
        return current
    return json.dumps(current, ensure_ascii=False, separators=(",", ":"))


def _apply(t: Transform, value: Any, truncate: Callable[[str, int], str] | None) -> Any:
    if t.op == "json_path":
        return _select(value, _path_steps(t.arg("path"), "json_path"))
    if t.op == "join":
        if not isinstance(value, list):
            raise TransformFailed(f"join needs a list, got {type(value).__name__}")
        return t.arg("sep").join(v if isinstance(v, str) else json.dumps(v) for v in value)
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if t.op == "strip":
        return value.strip(t.arg("chars"))
    if t.op == "regex":
        try:
            m = regex.search(t.arg("pattern"), value, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            raise TransformFailed(f"regex {t.arg('pattern')!r} took longer than {MATCH_TIMEOUT_S} s") from None
        if m is None:
            raise TransformFailed(f"regex {t.arg('pattern')!r} does not match")
        group = m.group(t.arg("group", 0))
        return "" if group is None else group
    if t.op == "json_parse":
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise TransformFailed(f"json_parse: not JSON ({exc.msg} at {exc.pos})") from None
        except RecursionError:
            raise TransformFailed("json_parse: the JSON is nested too deeply") from None
    if t.op == "split":
        pieces = value.split(t.arg("sep"))
        index = t.arg("index")
        if index is None:
            return pieces
        if not -len(pieces) <= index < len(pieces):
            raise TransformFailed(f"split: index {index} is out of range for {len(pieces)} pieces")
        return pieces[index]
    if t.op == "truncate_tokens":
        if truncate is None:
            raise TransformFailed("truncate_tokens needs the model's tokenizer")
        return truncate(value, t.arg("max_tokens"))
    raise AssertionError(t.op)


def _path_steps(path: str, at: str) -> list[str | int]:
    """``$.a.b[0]["c d"]`` -> ["a", "b", 0, "c d"]."""
    if not path.startswith("$"):
        raise DataflowError(f"{at}: json_path must start with '$', got {path!r}", "transforms")
    steps: list[str | int] = []
    i = 1
    while i < len(path):
        if path[i] == ".":
            j = i + 1
            while j < len(path) and (path[j].isalnum() or path[j] == "_"):
                j += 1
            if j == i + 1:
                raise DataflowError(f"{at}: json_path {path!r} has an empty key at {i}", "transforms")
            steps.append(path[i + 1 : j])
            i = j
        elif path[i] == "[":
            j = path.find("]", i)
            if j < 0:
                raise DataflowError(f"{at}: json_path {path!r} has an unclosed '['", "transforms")
            inner = path[i + 1 : j]
            if inner.lstrip("-").isdigit():
                steps.append(int(inner))
            elif len(inner) >= 2 and inner[0] == inner[-1] and inner[0] in "\"'":
                steps.append(inner[1:-1])
            else:
                raise DataflowError(f"{at}: json_path {path!r}: [{inner}] is neither an index nor a quoted key", "transforms")
            i = j + 1
        else:
            raise DataflowError(f"{at}: json_path {path!r}: unexpected {path[i]!r} at {i}", "transforms")
    return steps


def _select(value: Any, steps: list[str | int]) -> Any:
    for step in steps:
        if isinstance(step, int):
            if not isinstance(value, list) or not -len(value) <= step < len(value):
                raise TransformFailed(f"json_path: no index {step} in {type(value).__name__}")
            value = value[step]
        else:
            if not isinstance(value, dict) or step not in value:
                raise TransformFailed(f"json_path: no key {step!r}")
            value = value[step]
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
