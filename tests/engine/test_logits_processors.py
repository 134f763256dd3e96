"""The sampler's logits processors (logit_bias, penalties, min_p) against hand computations, and the
raw log-probabilities it reports (top alternatives, prompt logprobs gathered chunk by chunk)."""

from __future__ import annotations

import pytest
import torch

from distserve.config import SamplingParams
from distserve.engine.logprobs import PromptLogprobs, PromptLogprobsBuilder
from distserve.engine.sampler import Sampler, SamplerOutput, process_logits
from distserve.errors import InvalidSamplingParamsError

EOS = 3


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[list[int] | None] | None = None,
    num_output_tokens: list[int] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplerOutput:
    n = logits.shape[0]
    return Sampler()(
        logits, params, generators or [None] * n, num_output_tokens or [0] * n, (EOS,), histories,
    )


def process(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int] | None], num_output_tokens: list[int]) -> torch.Tensor:
    return process_logits(logits, params, num_output_tokens, (EOS,), histories)


def test_no_processor_returns_the_logits_themselves() -> None:
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, min_p=0.1), SamplingParams(logprobs=True, top_logprobs=3), SamplingParams()]
    assert process(logits, params, [None] * 4, [0] * 4) is logits  # the fast path: no copy, nothing computed


def test_logit_bias_is_added_to_its_rows_only() -> None:
    logits = torch.randn(3, 10)
    params = [SamplingParams(logit_bias={2: 5.0, "7": -1.5}), SamplingParams(), SamplingParams(logit_bias={9: 100})]
    before = logits.clone()
    out = process(logits, params, [None] * 3, [0] * 3)
    expected = before.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 1.5
    expected[2, 9] += 100
    assert torch.equal(logits, before)  # the input is never mutated
    assert torch.allclose(out, expected)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens(temperature: float) -> None:
    logits = torch.randn(2, 100) * 3
    top = int(logits[1].argmax())
    forced = run(logits, [SamplingParams(temperature=temperature, logit_bias={17: 100})] * 2).token_ids
    assert forced == [17, 17]
    banned = run(logits[1:], [SamplingParams(temperature=0.0, logit_bias={top: -100})]).token_ids[0]
    assert banned != top and banned == int(torch.cat([logits[1, :top], torch.tensor([-1e9]), logits[1, top + 1 :]]).argmax())


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    # Prompt [0, 4], output [1]: tokens 0, 1 and 4 were seen; 2 and 3 were not.
    out = process(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 4, 1]], [1])
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, -8.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 6)
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # Prompt [1, 1, 4]; output [2, 2, 3]: token 2 twice, token 3 once; prompt tokens are not penalised.
    out = process(logits, [sp], [[1, 1, 4, 2, 2, 3]], [3])
    assert out[0].tolist() == pytest.approx([0.0, 0.0, -(2 * 0.5 + 0.25), -(0.5 + 0.25), 0.0, 0.0])
    negative = process(logits, [SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0)], [[1, 2]], [1])
    assert negative.tolist() == [[0.0, 0.0, 3.0, 0.0, 0.0, 0.0]]  # negative penalties encourage repeats


def test_penalties_are_per_row_and_bias_comes_first() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0, logit_bias={0: 1.0}), SamplingParams(presence_penalty=1.0)]
    out = process(logits, params, [None, [0, 2], [0, 2]], [0, 1, 1])
    # Row 1: token 0 biased to 2.0 then (seen in the prompt) halved; token 2 (the output) halved.
    assert out.tolist() == [[1.0, 2.0, 3.0], [1.0, 2.0, 1.5], [1.0, 2.0, 2.0]]


def test_frequency_penalty_changes_greedy_output_predictably() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    history = [2, 0, 0, 0]  # prompt [2], then token 0 generated three times
    assert run(logits, [SamplingParams(temperature=0.0)], [history], [3]).token_ids == [0]
    # 5 - 3 x 0.4 = 3.8 < 4: the runner-up wins.
    assert run(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.4)], [history], [3]).token_ids == [1]
    assert run(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.3)], [history], [3]).token_ids == [0]
    assert run(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.3)], [history], [3]).token_ids == [1]


def test_penalised_row_without_history_is_an_error() -> None:
    with pytest.raises(ValueError, match="histories"):
        run(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)])


def test_min_p_never_samples_below_its_cut_and_keeps_the_rest_in_proportion() -> None:
    probs = [0.5, 0.3, 0.12, 0.08]  # min_p 0.2 cuts at 0.1: token 3 is dropped
    logits = torch.tensor(probs).log()[None, :].repeat(4000, 1)
    torch.manual_seed(0)
    out = run(logits, [SamplingParams(min_p=0.2)] * 4000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).double() / 4000
    assert freq[3] == 0
    kept = torch.tensor(probs[:3], dtype=torch.float64) / sum(probs[:3])
    assert torch.allclose(freq[:3], kept, atol=0.03)


