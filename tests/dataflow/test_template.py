"""Semantic-call templates: parsed once, every malformed shape refused with a message naming it."""

from __future__ import annotations

from typing import Any

import pytest

from distserve.dataflow.limits import SessionLimits, ValueTooLarge
from distserve.dataflow.template import DEFAULT_MAX_GEN_LENGTH, PlaceholderChunk, TextChunk, parse_call, sampling_params
from distserve.errors import DataflowError


def out(name: str, **sampling: Any) -> dict[str, Any]:
    return {"name": name, "is_output": True, **({"sampling_config": sampling} if sampling else {})}


def test_a_call_splits_into_chunks_and_drops_text_after_the_last_output() -> None:
    call = parse_call(
        "System: be brief.\nQ: {{question}}\nContext: {{doc}}\nA: {{answer}} (end)",
        [{"name": "question", "value": "Why?"}, {"name": "doc", "var_id": "v1"}, out("answer", max_gen_length=8, temperature=0)],
    )
    assert call.chunks == (
        TextChunk("System: be brief.\nQ: "), PlaceholderChunk("question"), TextChunk("\nContext: "),
        PlaceholderChunk("doc"), TextChunk("\nA: "), PlaceholderChunk("answer"),
    )
    assert [p.name for p in call.inputs] == ["question", "doc"] and [p.name for p in call.outputs] == ["answer"]
    answer = call.placeholders["answer"]
    assert answer.sampling is not None and answer.sampling.max_tokens == 8 and answer.sampling.greedy
    assert call.placeholders["doc"].var_id == "v1" and not call.placeholders["doc"].needs_new_variable
    assert call.placeholders["answer"].needs_new_variable


def test_an_input_may_repeat_and_an_unset_input_gets_a_new_variable() -> None:
    call = parse_call("{{a}} and {{a}} give {{b}}, then {{c}}", [{"name": "a"}, out("b"), out("c")])
    assert [p.name for p in call.inputs] == ["a"] and call.placeholders["a"].needs_new_variable
    assert [p.name for p in call.outputs] == ["b", "c"]
    assert call.placeholders["b"].sampling is not None and call.placeholders["b"].sampling.max_tokens == DEFAULT_MAX_GEN_LENGTH


@pytest.mark.parametrize(
    ("template", "placeholders", "message"),
    [
        ("", [out("x")], "template must be a non-empty string"),
        ("Hi {{ x }}", [out("x")], "malformed placeholder"),
        ("Hi {{1x}} {{y}}", [out("y")], "malformed placeholder"),
        ("Hi {{x}}", [], "not described"),
        ("Hi {{x}}", [out("x"), {"name": "y", "value": "v"}], "described but not in the template"),
        ("Hi {{x}}", [{"name": "x", "value": "v"}], "at least one output"),
        ("{{x}} then {{x}}", [out("x")], "more than once"),
        ("Hi {{x}}{{y}}", [out("x"), out("y")], "adjacent"),
        ("Hi {{x}}", [out("x"), out("x")], "described twice"),
        ("Hi {{x}}", [{"name": "x", "is_output": True, "value": "v"}], "takes no value or transforms"),
        ("{{a}} {{x}}", [{"name": "a", "var_id": "v", "value": "w"}, out("x")], "not both"),
        ("{{a}} {{x}}", [{"name": "a", "sampling_config": {}}, out("x")], "takes no sampling_config"),
        ("{{a}} {{x}}", [{"name": "a", "colour": "red"}, out("x")], "unknown fields"),
        ("{{a}} {{x}}", [{"name": "a", "value": 3}, out("x")], "value must be a string"),
        ("Hi {{x}}", [out("x", n=2)], "n is not supported"),
        ("Hi {{x}}", [out("x", temperature=-1)], "temperature"),
        ("Hi {{x}}", [out("x", max_gen_length="many")], "max_tokens"),
        ("Hi {{x}}", [out("x", beam=True)], "unknown field 'beam'"),
        ("Hi {{x}}", "x", "placeholders must be a list"),
    ],
)
def test_malformed_calls_are_refused_by_name(template: str, placeholders: Any, message: str) -> None:
    with pytest.raises(DataflowError, match=message) as err:
        parse_call(template, placeholders)
    assert err.value.param in ("template", "placeholders", "sampling_config")


def test_parrot_sampling_fields_map_to_ours_and_no_op_defaults_are_accepted() -> None:
    sp = sampling_params({"temperature": 0.5, "top_p": 0.9, "max_gen_length": 20, "ignore_tokenizer_eos": True,
                          "stop_token_ids": [7], "stop_str": "\n", "presence_penalty": 0.0, "n": 1, "logit_bias": None})
    assert (sp.temperature, sp.top_p, sp.max_tokens, sp.ignore_eos, sp.stop_token_ids, sp.stop) == (0.5, 0.9, 20, True, (7,), ("\n",))
    assert sampling_params({"max_tokens": 3, "top_k": 5, "seed": 1}).top_k == 5


def test_model_type_and_value_sizes_are_checked() -> None:
    assert parse_call("Hi {{x}}", [out("x")]).model_type == "token_id"
    assert parse_call("Hi {{x}}", [out("x")], model_type="text").model_type == "text"
    with pytest.raises(DataflowError, match="model_type must be one of") as err:
        parse_call("Hi {{x}}", [out("x")], model_type="tokens")
    assert err.value.param == "model_type"
    limits = SessionLimits(max_value_chars=11)
    parse_call("{{a}} {{x}}", [{"name": "a", "value": "11 chars ok"}, out("x")], limits=limits)
    with pytest.raises(ValueTooLarge, match=r"placeholders\[0\].value may be at most 11 characters, got 12") as too_big:
        parse_call("{{a}} {{x}}", [{"name": "a", "value": "12 chars now"}, out("x")], limits=limits)
    assert too_big.value.param == "placeholders"
