"""Simulator workloads: request-length distributions, arrival processes and JSONL traces.

The synthetic length distributions imitate published statistics (copied below from
``workload-stats.json``, entry names quoted so they can be traced back). Each is a lognormal per
length, fitted so that the *bounded* distribution has exactly the published mean and, as closely
as a lognormal can, the published median; prompt and output lengths are drawn independently
(published correlations are small: Azure 2023 conv -0.11, code 0.00).

| workload | dataset entry (``name`` in workload-stats.json) | prompt mean / median [bounds] | output mean / median [bounds] |
|---|---|---|---|
| ``chatbot`` | ``sharegpt_v3_vllm_sampler_opt_thirdparty`` | 228 / 97 (fit 105) [4, 1024] | 226 / 160 (a) [4, 2044] |
| ``code`` | ``humaneval_distserve_style_computed`` | 171.35 / 146.5 [55, 629] | 98.17 / 79.0 [9, 514] |
| ``summarization`` | ``arxiv_summarization_4k_vidur`` | 2588.08 / 2730 [1, 4054] | 291.43 / 167 [5, 4056] |

Sources: ``chatbot`` - a third-party recomputation of ShareGPT_V3_unfiltered_cleaned_split.json with
vLLM's ShareGPTDataset filters and the facebook/opt-13b tokenizer; ``code`` - openai/human-eval
HumanEval.jsonl.gz (164 problems, prompt + canonical solution as DistServe's 0-prepare-dataset.py
builds them, GPT-2/OPT BPE); ``summarization`` - microsoft/vidur
data/processed_traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv (28,257 rows,
Llama-2 tokenizer, total <= 4K).

(a) ShareGPT's output median is unpublished: 160 keeps the output mean/median ratio (197/139) of
LMSYS-Chat-1M (entry ``lmsys_chat_1m_4k_vidur``). The output cap 2044 follows vLLM's sampler
filter (prompt + output <= 2048, prompt >= 4). ShareGPT's prompt median cannot be matched: no
lognormal bounded to [4, 1024] with mean 228 has a median below ~103; the fit gives 105.

Why these entries: DistServe evaluates chatbot on ShareGPT, code completion on HumanEval and
summarization on LongBench, all with OPT's tokenizer. LongBench has no published length numbers
(DistServe's prep keeps prompts of 1900-2040 tokens), so ``summarization`` uses the arXiv entry
with full statistics; ``generate_requests(..., max_total_len=2048)`` then truncates its prompts to
``2048 - output_len``, which is how DistServe's LongBench prompts are built. Alternative published
parameters for ``code``: ``AZURE2023_CODE.build("code")`` (Splitwise's Azure 2023 code trace,
entry ``azure2023_code``: prompt 2047.85 / 1469, output 27.88 / 13).

Bounds truncate (out-of-range draws are redrawn) rather than clip: the datasets *drop* requests
outside their filters, and clipping would pile mass on the cap. Every published statistic above
is a target parameter of the factory (``chatbot_lengths(prompt_mean=300)`` etc.).
"""

from __future__ import annotations

import functools
import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
from scipy import optimize, special

from distserve.errors import InvalidConfigError

