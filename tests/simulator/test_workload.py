"""Workload generators: published-statistics length distributions, arrival processes, JSONL traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from distserve.errors import InvalidConfigError
from simulator import workload
from simulator.lengths import (
    ARXIV_4K_LLAMA2,
    AZURE2023_CODE,
    HUMANEVAL_OPT,
    SHAREGPT_OPT,
    FixedLengths,
    PublishedLengths,
)
from simulator.workload import (
    Request,
    arrival_times,
    describe,
    generate_requests,
    get_length_distribution,
    load_trace,
    rescale,
    write_trace,
)

N = 20000
SYNTHETIC = [("chatbot", SHAREGPT_OPT), ("code", HUMANEVAL_OPT), ("summarization", ARXIV_4K_LLAMA2)]


# ---- length distributions ------------------------------------------------------------------
@pytest.mark.parametrize(("name", "published"), SYNTHETIC)
def test_synthetic_lengths_match_published_means(name: str, published: PublishedLengths) -> None:
    dist = get_length_distribution(name)
    prompt_lens, output_lens = dist.sample(N, np.random.default_rng(0))
    for values, target in ((prompt_lens, published.prompt), (output_lens, published.output)):
        assert values.dtype == np.int64 and values.shape == (N,)
        assert values.mean() == pytest.approx(target.mean, rel=0.05)
        assert values.min() >= target.min and values.max() <= target.max
    # The description cites the dataset entry and the numbers it matches.
    assert published.entry in dist.description and f"mean {published.prompt.mean:g}" in dist.description
    again = dist.sample(N, np.random.default_rng(0))
    assert np.array_equal(again[0], prompt_lens) and np.array_equal(again[1], output_lens)
    other = dist.sample(N, np.random.default_rng(1))
    assert not np.array_equal(other[0], prompt_lens)


@pytest.mark.parametrize(("name", "published"), SYNTHETIC[1:])
def test_synthetic_medians_match_where_a_lognormal_can(name: str, published: PublishedLengths) -> None:
    prompt_lens, output_lens = get_length_distribution(name).sample(N, np.random.default_rng(0))
    assert np.median(prompt_lens) == pytest.approx(published.prompt.median, rel=0.02)
    assert np.median(output_lens) == pytest.approx(published.output.median, rel=0.02)


def test_chatbot_prompt_median_is_closest_reachable() -> None:
    # A lognormal on [4, 1024] with mean 228 cannot reach ShareGPT's median 97; the fit says so.
    dist = get_length_distribution("chatbot")
    assert "median 97 (fit 105)" in dist.description
    prompt_lens, _ = dist.sample(N, np.random.default_rng(0))
    assert 97 < np.median(prompt_lens) < 115


def test_statistics_are_parameters() -> None:
    dist = get_length_distribution("chatbot", prompt_mean=300.0, prompt_median=120.0, output_max=600)
    prompt_lens, output_lens = dist.sample(N, np.random.default_rng(0))
    assert prompt_lens.mean() == pytest.approx(300.0, rel=0.05) and output_lens.max() <= 600
    assert "custom statistics" in dist.description
    azure = AZURE2023_CODE.build("code")
    prompt_lens, output_lens = azure.sample(N, np.random.default_rng(0))
    assert prompt_lens.mean() == pytest.approx(2047.85, rel=0.05) and output_lens.mean() == pytest.approx(27.88, rel=0.05)
    assert "azure2023_code" in azure.description
    with pytest.raises(InvalidConfigError, match="unknown parameter 'prompt_avg'.*prompt_mean"):
        get_length_distribution("code", prompt_avg=3.0)
    with pytest.raises(InvalidConfigError, match="median=5000.*inside"):
        get_length_distribution("code", output_median=5000.0)


def test_fixed_lengths() -> None:
    dist = get_length_distribution("fixed:512:64")
    prompt_lens, output_lens = dist.sample(5, np.random.default_rng(0))
    assert prompt_lens.tolist() == [512] * 5 and output_lens.tolist() == [64] * 5
    assert get_length_distribution("fixed", prompt_len=3, output_len=1).sample(1, np.random.default_rng(0))[0].tolist() == [3]
    for bad in ("fixed:512", "fixed:a:64", "fixed:512:-1"):
        with pytest.raises(InvalidConfigError, match="fixed:<prompt_len>:<output_len>"):
            get_length_distribution(bad)
    with pytest.raises(InvalidConfigError, match="output_len must be an integer >= 1"):
        get_length_distribution("fixed:512:0")


def test_unknown_workload_names_the_choices() -> None:
    with pytest.raises(InvalidConfigError, match="unknown workload 'chat'.*chatbot, code, summarization, fixed:"):
        get_length_distribution("chat")


def test_trace_lengths_resample_pairs(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, [Request(0, 0.0, 10, 1), Request(1, 1.0, 20, 2), Request(2, 2.0, 30, 3)])
    dist = get_length_distribution(str(path))
    prompt_lens, output_lens = dist.sample(3000, np.random.default_rng(0))
    assert set(zip(prompt_lens.tolist(), output_lens.tolist())) == {(10, 1), (20, 2), (30, 3)}  # pairs stay paired
    assert str(path) in dist.description


# ---- arrivals ------------------------------------------------------------------------------
def _cv(x: np.ndarray) -> float:
    return float(x.std() / x.mean())


def test_poisson_arrivals() -> None:
    times = arrival_times("poisson", 4.0, 50000, np.random.default_rng(0))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps > 0) and times[0] == gaps[0]
    assert gaps.mean() == pytest.approx(0.25, rel=0.02) and _cv(gaps) == pytest.approx(1.0, abs=0.03)
    assert stats.kstest(gaps, "expon", args=(0, 0.25)).pvalue > 0.01


def test_gamma_arrivals_have_the_requested_cv() -> None:
    times = arrival_times("gamma", 4.0, 100000, np.random.default_rng(0), cv=2.0)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03) and _cv(gaps) == pytest.approx(2.0, rel=0.05)
    assert stats.kstest(gaps, "gamma", args=(0.25, 0, 1.0)).pvalue > 0.01  # shape 1/cv^2, scale cv^2/rate
    smooth = np.diff(arrival_times("gamma", 4.0, 100000, np.random.default_rng(0), cv=0.5))
    assert _cv(smooth) == pytest.approx(0.5, rel=0.05)


def test_fixed_arrivals_are_exact() -> None:
    times = arrival_times("fixed", 8.0, 100, np.random.default_rng(0))
    assert times == pytest.approx(np.arange(1, 101) / 8.0, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0.0}, "rate must be a finite number > 0"),
        ({"rate": -1.0}, "rate must be"),
        ({"rate": float("inf")}, "rate must be"),
        ({"rate": float("nan")}, "rate must be"),
        ({"cv": 0.0}, "cv must be"),
        ({"n": 0}, r"n \(number of arrivals\) must be an integer >= 1"),
        ({"process": "weibull"}, "unknown arrival process 'weibull'; choose from poisson, gamma, fixed"),
    ],
)
def test_arrival_errors_name_the_parameter(kwargs: dict, message: str) -> None:
    args = {"process": "gamma", "rate": 1.0, "n": 10, "rng": np.random.default_rng(0)} | kwargs
    with pytest.raises(InvalidConfigError, match=message):
        arrival_times(**args)


# ---- generate_requests ---------------------------------------------------------------------
def test_generate_requests_is_seeded() -> None:
    reqs = generate_requests("code", 2.0, 500, seed=3)
    assert reqs == generate_requests("code", 2.0, 500, seed=3)
    assert reqs != generate_requests("code", 2.0, 500, seed=4)
    assert [r.req_id for r in reqs] == list(range(500))
    assert all(a.arrival_s < b.arrival_s for a, b in zip(reqs, reqs[1:]))
    # Independent streams: the rate scales arrivals and leaves lengths alone.
    faster = generate_requests("code", 4.0, 500, seed=3)
    assert [(r.prompt_len, r.output_len) for r in faster] == [(r.prompt_len, r.output_len) for r in reqs]
    assert [r.arrival_s for r in faster] == pytest.approx([r.arrival_s / 2 for r in reqs])
    with pytest.raises(InvalidConfigError, match="rate must be"):
        generate_requests("code", 0.0, 10)
    with pytest.raises(InvalidConfigError, match="num_requests must be"):
        generate_requests("code", 1.0, 0)


def test_max_total_len_truncates_the_prompt_first() -> None:
    reqs = generate_requests("summarization", 1.0, 5000, max_total_len=2048)
    assert all(r.prompt_len + r.output_len <= 2048 and r.prompt_len >= 1 and r.output_len >= 1 for r in reqs)
    unclipped = generate_requests("summarization", 1.0, 5000)
    assert [r.output_len for r in reqs] == [min(r.output_len, 2047) for r in unclipped]  # outputs kept when they fit
    assert sum(r.prompt_len + r.output_len > 2048 for r in unclipped) > 1000  # the cap really bit
    (long_prompt,) = generate_requests("fixed:3000:100", 1.0, 1, max_total_len=2048)
    assert (long_prompt.prompt_len, long_prompt.output_len) == (1948, 100)
    (long_output,) = generate_requests("fixed:10:5000", 1.0, 1, max_total_len=2048)
    assert (long_output.prompt_len, long_output.output_len) == (1, 2047)
    with pytest.raises(InvalidConfigError, match="max_total_len must be an integer >= 2"):
        generate_requests("code", 1.0, 1, max_total_len=1)


def test_slo_mix_proportions() -> None:
    reqs = generate_requests("fixed:8:8", 1.0, N, slo_mix={"interactive": 3.0, "batch": 1.0})
    share = sum(r.slo_class == "interactive" for r in reqs) / N
    assert share == pytest.approx(0.75, abs=0.015)
    assert {r.slo_class for r in reqs} == {"interactive", "batch"}
    assert all(r.slo_class is None for r in generate_requests("fixed:8:8", 1.0, 10))
    for bad in ({}, {"a": -1.0, "b": 2.0}, {"a": 0.0}):
        with pytest.raises(InvalidConfigError, match="slo_mix"):
            generate_requests("fixed:8:8", 1.0, 10, slo_mix=bad)


# ---- traces --------------------------------------------------------------------------------
def test_trace_round_trip(tmp_path: Path) -> None:
    reqs = generate_requests("chatbot", 3.0, 200, arrival="gamma", cv=2.0, slo_mix={"a": 1.0, "b": 1.0})
    path = tmp_path / "trace.jsonl"
    write_trace(path, reqs)
    assert load_trace(path) == reqs


def test_load_trace_sorts_skips_blanks_and_ignores_extra_keys(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"arrival_s": 2.5, "prompt_len": 7, "output_len": 3, "hash_ids": [1]}\n\n'
        '{"arrival_s": 1, "prompt_len": 5.0, "output_len": 1, "slo_class": "x"}\n   \n'
    )
    assert load_trace(path) == [Request(0, 1.0, 5, 1, "x"), Request(1, 2.5, 7, 3)]


GOOD = '{"arrival_s": 0.5, "prompt_len": 4, "output_len": 2}\n'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (GOOD + "\n" + '{"arrival_s": 1.0, "prompt_len": 4,\n', r"t\.jsonl:3: malformed JSON"),
        (GOOD + '{"arrival_s": 1.0, "prompt_len": -4, "output_len": 2}\n', r":2: prompt_len must be >= 1, got -4"),
        (GOOD + '{"arrival_s": 1.0, "prompt_len": 4, "output_len": 0}\n', r":2: output_len must be >= 1"),
        (GOOD + '{"arrival_s": 1.0, "prompt_len": 4.5, "output_len": 2}\n', r":2: prompt_len must be an integer"),
        (GOOD + '{"arrival_s": 1.0, "prompt_len": "4", "output_len": 2}\n', r":2: prompt_len must be an integer"),
        (GOOD + '{"arrival_s": 1.0, "prompt_len": 4}\n', r":2: missing field 'output_len'"),
        (GOOD + '{"prompt_len": 4, "output_len": 2}\n', r":2: missing field 'arrival_s'"),
        (GOOD + '{"arrival_s": -1, "prompt_len": 4, "output_len": 2}\n', r":2: arrival_s must be a finite number >= 0"),
        (GOOD + '{"arrival_s": 1, "prompt_len": 4, "output_len": 2, "slo_class": 3}\n', r":2: slo_class must be a string"),
        (GOOD + "[1, 2]\n", r":2: expected a JSON object"),
        ("", r"t\.jsonl has no requests"),
        ("\n  \n", r"t\.jsonl has no requests"),
    ],
)
def test_bad_traces_name_file_line_and_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(InvalidConfigError, match=message):
        load_trace(path)


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match=r"trace file .*nope\.jsonl not found"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(InvalidConfigError, match="not found"):
        get_length_distribution(str(tmp_path / "nope.jsonl"))


def test_rescale_hits_the_target_rate() -> None:
    reqs = generate_requests("code", 2.0, 1000, arrival="gamma", cv=3.0, seed=1)
    slower = rescale(reqs, 0.5)
    assert describe(slower)["rate"] == pytest.approx(0.5, rel=1e-9)
    assert describe(slower)["interarrival_cv"] == pytest.approx(describe(reqs)["interarrival_cv"], rel=1e-9)
    assert [(r.req_id, r.prompt_len, r.output_len) for r in slower] == [(r.req_id, r.prompt_len, r.output_len) for r in reqs]
    with pytest.raises(InvalidConfigError, match="rate must be"):
        rescale(reqs, 0.0)
    with pytest.raises(InvalidConfigError, match="at least two requests"):
        rescale(reqs[:1], 1.0)


def test_describe() -> None:
    reqs = generate_requests("fixed:100:20", 5.0, 11, arrival="fixed")
    summary = describe(reqs)
    assert summary["num"] == 11 and summary["duration_s"] == pytest.approx(2.0) and summary["rate"] == pytest.approx(5.0)
    assert summary["interarrival_cv"] == pytest.approx(0.0, abs=1e-9)
    assert (summary["prompt_mean"], summary["prompt_p50"], summary["prompt_p90"], summary["prompt_max"]) == (100, 100, 100, 100)
    assert summary["output_mean"] == 20 and summary["output_max"] == 20
    with pytest.raises(InvalidConfigError):
        describe([])


def test_request_rejects_empty_lengths() -> None:
    with pytest.raises(InvalidConfigError, match="output_len must be >= 1"):
        Request(0, 0.0, 5, 0)


def test_fixed_lengths_reject_bad_values() -> None:
    with pytest.raises(InvalidConfigError, match="prompt_len"):
        FixedLengths(0, 5)


@pytest.mark.integration  # a fresh interpreter
def test_simulator_workload_imports_neither_torch_nor_ray() -> None:
    code = "import sys, simulator.workload, simulator.lengths; assert not {'torch', 'ray'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(workload.__file__).parents[1])


def test_write_trace_is_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, [Request(0, 0.25, 3, 2, "a"), Request(1, 0.5, 4, 1)])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"arrival_s": 0.25, "prompt_len": 3, "output_len": 2, "slo_class": "a"},
        {"arrival_s": 0.5, "prompt_len": 4, "output_len": 1},
    ]
