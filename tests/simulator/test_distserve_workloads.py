"""DistServe's workloads (``simulator.distserve_lengths``): its preparation rules on generated data,
the statistics the module docstring documents, reproducible seeds, usable by name everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from distserve.errors import InvalidConfigError
from simulator.distserve_lengths import (
    DISTSERVE_TRACES, SHAREGPT_MEAN_ROUNDS, DistServeShareGPTSample, LongBenchLengths, ShareGPTMultiTurn, describe_sharegpt_multiturn,
)
from simulator.lengths import HUMANEVAL_OPT, FixedLengths, LengthTarget
from simulator.workload import generate_requests, get_length_distribution

N = 50_000
NAMES = ("sharegpt-multiturn", "sharegpt-distserve", "humaneval", "longbench")


@pytest.mark.parametrize("name", NAMES)
def test_in_plus_out_below_2048_and_seeds_reproduce(name: str) -> None:
    dist = get_length_distribution(name)
    prompt, output = dist.sample(N, np.random.default_rng(3))
    assert prompt.dtype == np.int64 and prompt.shape == output.shape == (N,)
    assert prompt.min() >= 1 and output.min() >= 1 and (prompt + output).max() < 2048
    again = dist.sample(N, np.random.default_rng(3))
    assert np.array_equal(again[0], prompt) and np.array_equal(again[1], output)
    assert not np.array_equal(dist.sample(N, np.random.default_rng(4))[0], prompt)
    reqs = generate_requests(name, rate=2.0, num_requests=50, seed=9, max_total_len=2048)
    assert reqs == generate_requests(name, rate=2.0, num_requests=50, seed=9, max_total_len=2048)


def test_sharegpt_multiturn_statistics_as_documented() -> None:
    # The module docstring's figures (200k draws): prompt 649 / 556 / 1,394; output 212 / 139 / 513.
    got = describe_sharegpt_multiturn(N, seed=1)
    targets = {"prompt_mean": 649, "prompt_p50": 556, "prompt_p90": 1394, "output_mean": 212, "output_p50": 139, "output_p90": 513}
    for key, target in targets.items():
        assert got[key] == pytest.approx(target, rel=0.05), key
    # Far longer prompts than the first turns alone (``chatbot``: mean 228): earlier turns are concatenated.
    assert got["prompt_mean"] > 2.5 * get_length_distribution("chatbot").sample(N, np.random.default_rng(1))[0].mean()


def test_sharegpt_distserve_resamples_exactly_the_requests_distserve_served() -> None:
    import json

    rows = json.loads(DISTSERVE_TRACES.read_text())["traces"]["vllm-300-3"]
    pairs = {(r[1], r[2]) for r in rows}
    prompt, output = get_length_distribution("sharegpt-distserve").sample(N, np.random.default_rng(0))
    assert set(zip(prompt.tolist(), output.tolist())) == pairs  # every draw is one of them, and 50k draws meet all 300
    # Longer prompts than the rebuilt distribution (mean 780 against 649; the docstrings' figures), shorter outputs.
    assert prompt.mean() == pytest.approx(780, rel=0.03) and np.percentile(prompt, 90) == pytest.approx(1512, rel=0.03)
    assert output.mean() == pytest.approx(176, rel=0.05)
    with pytest.raises(InvalidConfigError, match="trace must be one of"):
        DistServeShareGPTSample(trace="vllm-999-9")


def test_sharegpt_multiturn_applies_distserve_rule_to_the_conversations() -> None:
    dist = ShareGPTMultiTurn()
    rng = np.random.default_rng(0)
    lens, num_messages = dist.conversations(20_000, rng)
    assert num_messages.mean() / 2 == pytest.approx(SHAREGPT_MEAN_ROUNDS, rel=0.03)
    assert np.all(num_messages % 2 == 0) and np.all((lens > 0).sum(axis=1) == num_messages)
    # Every pair is (sum of a conversation's first k messages, message k) of some generated conversation:
    # with fixed 10-token messages, prompts are multiples of 10 and outputs exactly 10.
    fixed = ShareGPTMultiTurn(round_lengths=FixedLengths(10, 10))
    prompt, output = fixed.sample(5000, rng)
    assert set(output.tolist()) == {10} and np.all(prompt % 10 == 0) and prompt.max() < 2048 - 10
    # k is uniform over the n - 1 prefixes of a kept conversation (n = 2R >= 4 messages): P(k = 1) =
    # E[1 / (2R - 1) | R >= 2] = 0.186 for geometric rounds of mean 3.51, and k = 2 as likely.
    p = 1 / SHAREGPT_MEAN_ROUNDS
    weights = [p * (1 - p) ** (r - 1) for r in range(2, 400)]
    expected = sum(w / (2 * r - 1) for r, w in zip(range(2, 400), weights)) / sum(weights)
    assert np.mean(prompt == 10) == pytest.approx(expected, abs=0.015)
    assert np.mean(prompt == 20) == pytest.approx(expected, abs=0.015)


def test_humaneval_is_the_published_humaneval() -> None:
    prompt, output = get_length_distribution("humaneval").sample(N, np.random.default_rng(0))
    assert prompt.mean() == pytest.approx(HUMANEVAL_OPT.prompt.mean, rel=0.03)
    assert output.mean() == pytest.approx(HUMANEVAL_OPT.output.mean, rel=0.03)
    assert np.median(prompt) == pytest.approx(HUMANEVAL_OPT.prompt.median, rel=0.03)
    assert "humaneval_distserve_style_computed" in get_length_distribution("humaneval").description


def test_longbench_prompts_follow_distserve_cut() -> None:
    prompt, output = get_length_distribution("longbench").sample(N, np.random.default_rng(0))
    assert np.all(prompt == np.minimum(prompt, 2040 - output)) and np.all(prompt <= 2048)
    long_answers = output > 140  # 2040 - answer < 1900: the answer cut binds
    assert np.all(prompt[long_answers] == 2040 - output[long_answers])
    assert np.all(prompt[~long_answers] >= 1900)
    # Documented: prompt mean 1,910; outputs mean 90, median 16 (assumed task mix of answers, plus the BOS).
    assert prompt.mean() == pytest.approx(1910, rel=0.02)
    assert output.mean() == pytest.approx(90, rel=0.05) and np.median(output) == pytest.approx(16, abs=1)


def test_longbench_outputs_count_the_tokenizers_bos() -> None:
    """DistServe's answer_len is len(tokenizer(answer).input_ids): the answer's tokens plus OPT's BOS, so no output
    is a single token (which would have no TPOT and meet any TPOT SLO); one-token answers are 2-token outputs."""
    dist = get_length_distribution("longbench")
    _, output = dist.sample(N, np.random.default_rng(0))
    answer, _ = dist.answer.sample(N, np.random.default_rng(0))
    assert np.array_equal(output, answer + 1)
    assert output.min() == 2 and (output == 2).mean() > 0.05
    with pytest.raises(InvalidConfigError, match="plus its BOS"):
        LongBenchLengths(answer=LengthTarget(mean=90.0, median=15.0, min=1, max=2039))


def test_unknown_parameters_are_refused() -> None:
    with pytest.raises(InvalidConfigError, match="bad parameters for workload 'sharegpt-multiturn'"):
        get_length_distribution("sharegpt-multiturn", rounds=3)
    with pytest.raises(InvalidConfigError, match="mean_rounds"):
        ShareGPTMultiTurn(mean_rounds=0.5)
    with pytest.raises(InvalidConfigError, match="min_messages"):
        get_length_distribution("sharegpt-multiturn", min_messages=1)
    with pytest.raises(InvalidConfigError, match="longbench: max_prompt"):
        get_length_distribution("longbench", min_prompt=1900, max_prompt=100)