__all__ = [
    "ARRIVAL_PROCESSES", "ARXIV_4K_LLAMA2", "AZURE2023_CODE", "HUMANEVAL_OPT", "LENGTH_DISTRIBUTIONS", "SHAREGPT_OPT",
    "FixedLengths", "LengthDistribution", "LengthTarget",
    "LogNormalLengths", "PublishedLengths", "Request", "TraceLengths", "arrival_times", "chatbot_lengths",
    "code_lengths", "describe", "generate_requests", "get_length_distribution", "load_trace", "rescale",
    "summarization_lengths", "write_trace",
]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload: when it arrives and how many tokens it reads and writes."""

    req_id: int
    arrival_s: float
    prompt_len: int
    output_len: int  # tokens to generate, >= 1
    slo_class: str | None = None
    # The prompt itself, where its content matters (prefix caching and affinity routing); None:
    # synthetic, every prompt token the same.
    prompt_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise InvalidConfigError(
                f"request {self.req_id}: prompt_len and output_len must be >= 1, got {self.prompt_len} and {self.output_len}"
            )
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise InvalidConfigError(
                f"request {self.req_id}: prompt_token_ids has {len(self.prompt_token_ids)} tokens, prompt_len is {self.prompt_len}"
            )


# ---- length distributions ------------------------------------------------------------------
def _check_int(name: str, value: Any, minimum: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidConfigError(f"{name} must be an integer >= {minimum}{' ' + why if why else ''}, got {value!r}")


class LengthDistribution(ABC):
    """Draws (prompt_len, output_len) pairs for synthetic requests."""

    name: str
    description: str  # which published statistics it imitates, with source

    @abstractmethod
    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Draw ``n`` requests' lengths.

        Args:
            n: number of requests.
            rng: the random stream (the caller owns seeding).
        Returns:
            (prompt_lens, output_lens), int64 arrays of length n, every value >= 1.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@dataclass(frozen=True)
class LengthTarget:
    """Published statistics of one length (prompt or output) that a lognormal is fitted to.

    The fit matches ``mean`` exactly and then ``median`` (or ``p90`` when the median is unknown);
    with neither, ``sigma`` (log-space standard deviation) fixes the shape. Draws lie in
    [``min``, ``max``] (``max=None``: unbounded).
    """

    mean: float
    median: float | None = None
    p90: float | None = None
    min: int = 1
    max: int | None = None
    sigma: float | None = None

    def __post_init__(self) -> None:
        upper = math.inf if self.max is None else self.max
        if self.min < 1 or not self.min < upper:
            raise InvalidConfigError(f"length bounds must satisfy 1 <= min < max, got min={self.min}, max={self.max}")
        for key in ("mean", "median", "p90"):
            value = getattr(self, key)
            if value is not None and not self.min < value < upper:
                raise InvalidConfigError(f"length {key}={value} must lie strictly inside [min={self.min}, max={self.max}]")
        if self.sigma is not None and not (math.isfinite(self.sigma) and self.sigma > 0):
            raise InvalidConfigError(f"length sigma must be a positive number, got {self.sigma}")
        if self.median is None and self.p90 is None and self.sigma is None:
            raise InvalidConfigError("a length target needs a median, a p90 or a sigma to fix its shape")


def _log_mass(hi: float, lo: float) -> float:
    """log(Phi(hi) - Phi(lo)) for hi > lo, accurate in both tails."""
    if lo > 0:  # upper tail: use the mirrored, small probabilities
        hi, lo = -lo, -hi
    log_hi, log_lo = float(special.log_ndtr(hi)), float(special.log_ndtr(lo))
    return log_hi + math.log1p(-math.exp(log_lo - log_hi)) if log_lo < log_hi else -math.inf


@dataclass(frozen=True)
class _BoundedLogNormal:
    """exp(N(mu, sigma^2)) conditioned on [lo, hi]."""

    mu: float
    sigma: float
    lo: float
    hi: float

    @property
    def _alpha_beta(self) -> tuple[float, float]:
        return (math.log(self.lo) - self.mu) / self.sigma, (math.log(self.hi) - self.mu) / self.sigma

    def mean(self) -> float:
        alpha, beta = self._alpha_beta
        s = self.sigma
        return math.exp(self.mu + s * s / 2 + _log_mass(beta - s, alpha - s) - _log_mass(beta, alpha))

    def quantile(self, q: float | np.ndarray) -> Any:
        alpha, beta = self._alpha_beta
        if alpha > 0:  # all mass in the upper tail: work with survival probabilities
            lo_p, hi_p = special.ndtr(-beta), special.ndtr(-alpha)
            return np.exp(self.mu - self.sigma * special.ndtri(hi_p - q * (hi_p - lo_p)))
        lo_p, hi_p = special.ndtr(alpha), special.ndtr(beta)
        return np.exp(self.mu + self.sigma * special.ndtri(lo_p + q * (hi_p - lo_p)))


_SIGMA_GRID = np.geomspace(0.02, 8.0, 96)


def _mu_for_mean(mean: float, sigma: float, lo: float, hi: float) -> float | None:
    """The mu giving the bounded distribution this mean (None if no mu does)."""

    def gap(mu: float) -> float:
        return math.log(_BoundedLogNormal(mu, sigma, lo, hi).mean()) - math.log(mean)

    # Far outside [lo, hi] the bounded density is x^(k-1) with k ~ (mu - log x) / sigma^2, so the
    # span grows with sigma^2 to reach means close to either bound.
    span = 5 + 10 * sigma + 20 * sigma**2
    a, b = math.log(lo) - span, math.log(hi) + span
    if not gap(a) < 0 < gap(b):
        return None
    return optimize.brentq(gap, a, b, xtol=1e-10)


@functools.lru_cache(maxsize=64)
def _fit(target: LengthTarget) -> _BoundedLogNormal:
    lo, hi = float(target.min), math.inf if target.max is None else float(target.max)
    hi_fit = min(hi, 1e15)  # keeps log(hi) finite

    def dist(sigma: float) -> _BoundedLogNormal | None:
        mu = _mu_for_mean(target.mean, sigma, lo, hi_fit)
        return None if mu is None else _BoundedLogNormal(mu, sigma, lo, hi_fit)

    unreachable = InvalidConfigError(f"no lognormal bounded to [{target.min}, {target.max}] fits {target}")
    if target.median is None and target.p90 is None:
        assert target.sigma is not None
        fitted = dist(target.sigma)
        if fitted is None:
            raise unreachable
        return fitted
    q, value = (0.5, target.median) if target.median is not None else (0.9, target.p90)
    assert value is not None

    def miss(sigma: float) -> float:
        fitted = dist(sigma)
        return math.nan if fitted is None else math.log(float(fitted.quantile(q))) - math.log(value)

    misses = np.array([miss(s) for s in _SIGMA_GRID])
    for i in range(len(misses) - 1):
        if misses[i] == 0 or misses[i] * misses[i + 1] < 0:
            return dist(optimize.brentq(miss, _SIGMA_GRID[i], _SIGMA_GRID[i + 1], xtol=1e-8))  # type: ignore[return-value]
    if np.all(np.isnan(misses)):
        raise unreachable
    # Unreachable quantile (e.g. ShareGPT's prompt median): keep the mean, get as close as possible.
    return dist(float(_SIGMA_GRID[int(np.nanargmin(np.abs(misses)))]))  # type: ignore[return-value]


def _bounded_ints(values: np.ndarray, target: LengthTarget) -> np.ndarray:
    upper = np.iinfo(np.int64).max if target.max is None else target.max
    return np.clip(np.rint(values), target.min, upper).astype(np.int64)


class LogNormalLengths(LengthDistribution):
    """Independent bounded lognormal prompt and output lengths fitted to published statistics."""

    def __init__(
        self, prompt: LengthTarget, output: LengthTarget, name: str = "lognormal", source: str = "custom statistics"
    ):
        self.name = name
        self.prompt, self.output = prompt, output
        self._prompt_dist, self._output_dist = _fit(prompt), _fit(output)
        fits = (("prompt", prompt, self._prompt_dist), ("output", output, self._output_dist))
        self.description = f"{source}; " + "; ".join(self._describe_fit(*fit) for fit in fits)

    @staticmethod
    def _describe_fit(label: str, target: LengthTarget, dist: _BoundedLogNormal) -> str:
        parts = [f"mean {target.mean:g}"]
        for key, q in (("median", 0.5), ("p90", 0.9)):
            published = getattr(target, key)
            if published is not None:
                parts.append(f"{key} {published:g} (fit {float(dist.quantile(q)):.0f})")
        upper = "inf" if target.max is None else str(target.max)
        return f"{label} {', '.join(parts)} in [{target.min}, {upper}]"

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        prompt_lens = _bounded_ints(self._prompt_dist.quantile(rng.random(n)), self.prompt)  # [n]
        output_lens = _bounded_ints(self._output_dist.quantile(rng.random(n)), self.output)  # [n]
        return prompt_lens, output_lens


@dataclass(frozen=True)
class PublishedLengths:
    """One dataset entry's length statistics, copied from ``workload-stats.json``."""

    entry: str  # the entry's "name" field
    source: str
    prompt: LengthTarget
    output: LengthTarget

    def build(self, workload: str, **overrides: float) -> LogNormalLengths:
        """A ``LogNormalLengths`` with these statistics, any of them overridden by keyword
        (``prompt_mean``, ``prompt_median``, ``prompt_p90``, ``prompt_min``, ``prompt_max``,
        ``prompt_sigma`` and the same with ``output_``)."""
        changes: dict[str, dict[str, Any]] = {"prompt": {}, "output": {}}
        valid = [f"{side}_{f.name}" for side in changes for f in fields(LengthTarget)]
        for key, value in overrides.items():
            side, _, stat = key.partition("_")
            if key not in valid:
                raise InvalidConfigError(
                    f"unknown parameter {key!r} for workload {workload!r}; choose from {', '.join(valid)}"
                )
            changes[side][stat] = value
        prompt, output = replace(self.prompt, **changes["prompt"]), replace(self.output, **changes["output"])
        if (prompt, output) == (self.prompt, self.output):
            source = f"imitates {self.entry} ({self.source})"
        else:
            source = f"custom statistics (defaults: {self.entry})"
        return LogNormalLengths(prompt, output, name=workload, source=source)