def test_min_p_is_on_the_tempered_distribution_and_before_top_p() -> None:
    # Temperature 0.5 squares the probabilities' ratios: [0.6, 0.3, 0.1] -> weights [1, 0.25, 0.028].
    logits = torch.tensor([0.6, 0.3, 0.1]).log()[None, :].repeat(3000, 1)
    torch.manual_seed(1)
    tokens = run(logits, [SamplingParams(temperature=0.5, min_p=0.2)] * 3000).token_ids
    assert set(tokens) == {0, 1}
    # min_p leaves [1, 0.25] (0.8 and 0.2 once renormalised); top_p 0.7 then keeps token 0 alone.
    assert set(run(logits[:200], [SamplingParams(temperature=0.5, min_p=0.2, top_p=0.7)] * 200).token_ids) == {0}


def test_greedy_ignores_min_p() -> None:
    logits = torch.randn(3, 40)
    assert run(logits, [SamplingParams(temperature=0.0, min_p=1.0)] * 3).token_ids == logits.argmax(-1).tolist()


def test_top_logprobs_are_raw_whatever_the_processing() -> None:
    logits = torch.randn(3, 60) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, logit_bias={1: 50.0}),
        SamplingParams(temperature=0.7, logprobs=True, top_logprobs=2, repetition_penalty=1.5, min_p=0.1),
        SamplingParams(temperature=0.0, logprobs=True),
    ]
    out = run(logits, params, [None, [3, 4, 5], None], [0, 1, 0])
    raw = logits.log_softmax(-1)
    assert out.token_ids[0] == 1  # the bias picked it...
    assert out.logprobs is not None and out.logprobs[0] == pytest.approx(float(raw[0, 1]), abs=1e-5)  # ...its logprob is raw
    assert out.top_logprobs is not None and out.top_logprobs[2] == []
    for row, k in ((0, 5), (1, 2)):
        values, ids = raw[row].topk(k)
        assert [t for t, _ in out.top_logprobs[row]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[row]] == pytest.approx(values.tolist(), abs=1e-5)


def test_no_top_logprobs_unless_asked() -> None:
    out = run(torch.randn(2, 20), [SamplingParams(logprobs=True), SamplingParams()])
    assert out.logprobs is not None and out.top_logprobs is None


def test_prompt_logprobs_gathered_by_chunks_equal_one_pass_and_a_recompute_replaces_them() -> None:
    torch.manual_seed(0)
    vocab, hidden_size = 30, 8
    head = torch.randn(hidden_size, vocab)
    prompt = [4, 9, 1, 22, 7, 7, 13]
    hidden = torch.randn(len(prompt), hidden_size)  # [P, H]: one row per prompt position

    def to_logits(h: torch.Tensor) -> torch.Tensor:
        return h @ head

    def gather(chunks: list[tuple[int, int]]) -> PromptLogprobs | None:
        builder = PromptLogprobsBuilder()
        for start, end in chunks:
            targets = prompt[start + 1 : end + 1]  # the final chunk's last row predicts an output token
            builder.add_chunk("s", start, hidden[start : start + len(targets)], targets, 3, to_logits)
        return builder.pop("s")

    whole = gather([(0, 7)])
    assert whole is not None and len(whole) == len(prompt) - 1
    raw = to_logits(hidden).log_softmax(-1)
    expected = [float(raw[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert whole.logprobs == pytest.approx(expected, abs=1e-5)
    assert whole.ranks == [int((raw[i] > raw[i, prompt[i + 1]]).sum()) + 1 for i in range(len(prompt) - 1)]
    assert [t for t, _ in whole.top[2]] == raw[2].topk(3).indices.tolist()
    for chunks in ([(0, 3), (3, 5), (5, 7)], [(0, 3), (3, 5), (0, 4), (4, 7)]):  # the second: preempted, computed again
        chunked = gather(chunks)
        assert chunked is not None and chunked.ranks == whole.ranks
        assert chunked.logprobs == pytest.approx(whole.logprobs, abs=1e-5)
        assert [[t for t, _ in top] for top in chunked.top] == [[t for t, _ in top] for top in whole.top]


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0), ("repetition_penalty", 1e9),
    ("min_p", 1.5), ("min_p", -0.1), ("logit_bias", {"x": 1}), ("logit_bias", {1: 101}), ("logit_bias", {-1: 1}),
    ("logit_bias", {i: 1.0 for i in range(301)}), ("logit_bias", {"9" * 5000: 1}), ("top_logprobs", 21), ("prompt_logprobs", -1),
])
def test_bad_values_name_their_field(field: str, value: object) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**{field: value, **extra})  # type: ignore[arg-type]
    assert info.value.param == field


def test_top_logprobs_need_logprobs() -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(top_logprobs=2)
    assert info.value.param == "top_logprobs"
