"""How many tokens one step may compute: the step budget policies, chosen by name.

``static``: ``SchedulerConfig.max_num_batched_tokens`` every step (whole prompts join the running
decodes unless chunked prefill is on, so every arrival stretches the decodes' step).

``slo`` (Sarathi-style): the prefill tokens that keep a step within the TPOT SLO
(``SchedulerConfig.tpot_slo_s``) next to the decodes it runs, so prompts are chunked to fit and a
colocated instance meets TPOT while it prefills. The step time comes from a linear model fitted
online, by exponentially weighted recursive least squares, to the instance's own steps as its
driver reports them (``observe``): measured time on the real runtime, modelled time in the
simulator — the same policy code either way.

The step *composition* policy (``SchedulerConfig.step_policy``, ``STEP_POLICIES``) says which
tokens may share a step; the scheduler (``Scheduler._schedule``) applies it, so the real engine and
the simulator compose steps alike.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

from distserve.config import SchedulerConfig
from distserve.errors import InvalidConfigError

class StepBudget(ABC):
    """A token budget per step, told how long each executed step took."""

    @abstractmethod
    def tokens(self, num_decodes: int, decode_ctx: int) -> int:
        """Tokens the next step may compute (its decodes' one token each included), given the
        ``num_decodes`` running sequences and their total context ``decode_ctx``."""

    def observe(self, num_decodes: int, decode_ctx: int, num_prefill_tokens: int, seconds: float) -> None:
        """A step with this shape took ``seconds``."""

    @property
    def chunks_prefills(self) -> bool:
        """True if prompts are split to fit the budget whatever ``enable_chunked_prefill`` says."""
        return False


class StaticBudget(StepBudget):
    def __init__(self, config: SchedulerConfig) -> None:
        self.limit = config.max_num_batched_tokens

    def tokens(self, num_decodes: int, decode_ctx: int) -> int:
        return self.limit


class SLOBudget(StepBudget):
    """Prefill tokens that keep the predicted step time within ``headroom × tpot_slo_s``.

    Model: ``t = w0 + w1·num_decodes + w2·decode_ctx/1000 + w3·prefill_tokens``. Until it has seen
    ``MIN_OBSERVATIONS`` steps, some of them with prefill, the budget is ``max_num_batched_tokens``.
    At least ``min_prefill_tokens`` prefill tokens are allowed per step, so prompts always advance
    even when the decodes alone take the whole SLO; a step with no decodes runs prompts whole (there
    is no TPOT to protect, and chunking would only delay their first token).
    """

    MIN_OBSERVATIONS = 6
    FORGETTING = 0.98  # weight of the past per step: the model follows load and context drift
    HEADROOM = 0.9
    INITIAL_COVARIANCE = 1e3  # per weight: the prior's uncertainty, and the most forgetting may restore

    def __init__(self, config: SchedulerConfig) -> None:
        if config.tpot_slo_s is None:
            raise InvalidConfigError("step_budget 'slo' needs tpot_slo_s")
        self.tpot_slo_s = config.tpot_slo_s
        self.max_tokens = config.max_num_batched_tokens
        self.min_prefill_tokens = min(config.min_prefill_chunk, config.max_num_batched_tokens)
        self.weights = [0.0, 0.0, 0.0, 0.0]  # [w0, w1, w2, w3]
        # The inverse information matrix of the weighted least squares (4 x 4, symmetric): its upper
        # triangle, row by row (p00 p01 p02 p03 p11 p12 p13 p22 p23 p33).
        self._p = _prior(self.INITIAL_COVARIANCE)
        self.num_observations = 0
        self.num_prefill_observations = 0

    @property
    def chunks_prefills(self) -> bool:
        return True

    def tokens(self, num_decodes: int, decode_ctx: int) -> int:
        if num_decodes == 0:
            return self.max_tokens  # no decode's TPOT to protect: prompts run whole (TTFT first)
        if self.num_observations < self.MIN_OBSERVATIONS or self.num_prefill_observations < 2:
            return self.max_tokens
        w0, w1, w2, w3 = self.weights
        base = w0 + w1 * num_decodes + w2 * decode_ctx / 1000.0
        if not (w3 > 0 and math.isfinite(base)):  # no usable model (also: never a NaN budget)
            return self.max_tokens
        prefill = int((self.HEADROOM * self.tpot_slo_s - base) / w3)
        prefill = max(self.min_prefill_tokens, min(prefill, self.max_tokens - num_decodes))
        return num_decodes + prefill

    def observe(self, num_decodes: int, decode_ctx: int, num_prefill_tokens: int, seconds: float) -> None:
        # Recursive least squares on x = [1, num_decodes, decode_ctx / 1000, num_prefill_tokens], in plain
        # floats (the simulator calls this every step; numpy's calls cost twice the arithmetic on 4 x 4).
        # Each sum is added up in the order numpy's matrix-vector and dot products used for it here (the
        # same results as the numpy version this replaced, to the bit).
        x1, x2, x3 = float(num_decodes), decode_ctx / 1000.0, float(num_prefill_tokens)
        lam = self.FORGETTING
        p = self._p
        while True:
            p00, p01, p02, p03, p11, p12, p13, p22, p23, p33 = p
            px0 = (p00 + p02 * x2) + (p01 * x1 + p03 * x3)  # P @ x
            px1 = (p01 + p12 * x2) + (p11 * x1 + p13 * x3)
            px2 = (p02 + p22 * x2) + (p12 * x1 + p23 * x3)
            px3 = (p03 + p23 * x2) + (p13 * x1 + p33 * x3)
            denom = lam + (((px0 + x1 * px1) + x2 * px2) + x3 * px3)
            if denom > 0 or p is not self._p:
                break
            p = _prior(self.INITIAL_COVARIANCE)  # rounding cost P its positive definiteness: its uncertainty starts afresh
        g0, g1, g2, g3 = px0 / denom, px1 / denom, px2 / denom, px3 / denom  # the gain
        w0, w1, w2, w3 = self.weights
        err = seconds - (((w0 + x1 * w1) + x2 * w2) + x3 * w3)
        self.weights = [w0 + g0 * err, w1 + g1 * err, w2 + g2 * err, w3 + g3 * err]
        # P - gain · (P x)ᵀ, made symmetric again: (q_ij + q_ji) / 2
        p = [  # (a new list: the loop above compares with the old one)
            ((p00 - g0 * px0) + (p00 - g0 * px0)) / 2, ((p01 - g0 * px1) + (p01 - g1 * px0)) / 2,
            ((p02 - g0 * px2) + (p02 - g2 * px0)) / 2, ((p03 - g0 * px3) + (p03 - g3 * px0)) / 2,
            ((p11 - g1 * px1) + (p11 - g1 * px1)) / 2, ((p12 - g1 * px2) + (p12 - g2 * px1)) / 2,
            ((p13 - g1 * px3) + (p13 - g3 * px1)) / 2, ((p22 - g2 * px2) + (p22 - g2 * px2)) / 2,
            ((p23 - g2 * px3) + (p23 - g3 * px2)) / 2, ((p33 - g3 * px3) + (p33 - g3 * px3)) / 2,
        ]
        # Covariance windup: in a steady stretch (the same batch shape step after step) the steps carry
        # no news along the other directions, and dividing by lam grows P there by 1/lam a step, to
        # overflow and NaN weights after ~35k steps. Forgetting stops once P is back at the prior's size.
        self._p = [v / lam for v in p] if all(map(self.INITIAL_COVARIANCE.__gt__, map(abs, p))) else p  # (a NaN: kept)
        self.num_observations += 1
        self.num_prefill_observations += num_prefill_tokens > 0


def _prior(covariance: float) -> list[float]:
    """``SLOBudget``'s P before any step: ``covariance`` × the identity (its upper triangle)."""
    return [covariance, 0.0, 0.0, 0.0, covariance, 0.0, 0.0, covariance, 0.0, covariance]


STEP_POLICIES: dict[str, str] = {
    "mixed": "admitted prompts join the running decodes' step (within the step budget): our default",
    # vLLM 0.1-0.2 (2023), the baseline DistServe measured against: its scheduler tried the waiting
    # prompts first and, if it admitted any, returned a prompt-only batch; else it decoded everything.
    "vllm-2023": "a step that admits waiting prompts runs only them, whole (no chunking), the running decodes "
    "pause for it; otherwise all running sequences decode",
}

STEP_BUDGETS: dict[str, type[StepBudget]] = {"static": StaticBudget, "slo": SLOBudget}


def make_step_budget(config: SchedulerConfig) -> StepBudget:
    if config.step_budget not in STEP_BUDGETS:
        raise InvalidConfigError(f"unknown step_budget {config.step_budget!r}; choose from {sorted(STEP_BUDGETS)}")
    return STEP_BUDGETS[config.step_budget](config)