# Published statistics (the numbers the defaults use; see the module docstring).
SHAREGPT_OPT = PublishedLengths(
    entry="sharegpt_v3_vllm_sampler_opt_thirdparty",
    source="ShareGPT_V3_unfiltered_cleaned_split.json recomputed with vLLM's ShareGPTDataset rules, facebook/opt-13b "
    "tokenizer; output median 160 assumed from lmsys_chat_1m_4k_vidur's output mean/median ratio",
    prompt=LengthTarget(mean=228.0, median=97.0, min=4, max=1024),
    output=LengthTarget(mean=226.0, median=160.0, min=4, max=2044),
)
HUMANEVAL_OPT = PublishedLengths(
    entry="humaneval_distserve_style_computed",
    source="openai/human-eval HumanEval.jsonl.gz, 164 problems, prompt + canonical_solution as in DistServe's "
    "0-prepare-dataset.py, GPT-2/OPT BPE + BOS",
    prompt=LengthTarget(mean=171.35, median=146.5, p90=278.4, min=55, max=629),
    output=LengthTarget(mean=98.17, median=79.0, p90=194.4, min=9, max=514),
)
ARXIV_4K_LLAMA2 = PublishedLengths(
    entry="arxiv_summarization_4k_vidur",
    source="microsoft/vidur data/processed_traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv, "
    "28,257 rows, Llama-2 tokenizer",
    prompt=LengthTarget(mean=2588.08, median=2730.0, p90=3702.0, min=1, max=4054),
    output=LengthTarget(mean=291.43, median=167.0, p90=372.0, min=5, max=4056),
)
# Splitwise's coding trace, an alternative for ``code``: ``AZURE2023_CODE.build("code")``.
AZURE2023_CODE = PublishedLengths(
    entry="azure2023_code",
    source="Azure/AzurePublicDataset data/AzureLLMInferenceTrace_code.csv (Splitwise), 8,819 requests, "
    "production token counts",
    prompt=LengthTarget(mean=2047.85, median=1469.0, p90=5187.6, min=3, max=7437),
    output=LengthTarget(mean=27.88, median=13.0, p90=55.0, min=6, max=1899),
)


