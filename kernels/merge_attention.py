"""Merging partial attention outputs over disjoint key sets by their log-sum-exp (split-K chunks,
cascade prefix/suffix parts).

Log-sum-exp convention: natural log, as torch's flash kernels return it. FlashInfer's ``merge_state``
and its wrappers use base 2 (``lse2 = lse / ln 2``); ``lse_from_base2`` / ``lse_to_base2`` convert.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

LN2 = math.log(2.0)


def lse_from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """A base-2 log-sum-exp (FlashInfer's ``log2 Σ e^s``) as a natural one: ``ln Σ e^s = ln 2 · log2 Σ e^s``."""
    return lse2 * LN2


def lse_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """A natural log-sum-exp as FlashInfer's base-2 one."""
    return lse / LN2


def merge_attention_states(
    outputs: torch.Tensor | Sequence[torch.Tensor],  # P × [..., D] (or stacked [P, ..., D])
    lses: torch.Tensor | Sequence[torch.Tensor],  # P × [...] natural-log LSE (or stacked [P, ...])
) -> tuple[torch.Tensor, torch.Tensor]:  # ([..., D] in outputs' dtype, [...] fp32)
    """Attention over the union of P disjoint key sets from each part's output and log-sum-exp.

    ``out = Σ_p exp(lse_p - lse) · o_p`` with ``lse = log Σ_p exp(lse_p)``, accumulated in fp32. A
    part with ``lse = -inf`` (no keys) weighs 0, whatever its output holds; if every part is empty
    the result is 0 with ``lse = -inf``.
    """
    o = outputs if isinstance(outputs, torch.Tensor) else torch.stack(list(outputs))
    s = lses if isinstance(lses, torch.Tensor) else torch.stack(list(lses))
    if o.shape[:-1] != s.shape:
        raise ValueError(f"outputs {tuple(o.shape)} and lses {tuple(s.shape)} do not match (parts first, head dim last)")
    s = s.float()
    peak = s.amax(0)  # [...]
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)  # all parts empty: avoid -inf - -inf
    weights = torch.exp(s - peak)  # [P, ...], 0 for empty parts
    total = weights.sum(0)  # [...]
    # Empty parts may hold NaN/garbage; where() keeps 0 · NaN out of the sum.
    parts = torch.where((weights > 0).unsqueeze(-1), o.float() * weights.unsqueeze(-1), 0.0)
    out = parts.sum(0) / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return out.to(o.dtype), torch.log(total) + peak
