"""Tests for the batch sampler: greedy, seeds, top-k/top-p, temperature, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from distserve.config import SamplingParams
from distserve.engine.sampler import Sampler, SamplerOutput

EOS = 3


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    num_output_tokens: list[int] | None = None,
    eos_token_ids: tuple[int, ...] = (EOS,),
) -> SamplerOutput:
    n = logits.shape[0]
    return Sampler()(
        logits,
        params,
        generators if generators is not None else [None] * n,
        num_output_tokens if num_output_tokens is not None else [0] * n,
        eos_token_ids,
    )


def frequencies(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab_size).double() / len(token_ids)


def repeated(probs: list[float], n: int) -> torch.Tensor:
    return torch.tensor(probs).log()[None, :].repeat(n, 1)  # [n, V]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_greedy_is_argmax_and_consumes_no_rng() -> None:
    logits = torch.randn(8, 1000)  # [8, 1000]
    generators = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(8)]
    generator_states = [g.get_state() for g in generators if g is not None]
    rng_state = torch.get_rng_state()
    out = run(logits, [SamplingParams(temperature=0.0, seed=1)] * 8, generators)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    assert torch.equal(torch.get_rng_state(), rng_state)
    for g, state in zip([g for g in generators if g is not None], generator_states):
        assert torch.equal(g.get_state(), state)


def test_greedy_ties_pick_lowest_index() -> None:
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    assert run(logits, [SamplingParams(temperature=0.0)] * 2).token_ids == [1, 0]


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = run(logits, params)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


def seeded_sequence(
    seed: int, logits_per_step: list[torch.Tensor], params: SamplingParams
) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [run(step[None, :], [params], [generator]).token_ids[0] for step in logits_per_step]


def test_same_seed_gives_same_sequence() -> None:
    steps = [torch.randn(2000) for _ in range(6)]
    params = SamplingParams(seed=42)
    first = seeded_sequence(42, steps, params)
    assert seeded_sequence(42, steps, params) == first
    assert seeded_sequence(43, steps, params) != first


SEEDED_PARAMS = [
    SamplingParams(seed=7),
    SamplingParams(seed=7, temperature=0.7, top_k=50),
    SamplingParams(seed=7, top_p=0.9),
    SamplingParams(
        seed=7, temperature=1.3, top_k=200, top_p=0.95, min_tokens=2, stop_token_ids=(5,)
    ),
]


@pytest.mark.parametrize("target", SEEDED_PARAMS)
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_seeded_row_ignores_rest_of_batch(target: SamplingParams, position: str) -> None:
    vocab_size, num_steps = 3000, 4
    target_logits = [torch.randn(vocab_size) * 3 for _ in range(num_steps)]
    alone = torch.Generator().manual_seed(7)
    expected = [
        run(step[None, :], [target], [alone], [s]).token_ids[0]
        for s, step in enumerate(target_logits)
    ]

    others = [
        (SamplingParams(), None),
        (SamplingParams(seed=99, top_p=0.5), torch.Generator().manual_seed(99)),
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(top_k=3), None),
        (SamplingParams(seed=7), torch.Generator().manual_seed(7)),
    ]
    index = {"first": 0, "middle": 3, "last": len(others)}[position]
    in_batch = torch.Generator().manual_seed(7)
    got = []
    for s, step in enumerate(target_logits):
        rows = [torch.randn(vocab_size) * 3 for _ in others]
        rows.insert(index, step)
        params = [p for p, _ in others]
        params.insert(index, target)
        generators = [g for _, g in others]
        generators.insert(index, in_batch)
        out = run(torch.stack(rows), params, generators, [s] * len(rows))
        got.append(out.token_ids[index])
    assert got == expected


def test_top_k_only_keeps_k_largest() -> None:
    logits = torch.randn(1, 1000).repeat(4000, 1)  # [4000, 1000]
    out = run(logits, [SamplingParams(top_k=5)] * 4000)
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(out.token_ids) == top5


def test_top_k_differs_per_row_and_k_at_least_vocab_is_noop() -> None:
    vocab_size = 10
    logits = repeated([0.1] * vocab_size, 1)
    logits = (logits + torch.arange(vocab_size) * 0.01).repeat(3000, 1)  # [3000, 10]
    params = [SamplingParams(top_k=k) for k in (1, 3, vocab_size, 50, 0)] * 600
    out = run(logits, params)
    for j, k in enumerate((1, 3, vocab_size, 50, 0)):
        seen = set(out.token_ids[j::5])
        num_allowed = min(k, vocab_size) if k else vocab_size
        allowed = set(range(vocab_size - num_allowed, vocab_size))
        assert seen == allowed, k


DESIGNED = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    ("probs", "top_p", "allowed"),
    [
        (DESIGNED, 0.8, {0, 1}),
        (DESIGNED, 0.81, {0, 1, 2}),
        (DESIGNED, 0.4, {0}),
        (DESIGNED, 1.0, {0, 1, 2, 3}),
        ([0.4, 0.3, 0.2, 0.1], 0.9, {0, 1, 2}),  # float32 rounding puts the sum just below 0.9
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(
    probs: list[float], top_p: float, allowed: set[int]
) -> None:
    out = run(repeated(probs, 6000), [SamplingParams(top_p=top_p)] * 6000)
    assert set(out.token_ids) == allowed
    kept_mass = sum(probs[t] for t in allowed)
    expected = torch.tensor([probs[t] / kept_mass if t in allowed else 0.0 for t in range(4)])
    assert (frequencies(out.token_ids, 4) - expected.double()).abs().max() < 0.03


def test_top_p_order_does_not_matter() -> None:
    probs = [0.05, 0.3, 0.15, 0.5]
    out = run(repeated(probs, 4000), [SamplingParams(top_p=0.8)] * 4000)
    assert set(out.token_ids) == {1, 3}


def test_top_k_applies_before_top_p() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    # After top-k=2 the distribution is [0.571, 0.429], so top-p=0.55 keeps only token 0; top-p on
    # the original distribution would keep {0, 1}.
    out = run(repeated(probs, 3000), [SamplingParams(top_k=2, top_p=0.55)] * 3000)
    assert set(out.token_ids) == {0}
    out = run(repeated(probs, 3000), [SamplingParams(top_k=3, top_p=0.9)] * 3000)
    assert set(out.token_ids) == {0, 1, 2}
    out = run(repeated(probs, 3000), [SamplingParams(top_p=0.55)] * 3000)
    assert set(out.token_ids) == {0, 1}


def test_frequencies_match_softmax() -> None:
    vocab_size, n = 12, 20000
    logits = torch.randn(1, vocab_size) * 1.5  # [1, 12]
    expected = logits[0].softmax(dim=-1).double()
    out = run(logits.repeat(n, 1), [SamplingParams()] * n)
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=vocab_size).double()
    chi_square = (((observed - n * expected) ** 2) / (n * expected)).sum().item()
    assert chi_square < 35.0  # 11 degrees of freedom: p ~ 2.5e-4
    assert (observed / n - expected).abs().max() < 0.015


def test_frequencies_match_softmax_over_a_large_vocab() -> None:
    vocab_size, n = 1000, 20000
    special = {3: 4.0, 300: 3.5, 555: 3.0, 999: 2.0}
    logits = torch.full((1, vocab_size), -2.0)  # [1, 1000]
    for token, logit in special.items():
        logits[0, token] = logit
    expected = logits[0].softmax(dim=-1).double()
    observed = frequencies(run(logits.repeat(n, 1), [SamplingParams()] * n).token_ids, vocab_size)
    for token in special:
        assert abs(observed[token] - expected[token]).item() < 0.015
    rest = [t for t in range(vocab_size) if t not in special]
    assert abs(observed[rest].sum() - expected[rest].sum()).item() < 0.015


def test_seeded_frequencies_match_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    generator = torch.Generator().manual_seed(3)
    params = [SamplingParams(seed=3)]
    tokens = [run(logits, params, [generator]).token_ids[0] for _ in range(3000)]
    expected = logits[0].softmax(dim=-1).double()
    assert (frequencies(tokens, 5) - expected).abs().max() < 0.03


@pytest.mark.parametrize("temperature", [1e-3, 1e-38])
def test_low_temperature_is_greedy(temperature: float) -> None:
    logits = torch.randn(500, 300) * 10
    out = run(logits, [SamplingParams(temperature=temperature)] * 500)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_high_temperature_flattens() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(8000, 1)
    hot = frequencies(run(logits, [SamplingParams(temperature=100.0)] * 8000).token_ids, 4)
    normal = frequencies(run(logits, [SamplingParams(temperature=1.0)] * 8000).token_ids, 4)
    assert (hot - 0.25).abs().max() < 0.03
    assert abs(normal[3].item() - logits[0].softmax(dim=-1)[3].item()) < 0.03
    assert normal[3] > 0.6 > hot[3]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_eos_and_stop_ids_until_reached(
    temperature: float, ignore_eos: bool
) -> None:
    vocab_size, stop_id = 10, 5
    logits = torch.zeros(1, vocab_size)
    logits[0, EOS] = 40.0
    logits[0, stop_id] = 30.0
    logits[0, 7] = 20.0
    params = SamplingParams(
        temperature=temperature, min_tokens=2, stop_token_ids=(stop_id,), ignore_eos=ignore_eos
    )
    plain = SamplingParams(temperature=temperature)
    for num_generated in range(4):
        out = run(logits.repeat(2, 1), [params, plain], num_output_tokens=[num_generated] * 2)
        assert out.token_ids[1] == EOS
        if num_generated < 2:
            assert out.token_ids[0] == 7
        else:
            assert out.token_ids[0] == EOS


def test_min_tokens_bans_every_eos_id() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0]])
    out = run(logits, [SamplingParams(temperature=0.0, min_tokens=1)], eos_token_ids=(1, 2))
    assert out.token_ids == [3]


def test_logprobs_use_raw_logits() -> None:
    logits = torch.randn(6, 400) * 2
    logits[0, EOS] = 50.0
    params = [
        SamplingParams(temperature=0.0, logprobs=True, min_tokens=3),
        SamplingParams(temperature=0.5, top_k=10, logprobs=True),
        SamplingParams(top_p=0.7, logprobs=True),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(seed=1, logprobs=True),
    ]
    generators = [None] * 5 + [torch.Generator().manual_seed(1)]
    out = run(logits, params, generators)
    assert out.logprobs is not None and len(out.logprobs) == 6
    expected = logits.log_softmax(dim=-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-5)
    assert out.token_ids[0] != EOS
    assert math.isfinite(out.logprobs[0])


def test_input_logits_not_mutated() -> None:
    logits = torch.randn(5, 300)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(top_k=5, min_tokens=2, stop_token_ids=(9,)),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=0.3, top_k=20, top_p=0.9),
        SamplingParams(logprobs=True),
    ]
    run(logits, params)
    run(logits, [SamplingParams(top_p=0.5)] * 5)
    run(logits, [SamplingParams(temperature=0.0)] * 5)
    assert torch.equal(logits, before)


def test_bfloat16_input() -> None:
    logits = (torch.randn(4, 300) * 3).bfloat16()
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.9, min_tokens=1),
        SamplingParams(seed=3),
    ]
    out = run(logits, params, [None, None, None, torch.Generator().manual_seed(3)])
    assert torch.equal(logits, before)
    assert out.token_ids[0] == logits[0].float().argmax().item()
    assert out.token_ids[1] in set(logits[1].float().topk(5).indices.tolist())
    assert all(0 <= t < 300 for t in out.token_ids)
    assert out.logprobs is not None
    expected = logits.float().log_softmax(dim=-1)[0, out.token_ids[0]].item()
    assert out.logprobs[0] == pytest.approx(expected, abs=1e-5)
    greedy = run(logits, [SamplingParams(temperature=0.0)] * 4)
    assert greedy.token_ids == logits.float().argmax(dim=-1).tolist()