def chatbot_lengths(**overrides: float) -> LogNormalLengths:
    """ShareGPT-like chat lengths (DistServe's chatbot workload); keywords as ``PublishedLengths.build``."""
    return SHAREGPT_OPT.build("chatbot", **overrides)


def code_lengths(**overrides: float) -> LogNormalLengths:
    """HumanEval-like code-completion lengths (DistServe's code workload)."""
    return HUMANEVAL_OPT.build("code", **overrides)


def summarization_lengths(**overrides: float) -> LogNormalLengths:
    """arXiv-summarization-like long-prompt lengths (stands in for DistServe's LongBench)."""
    return ARXIV_4K_LLAMA2.build("summarization", **overrides)


class FixedLengths(LengthDistribution):
    """Every request has the same prompt and output length (deterministic service, M/D/1 tests)."""

    def __init__(self, prompt_len: int, output_len: int):
        _check_int("fixed lengths: prompt_len", prompt_len, 1)
        _check_int("fixed lengths: output_len", output_len, 1)
        self.prompt_len, self.output_len = int(prompt_len), int(output_len)
        self.name = f"fixed:{self.prompt_len}:{self.output_len}"
        self.description = f"constant prompt {self.prompt_len} and output {self.output_len} tokens"

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return np.full(n, self.prompt_len, dtype=np.int64), np.full(n, self.output_len, dtype=np.int64)


