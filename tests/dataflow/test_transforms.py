"""Declarative output transforms: checked at submission, applied when the reading call is rendered."""

from __future__ import annotations

from typing import Any

import pytest

from distserve.dataflow.template import parse_call
from distserve.dataflow.transforms import MAX_PATTERN_EXPANSION, TransformFailed, apply_transforms, parse_transforms, pattern_expansion
from distserve.errors import DataflowError


def run(value: str, *transforms: dict[str, Any]) -> str:
    return apply_transforms(value, parse_transforms(list(transforms)), lambda text, n: " ".join(text.split()[:n]))


def test_each_transform_shapes_the_value() -> None:
    assert run("  answer \n", {"op": "strip"}) == "answer"
    assert run("xxanswerxx", {"op": "strip", "chars": "x"}) == "answer"
    assert run("The answer is 42.", {"op": "regex", "pattern": r"answer is (\d+)", "group": 1}) == "42"
    assert run('{"plan": {"steps": ["a", "b"]}}', {"op": "json_parse"}, {"op": "json_path", "path": "$.plan.steps[1]"}) == "b"
    assert run('{"odd key": [1, 2]}', {"op": "json_parse"}, {"op": "json_path", "path": '$["odd key"]'}) == "[1,2]"
    assert run("a, b, c", {"op": "split", "sep": ", ", "index": -1}) == "c"
    assert run("a,b,c", {"op": "split", "sep": ","}, {"op": "join", "sep": " | "}) == "a | b | c"
    assert run("one two three four", {"op": "truncate_tokens", "max_tokens": 2}) == "one two"
    assert run("same") == "same"


@pytest.mark.parametrize(
    ("transforms", "message"),
    [
        ([{"op": "regex", "pattern": "("}], "does not compile"),
        ([{"op": "regex", "pattern": "a" * 600}], "at most 512"),
        ([{"op": "regex", "pattern": "(a)", "group": 2}], "group must be"),
        # Compiles to ~36 MB; its 23-character cousin below would take all the machine's memory (a fuzzing find).
        ([{"op": "regex", "pattern": "(a{300}){300}"}], "unrolls to 90300 atoms"),
        ([{"op": "json_path", "path": "plan.steps"}], "must start with"),
        ([{"op": "json_path", "path": "$.a[x]"}], "neither an index"),
        ([{"op": "split", "sep": ""}], "non-empty"),
        ([{"op": "truncate_tokens", "max_tokens": 0}], "max_tokens"),
        ([{"op": "eval", "code": "1"}], "unknown op 'eval'"),
        ([{"op": "strip", "pattern": "x"}], "takes no"),
        ("strip", "must be a list"),
    ],
)
def test_bad_transforms_are_refused_at_submission(transforms: Any, message: str) -> None:
    with pytest.raises(DataflowError, match=message):
        parse_transforms(transforms)
    with pytest.raises(DataflowError, match=message):  # the same through a call's input
        parse_call("{{a}} {{x}}", [{"name": "a", "var_id": "v", "transforms": transforms}, {"name": "x", "is_output": True}])


@pytest.mark.parametrize(
    ("value", "transforms", "message"),
    [
        ("no digits", [{"op": "regex", "pattern": r"\d+"}], "does not match"),
        ("not json", [{"op": "json_parse"}], "not JSON"),
        ('{"a": 1}', [{"op": "json_parse"}, {"op": "json_path", "path": "$.b"}], "no key 'b'"),
        ("[1]", [{"op": "json_parse"}, {"op": "json_path", "path": "$[3]"}], "no index 3"),
        ("a,b", [{"op": "split", "sep": ",", "index": 5}], "out of range"),
        ("abc", [{"op": "join", "sep": ","}], "needs a list"),
    ],
)
def test_a_transform_that_does_not_apply_fails_with_its_reason(value: str, transforms: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(TransformFailed, match=message):
        apply_transforms(value, parse_transforms(transforms))


def test_a_catastrophic_pattern_is_stopped_by_the_time_limit() -> None:
    transforms = parse_transforms([{"op": "regex", "pattern": r"^(a|aa)+$"}])  # exponential backtracking
    with pytest.raises(TransformFailed, match="took longer"):
        apply_transforms("a" * 60 + "b", transforms)


def test_a_pattern_is_measured_with_its_counted_repeats_unrolled() -> None:
    assert pattern_expansion("((a{1000}){1000}){1000}") > 10**9  # refused without compiling it
    assert pattern_expansion(r"(\d{4})-(\d{2})") == 9 and pattern_expansion(r"[{]{3}\{2}") == 6  # a group counts one more; escaped braces are literal
    assert pattern_expansion("[a-z]{1,10000}") == 10_000 <= MAX_PATTERN_EXPANSION
    assert run("code: ab12", {"op": "regex", "pattern": r"[a-z]{1,10000}(\d{2})", "group": 1}) == "12"


def test_json_nested_too_deeply_fails_the_transform_not_the_server() -> None:
    with pytest.raises(TransformFailed, match="nested too deeply"):
        apply_transforms("[" * 100_000, parse_transforms([{"op": "json_parse"}]))


def test_outputs_take_no_transforms() -> None:
    with pytest.raises(DataflowError, match="takes no value or transforms"):
        parse_call("{{x}}", [{"name": "x", "is_output": True, "transforms": [{"op": "strip"}]}])
