"""Turns one step's logits into next tokens: a pipeline of logits processors (min_tokens, logit_bias,
penalties), then greedy argmax or temperature, min_p, top-k/top-p and a seeded draw; and the raw
log-probabilities a request asks for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from distserve.config import SamplingParams
from distserve.engine.logprobs import TopLogprobs, top_logprobs
from distserve.engine.structured_output import apply_token_bitmasks

# Logits arrive as float32, so a nucleus whose mass equals top_p exactly (0.5 + 0.3 vs 0.8) is off
# by ~1e-7 and, without this relative slack, would pull in one token more than intended.
_TOP_P_SLACK = 1e-6
# Smaller temperatures can round to 0 in float32 (0 / 0 = NaN); sampling is argmax long before.
_MIN_TEMPERATURE = 1e-5
_CDF_BLOCK = 256


@dataclass
class SamplerOutput:
    """One token per row and, if any row asked, log-probabilities under the raw logits: the chosen
    token's (every row) and the top alternatives (``[]`` for rows with ``top_logprobs`` 0)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[TopLogprobs] | None = None


class Sampler:
    """Stateless batch sampler; seeded requests bring their own ``torch.Generator``.

    Sampled rows draw one uniform each and invert the row's CDF, so a seeded row's token depends
    only on its own logits, params, tokens so far and generator. Greedy rows consume no randomness.
    Top-k and top-p keep every token tied with the last one kept (as vLLM does).
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        num_output_tokens: Sequence[int],
        eos_token_ids: Sequence[int],
        histories: Sequence[Sequence[int] | None] | None = None,
        token_bitmasks: Sequence[np.ndarray | None] | None = None,
    ) -> SamplerOutput:
        """Pick the next token of each row of ``logits`` (``[N, V]``, any float dtype, not mutated).

        Args:
            logits: ``[N, V]`` raw model logits.
            params: per-row sampling parameters.
            generators: per-row generator for seeded requests, ``None`` to use the global RNG.
            num_output_tokens: tokens each row's request has generated so far (for ``min_tokens``).
            eos_token_ids: the model's EOS ids, banned together with ``stop_token_ids`` until
                ``min_tokens`` is reached.
            histories: per row, the request's tokens so far (prompt, then its ``num_output_tokens``
                outputs); needed by the rows with penalties (``SamplingParams.has_penalties``).
            token_bitmasks: per row, the tokens its grammar allows (structured output), or None.
        Returns:
            The chosen ids and, if any row set ``logprobs``, log-probabilities.
        """
        logits = logits.detach()
        processed = process_logits(logits, params, num_output_tokens, eos_token_ids, histories, token_bitmasks)  # [N, V]
        num_rows = logits.shape[0]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            token_ids = _argmax(processed)  # [N]
        elif len(sampled_rows) == num_rows:
            token_ids = _sample(processed, params, generators)
        else:
            greedy_idx = torch.tensor([i for i, p in enumerate(params) if p.greedy])  # [G]
            sampled_idx = torch.tensor(sampled_rows)  # [S]
            token_ids = torch.empty(num_rows, dtype=torch.long)
            token_ids[greedy_idx] = _argmax(processed[greedy_idx])
            token_ids[sampled_idx] = _sample(
                processed[sampled_idx],
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
            )
        logprobs: list[float] | None = None
        top: list[TopLogprobs] | None = None
        if any(p.logprobs for p in params):
            raw = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
            logprobs = raw.gather(1, token_ids[:, None]).squeeze(1).tolist()
            if any(p.top_logprobs for p in params):
                top = top_logprobs(raw, [p.top_logprobs for p in params])
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, top_logprobs=top)


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_ids: Sequence[int],
    histories: Sequence[Sequence[int] | None] | None = None,
    token_bitmasks: Sequence[np.ndarray | None] | None = None,
) -> torch.Tensor:
    """The logits processors, in vLLM's order: each step returns its input when no row uses it, so a
    batch that uses none gets ``logits`` itself back (no copy); the first step that changes
    something makes one float32 copy, and later steps work on it in place."""
    out = _mask_min_tokens(logits, logits, params, num_output_tokens, eos_token_ids)
    out = _apply_logit_bias(logits, out, params)
    out = _apply_penalties(logits, out, params, num_output_tokens, histories)
    out = _apply_token_bitmasks(logits, out, token_bitmasks)
    return out


def _apply_token_bitmasks(raw: torch.Tensor, logits: torch.Tensor, token_bitmasks: Sequence[np.ndarray | None] | None) -> torch.Tensor:
    """Structured output: each constrained row keeps only the tokens its grammar allows next
    (``engine.structured_output``); the others at -inf."""
    if token_bitmasks is None or all(b is None for b in token_bitmasks):
        return logits
    out = _writable(raw, logits)
    apply_token_bitmasks(out, token_bitmasks)
    return out


def _writable(raw: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` if it is already the pipeline's own copy, else a float32 copy of it."""
    return logits.to(torch.float32, copy=True) if logits is raw else logits


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (``[N]``) of ``logits`` (``[N, V]``); ties go to the lowest index."""
    # numpy's argmax is ~10x faster than torch's on CPU and breaks ties the same way.
    return torch.from_numpy(logits.float().numpy().argmax(axis=-1))


def _mask_min_tokens(
    raw: torch.Tensor,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """EOS and stop ids at -inf in rows short of ``min_tokens``."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, num_generated) in enumerate(zip(params, num_output_tokens)):
        if num_generated < p.min_tokens:
            banned = {t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab_size}
            rows.extend([i] * len(banned))
            cols.extend(banned)
    if not rows:
        return logits
    logits = _writable(raw, logits)  # [N, V]
    logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits


def _apply_logit_bias(raw: torch.Tensor, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """OpenAI's ``logit_bias``: each listed token's bias added to its logit."""
    if not any(p.logit_bias for p in params):
        return logits
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    biases: list[np.ndarray] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            ids, values = zip(*p.logit_bias)  # unique ids per row (``SamplingParams`` dedups them)
            rows.append(np.full(len(ids), i, dtype=np.int64))
            cols.append(np.fromiter(ids, dtype=np.int64, count=len(ids)))  # ~10x faster than torch.tensor(list)
            biases.append(np.fromiter(values, dtype=np.float32, count=len(ids)))
    col = np.concatenate(cols)  # [B]
    in_vocab = col < logits.shape[1]  # checked against the vocabulary at submission; a guard here
    index = (torch.from_numpy(np.concatenate(rows)[in_vocab]), torch.from_numpy(col[in_vocab]))  # [B], [B]
    logits = _writable(raw, logits)  # [N, V]
    logits[index] += torch.from_numpy(np.concatenate(biases)[in_vocab])
    return logits


def _apply_penalties(
    raw: torch.Tensor,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    histories: Sequence[Sequence[int] | None] | None,
) -> torch.Tensor:
    """vLLM's ``apply_penalties``: ``repetition_penalty`` over every token of the prompt and output (a
    positive logit divided by it, a negative one multiplied), then, over the output tokens only,
    ``frequency_penalty`` times each token's count and ``presence_penalty`` once per token present,
    both subtracted (OpenAI's definition).

    Only the (row, token) pairs a row has seen change, so only they are touched: gathered, penalised
    and written back (dense ``[N, V]`` masks, as vLLM builds on a GPU, cost ~10x more at 32 rows on a CPU).
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    if histories is None or any(histories[i] is None for i in rows):
        raise ValueError("penalties need each penalised row's tokens so far (histories)")
    num_rows, vocab_size = logits.shape
    tokens = [np.asarray(histories[i], dtype=np.int64) for i in rows]  # each [L]: prompt, then outputs
    # Each (row, token) pair as one key, row * V + token, so one np.unique serves every row.
    seen_keys = np.concatenate([_keys(row, t, vocab_size) for row, t in zip(rows, tokens)])
    output_keys = np.concatenate([_keys(row, t[len(t) - num_output_tokens[row] :], vocab_size) for row, t in zip(rows, tokens)])
    seen = np.unique(seen_keys)  # [S], sorted
    output_ids, output_counts = np.unique(output_keys, return_counts=True)
    counts = np.zeros(len(seen), dtype=np.float32)  # [S]: each pair's count in the row's output
    counts[np.searchsorted(seen, output_ids)] = output_counts
    seen_rows = seen // vocab_size  # [S]

    def per_pair(name: str, neutral: float) -> torch.Tensor:  # [S]: the pair's row's parameter
        values = np.full(num_rows, neutral, dtype=np.float32)
        values[rows] = [getattr(params[i], name) for i in rows]
        return torch.from_numpy(values[seen_rows])

    index = (torch.from_numpy(seen_rows), torch.from_numpy(seen % vocab_size))  # [S], [S]
    count_t = torch.from_numpy(counts)  # [S]
    repetition = per_pair("repetition_penalty", 1.0)
    logits = _writable(raw, logits)  # [N, V]
    values = logits[index]  # [S]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= per_pair("frequency_penalty", 0.0) * count_t + per_pair("presence_penalty", 0.0) * (count_t > 0)
    logits[index] = values
    return logits


def _keys(row: int, tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """``row * vocab_size + token`` for each token id of ``tokens`` within the vocabulary."""
    return row * vocab_size + tokens[(tokens >= 0) & (tokens < vocab_size)]


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Sample one token per row of ``logits`` (``[M, V]``, non-greedy rows); returns ``[M]`` ids."""
    temperature = torch.tensor([max(p.temperature, _MIN_TEMPERATURE) for p in params])  # [M]
    logits = logits.float()
    # One buffer updated in place: fresh 6 MB tensors cost more in page faults than the math.
    weights = (logits - logits.amax(dim=-1, keepdim=True)).div_(temperature[:, None]).exp_()
    if any(p.min_p for p in params):
        # Weights are probabilities scaled so the top one is 1: min_p's cut (min_p x the top
        # probability) is min_p itself. Applied before top-k and top-p, as vLLM does.
        min_p = np.array([p.min_p for p in params], dtype=np.float32)  # [M]
        weights_np = weights.numpy()  # [M, V], shares memory
        np.multiply(weights_np, weights_np >= min_p[:, None], out=weights_np)
    threshold = _filter_thresholds(weights, params)  # [M]
    if threshold is not None:
        # Multiplying by a bool mask in numpy is ~5x faster than torch's masked_fill_ on CPU.
        weights_np = weights.numpy()  # [M, V], shares memory
        np.multiply(weights_np, weights_np >= threshold[:, None], out=weights_np)
    return _inverse_cdf(weights, _uniforms(generators))


def _uniforms(generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row: from the row's generator, else the global RNG."""
    uniforms = torch.empty(len(generators), dtype=torch.float64)  # [M]
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        uniforms[torch.tensor(unseeded)] = torch.rand(len(unseeded), dtype=torch.float64)
    for j, generator in enumerate(generators):
        if generator is not None:
            uniforms[j] = torch.rand(1, dtype=torch.float64, generator=generator)[0]
    return uniforms


def _filter_thresholds(
    weights: torch.Tensor, params: Sequence[SamplingParams]
) -> np.ndarray | None:
    """Per row of ``weights`` (``[M, V]``, unnormalised probs with max 1), the smallest weight kept
    by top-k and then top-p (``[M]``, 0 for unfiltered rows), or None if no row filters. Ties
    with it are kept."""
    num_rows, vocab_size = weights.shape
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    filtered = [j for j, p in enumerate(params) if p.top_p < 1 or top_k[j] < vocab_size]
    if not filtered:
        return None
    # numpy's partition and values-only sort are several times faster than torch.topk/sort on CPU.
    values = weights.numpy()  # [M, V], shares memory
    threshold = np.zeros(num_rows, dtype=np.float32)  # [M]
    for k in sorted({top_k[j] for j in filtered}):
        rows = [j for j in filtered if top_k[j] == k]
        candidates = values if len(rows) == num_rows else values[rows]  # [R, V]
        if k < vocab_size:
            candidates = np.partition(candidates, vocab_size - k, axis=-1)[:, vocab_size - k :]
            threshold[rows] = candidates[:, 0]  # [R, k], k-th largest first
        nucleus = [i for i, j in enumerate(rows) if params[j].top_p < 1]
        if nucleus:
            top_p = torch.tensor([params[rows[i]].top_p for i in nucleus], dtype=torch.float64)
            nucleus_candidates = candidates if len(nucleus) == len(rows) else candidates[nucleus]
            threshold[[rows[i] for i in nucleus]] = _nucleus_threshold(
                np.sort(nucleus_candidates, axis=-1), top_p
            )
    return threshold


def _nucleus_threshold(ascending: np.ndarray, top_p: torch.Tensor) -> np.ndarray:
    """Smallest weight (``[R]``) of the fewest largest entries of each row of ``ascending``
    (``[R, L]`` sorted weights) that hold at least ``top_p`` (``[R]``) of the row's mass."""
    sorted_weights = torch.from_numpy(ascending)  # [R, L]
    num_dropped = _inverse_cdf(sorted_weights, 1.0 - top_p + _TOP_P_SLACK)  # [R]
    return sorted_weights.gather(1, num_dropped[:, None]).squeeze(1).numpy()


def _inverse_cdf(weights: torch.Tensor, quantiles: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights`` (``[R, L]`` float32, >= 0), the first index whose cumulative weight
    exceeds ``quantiles`` (``[R]`` float64, in [0, 1]) times the row total; always an index of
    positive weight, so masked entries are never returned.

    Two levels (float32 block sums, then a float64 cumsum inside one block) cost ~5x less than a
    float64 cumsum of the whole row and keep every entry's share exact to ~1e-6 relative.
    """
    num_rows, length = weights.shape
    num_full_blocks = length // _CDF_BLOCK
    weights_np = weights.numpy()
    full = weights_np[:, : num_full_blocks * _CDF_BLOCK].reshape(num_rows, -1, _CDF_BLOCK)
    block_mass = full.sum(axis=-1)  # [R, num_full_blocks]; per-row order, unlike torch's sum
    if length % _CDF_BLOCK:
        tail = weights_np[:, num_full_blocks * _CDF_BLOCK :].sum(axis=-1, keepdims=True)  # [R, 1]
        block_mass = np.concatenate([block_mass, tail], axis=1)  # [R, num_blocks]
    block_cdf = torch.from_numpy(block_mass).cumsum(dim=-1, dtype=torch.float64)  # [R, num_blocks]
    block, fraction = _locate(block_cdf, quantiles)  # [R], [R]
    columns = block[:, None] * _CDF_BLOCK + torch.arange(_CDF_BLOCK)  # [R, BLOCK]
    in_block = weights.gather(1, columns.clamp(max=length - 1)) * (columns < length)  # [R, BLOCK]
    offset, _ = _locate(in_block.cumsum(dim=-1, dtype=torch.float64), fraction)  # [R]
    return block * _CDF_BLOCK + offset


def _locate(cdf: torch.Tensor, quantiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``cdf`` (``[R, L]``, nondecreasing, positive total), the first index whose value
    exceeds ``quantiles`` (``[R]``) times the total, and where in ``[0, 1]`` that target falls
    inside the chosen entry's own mass."""
    total = cdf[:, -1:]  # [R, 1]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # [R, 1]
    target = torch.minimum(quantiles[:, None] * total, below_total)  # [R, 1]
    index = torch.searchsorted(cdf, target, right=True)  # [R, 1]
    upper = cdf.gather(1, index)  # [R, 1]
    lower = cdf.gather(1, (index - 1).clamp(min=0)).masked_fill_(index == 0, 0.0)  # [R, 1]
    fraction = ((target - lower) / (upper - lower)).clamp_(0.0, 1.0)  # [R, 1]
    return index.squeeze(1), fraction.squeeze(1)