class TraceLengths(LengthDistribution):
    """Resamples (prompt_len, output_len) pairs, with replacement, from a JSONL trace."""

    def __init__(self, path: str | os.PathLike[str]):
        requests = load_trace(path)
        self.path = os.fspath(path)
        self.prompt_lens = np.array([r.prompt_len for r in requests], dtype=np.int64)  # [num_trace]
        self.output_lens = np.array([r.output_len for r in requests], dtype=np.int64)  # [num_trace]
        self.name = f"trace:{os.path.basename(self.path)}"
        self.description = (
            f"(prompt_len, output_len) pairs resampled from {self.path} ({len(requests)} requests; prompt mean "
            f"{self.prompt_lens.mean():.1f}, output mean {self.output_lens.mean():.1f})"
        )

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        idx = rng.integers(0, len(self.prompt_lens), size=n)
        return self.prompt_lens[idx], self.output_lens[idx]


LENGTH_DISTRIBUTIONS: dict[str, Callable[..., LengthDistribution]] = {
    "chatbot": chatbot_lengths,
    "code": code_lengths,
    "summarization": summarization_lengths,
    "fixed": FixedLengths,  # FixedLengths(prompt_len, output_len), or the spec "fixed:<prompt>:<output>"
    "trace": TraceLengths,  # TraceLengths(path), or the spec "<path>.jsonl"
}
_SPEC_CHOICES = "chatbot, code, summarization, fixed:<prompt>:<output>, or a path to a .jsonl trace"


def get_length_distribution(spec: str, **params: Any) -> LengthDistribution:
    """The length distribution named by ``spec``.

    Args:
        spec: ``"chatbot" | "code" | "summarization" | "fixed:<prompt>:<output>"`` or the path of a
            ``.jsonl`` trace whose (prompt_len, output_len) pairs are resampled.
        params: keyword parameters of the distribution's factory (``LENGTH_DISTRIBUTIONS[name]``).
    Raises:
        InvalidConfigError: unknown spec (the message lists the choices) or bad parameters.
    """
    if spec.startswith("fixed:"):
        parts = spec.split(":")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts[1:]):
            raise InvalidConfigError(
                f"bad fixed workload {spec!r}: expected fixed:<prompt_len>:<output_len>, e.g. fixed:512:64"
            )
        factory, args = FixedLengths, (int(parts[1]), int(parts[2]))
    elif spec in LENGTH_DISTRIBUTIONS:
        factory, args = LENGTH_DISTRIBUTIONS[spec], ()
    elif spec.endswith(".jsonl") or os.path.isfile(spec):
        factory, args = TraceLengths, (spec,)
    else:
        raise InvalidConfigError(f"unknown workload {spec!r}; choose {_SPEC_CHOICES}")
    try:
        return factory(*args, **params)
    except TypeError as exc:  # unexpected or missing keyword
        raise InvalidConfigError(f"bad parameters for workload {spec!r}: {exc}") from None


# ---- arrivals ------------------------------------------------------------------------------
ARRIVAL_PROCESSES = ("poisson", "gamma", "fixed")


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value) or value <= 0:
        raise InvalidConfigError(f"{name} must be a finite number > 0, got {value!r}")


