"""Every field a request can set is range-checked in one place (``SamplingParams`` for what needs no
model, ``RequestFrontend.check_request`` for what does), and the error names the field."""

from __future__ import annotations

from typing import Any

import pytest

from distserve.config import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SEED_MAX, SEED_MIN, SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model
from distserve.errors import DistServeError, InvalidSamplingParamsError, PromptTooLongError

BAD_PARAMS: list[tuple[dict[str, Any], str]] = [
    ({"seed": SEED_MAX + 1}, "seed"),
    ({"seed": SEED_MIN - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"top_k": 2**40}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"temperature": 1e308}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
]


@pytest.mark.parametrize("fields,param", BAD_PARAMS)
def test_sampling_params_refuse_out_of_range_fields(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**fields)
    assert info.value.param == param and str(info.value).startswith(param)


def test_the_limits_themselves_are_accepted() -> None:
    SamplingParams(seed=SEED_MAX, top_k=-1, temperature=100.0, stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)
    SamplingParams(seed=SEED_MIN, top_k=2**31 - 1, temperature=0.0)


def test_model_limits_are_checked_when_a_request_is_submitted() -> None:
    engine = LLMEngine(load_model("tiny"))
    ids = engine.tokenizer.encode("hello")
    vocab, context = engine.model_config.vocab_size, engine.max_model_len
    cases: list[tuple[SamplingParams, int, type[DistServeError], str]] = [
        (SamplingParams(stop_token_ids=[vocab]), 0, InvalidSamplingParamsError, "stop_token_ids"),
        (SamplingParams(max_tokens=context), 0, PromptTooLongError, "max_tokens"),
        (SamplingParams(), 2**63, DistServeError, "priority"),
        (SamplingParams(), -(2**63) - 1, DistServeError, "priority"),
    ]
    for sampling, priority, error, param in cases:
        with pytest.raises(error) as info:
            engine.add_request(ids, sampling, priority=priority)
        assert info.value.param == param
    with pytest.raises(DistServeError, match="out of range"):
        engine.add_request([vocab], SamplingParams())
    assert not engine.has_unfinished_requests()  # nothing refused was queued
    engine.add_request(ids, SamplingParams(max_tokens=context - len(ids), stop_token_ids=[vocab - 1]), priority=2**63 - 1)


def test_validation_errors_survive_pickling_with_their_param() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(InvalidSamplingParamsError("seed must be ...", "seed")))
    assert isinstance(err, InvalidSamplingParamsError) and err.param == "seed" and str(err) == "seed must be ..."