def arrival_times(process: str, rate: float, n: int, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """``n`` increasing arrival times (s); the first arrives one inter-arrival gap after 0.

    Args:
        process: ``"poisson"`` (exponential gaps, mean 1/rate), ``"gamma"`` (shape 1/cv², scale
            cv²/rate, as DistServe's simulator; cv is the gaps' coefficient of variation) or
            ``"fixed"`` (gaps of exactly 1/rate). ``cv`` only affects ``"gamma"``.
        rate: mean arrivals per second.
        n: number of arrivals.
        rng: random stream. Gaps are drawn at unit rate and divided by ``rate``, so one seed gives
            the same arrival pattern, time-scaled, at every rate.
    Returns:
        float64 array [n].
    Raises:
        InvalidConfigError: unknown process, rate or cv not finite and > 0, n < 1.
    """
    if process not in ARRIVAL_PROCESSES:
        raise InvalidConfigError(f"unknown arrival process {process!r}; choose from {', '.join(ARRIVAL_PROCESSES)}")
    _check_positive("rate", rate)
    _check_positive("cv", cv)
    _check_int("n (number of arrivals)", n, 1)
    if process == "poisson":
        gaps = rng.standard_exponential(n)
    elif process == "gamma":
        shape = 1.0 / cv**2
        gaps = rng.standard_gamma(shape, n) / shape  # mean 1, CV cv
    else:
        gaps = np.ones(n)
    return np.cumsum(gaps / rate)


# ---- requests ------------------------------------------------------------------------------
def _check_slo_mix(slo_mix: Mapping[str, float]) -> tuple[list[str], np.ndarray]:
    names = list(slo_mix)
    weights = np.array([slo_mix[k] for k in names], dtype=np.float64)
    if not names or not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
        raise InvalidConfigError(
            f"slo_mix must map SLO class names to weights >= 0 with a positive sum, got {dict(slo_mix)!r}"
        )
    return names, weights / weights.sum()


def _fit_context(prompt_lens: np.ndarray, output_lens: np.ndarray, max_total_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut prompt first, then output, so prompt + output <= max_total_len and each stays >= 1."""
    prompt_lens = np.minimum(prompt_lens, np.maximum(1, max_total_len - output_lens))
    output_lens = np.minimum(output_lens, max_total_len - prompt_lens)
    return prompt_lens, output_lens


def generate_requests(
    lengths: LengthDistribution | str,
    rate: float,
    num_requests: int,
    *,
    arrival: str = "poisson",
    cv: float = 1.0,
    seed: int = 0,
    max_total_len: int | None = None,
    slo_mix: Mapping[str, float] | None = None,
) -> list[Request]:
    """A seeded synthetic workload, ``req_id`` 0..num_requests-1 in arrival order.

    Args:
        lengths: a distribution, or a spec for ``get_length_distribution``.
        rate, arrival, cv: the arrival process (see ``arrival_times``).
        num_requests: how many requests (>= 1).
        seed: lengths, arrivals and SLO classes use independent streams of this seed, so changing
            the rate or the arrival process leaves the lengths alone.
        max_total_len: the model's context: prompt + output is cut to fit it (prompt first).
        slo_mix: SLO class name -> weight (normalised); each request draws its class.
    """
    dist = get_length_distribution(lengths) if isinstance(lengths, str) else lengths
    if max_total_len is not None:
        _check_int("max_total_len", max_total_len, 2, "(one prompt and one output token)")
    _check_int("num_requests", num_requests, 1)
    length_ss, arrival_ss, slo_ss = np.random.SeedSequence(seed).spawn(3)
    arrivals = arrival_times(arrival, rate, num_requests, np.random.default_rng(arrival_ss), cv=cv)  # [n]
    prompt_lens, output_lens = dist.sample(num_requests, np.random.default_rng(length_ss))  # [n], [n]
    if max_total_len is not None:
        prompt_lens, output_lens = _fit_context(prompt_lens, output_lens, int(max_total_len))
    classes: list[str | None] = [None] * num_requests
    if slo_mix is not None:
        names, probs = _check_slo_mix(slo_mix)
        picks = np.random.default_rng(slo_ss).choice(len(names), size=num_requests, p=probs)
        classes = [names[i] for i in picks]
    return [
        Request(i, float(arrivals[i]), int(prompt_lens[i]), int(output_lens[i]), classes[i]) for i in range(num_requests)
    ]


# ---- traces --------------------------------------------------------------------------------
def _length_field(record: Mapping[str, Any], key: str, where: str) -> int:
    if key not in record:
        raise InvalidConfigError(f"{where}: missing field {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise InvalidConfigError(f"{where}: {key} must be an integer, got {value!r}")
    if value < 1:
        raise InvalidConfigError(f"{where}: {key} must be >= 1, got {value!r}")
    return int(value)


def _parse_record(record: Any, where: str) -> tuple[float, int, int, str | None]:
    if not isinstance(record, dict):
        raise InvalidConfigError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "arrival_s" not in record:
        raise InvalidConfigError(f"{where}: missing field 'arrival_s'")
    arrival = record["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        raise InvalidConfigError(f"{where}: arrival_s must be a finite number >= 0, got {arrival!r}")
    slo_class = record.get("slo_class")
    if slo_class is not None and not isinstance(slo_class, str):
        raise InvalidConfigError(f"{where}: slo_class must be a string or null, got {slo_class!r}")
    return float(arrival), _length_field(record, "prompt_len", where), _length_field(record, "output_len", where), slo_class


def load_trace(path: str | os.PathLike[str]) -> list[Request]:
    """Requests from a JSONL trace, sorted by arrival (stable), ``req_id`` in that order.

    One object per line: ``{"arrival_s": float, "prompt_len": int, "output_len": int,
    "slo_class": str (optional)}``; other keys are ignored, blank lines skipped.

    Raises:
        InvalidConfigError: missing/unreadable file, empty trace, or a bad line (the message
            names the file and line).
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise InvalidConfigError(f"trace file {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfigError(f"cannot read trace file {path}: {exc}") from None
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidConfigError(f"{where}: malformed JSON ({exc.msg})") from None
        rows.append(_parse_record(record, where))
    if not rows:
        raise InvalidConfigError(f"trace file {path} has no requests")
    rows.sort(key=lambda row: row[0])
    return [Request(i, *row) for i, row in enumerate(rows)]


def write_trace(path: str | os.PathLike[str], requests: Sequence[Request]) -> None:
    """Write ``requests`` as a JSONL trace that ``load_trace`` reads back unchanged."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            record: dict[str, Any] = {"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len}
            if r.slo_class is not None:
                record["slo_class"] = r.slo_class
            f.write(json.dumps(record) + "\n")


def _mean_rate(arrivals: np.ndarray) -> float:
    """1 / mean inter-arrival gap (NaN for fewer than two distinct times)."""
    duration = float(arrivals[-1] - arrivals[0]) if len(arrivals) else 0.0
    return (len(arrivals) - 1) / duration if duration > 0 else math.nan


def rescale(requests: Sequence[Request], rate: float) -> list[Request]:
    """The same requests replayed at mean rate ``rate`` (1 / mean gap): gaps are scaled by one
    factor about the first arrival; order, lengths, ids and classes are kept."""
    _check_positive("rate", rate)
    arrivals = np.array([r.arrival_s for r in requests], dtype=np.float64)  # [n]
    if np.any(np.diff(arrivals) < 0):
        raise InvalidConfigError("rescale needs requests sorted by arrival_s")
    current = _mean_rate(arrivals)
    if math.isnan(current):
        raise InvalidConfigError("rescale needs at least two requests with different arrival times")
    start, factor = arrivals[0], current / rate
    return [replace(r, arrival_s=float(start + (r.arrival_s - start) * factor)) for r in requests]


def describe(requests: Sequence[Request]) -> dict[str, float]:
    """Summary statistics of a workload (for CLIs and docs).

    Returns:
        num, duration_s (first to last arrival), rate (1 / mean gap), interarrival_cv, and for
        prompt and output: ``*_mean``, ``*_p50``, ``*_p90``, ``*_max``.
    """
    if not requests:
        raise InvalidConfigError("describe needs at least one request")
    arrivals = np.sort(np.array([r.arrival_s for r in requests], dtype=np.float64))  # [n]
    gaps = np.diff(arrivals)
    out = {
        "num": float(len(requests)),
        "duration_s": float(arrivals[-1] - arrivals[0]),
        "rate": _mean_rate(arrivals),
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else math.nan,
    }
    for key in ("prompt", "output"):
        values = np.array([getattr(r, f"{key}_len") for r in requests], dtype=np.float64)
        p50, p90 = np.percentile(values, [50, 90])
        out |= {f"{key}_mean": float(values.mean()), f"{key}_p50": float(p50), f"{key}_p90": float(p90)}
        out[f"{key}_max"] = float(values.max())
    return out
