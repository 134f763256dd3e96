"""What the load generator sends: a seeded workload (Poisson or gamma arrivals, prompt lengths) and its prompts.

Prompts are random words from a small list of common English words (one token each in most BPE
vocabularies), different for every request so prefix caching cannot skip their prefill. To hit a
target length in the *server's* tokens, the words per token are calibrated against the server
first (``distserve.measure.stream_client.calibrate_tokens_per_word``); without calibration one word
is assumed to be one token. Lengths are therefore approximate (exact for one-token words, a few
tokens off otherwise); the count the server reports is kept in each result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Common English words; with a leading space each is a single token in GPT-2/LLaMA-style BPE vocabularies.
WORDS: tuple[str, ...] = tuple(
    """the of and to in is was for on are with as at be by this had not but from or have an they which one
    you were her all she there would their we him been has when who will more no if out so said what up its
    about into than them can only other new some could time these two may then do first any my now such like
    our over man me even most""".split()
)
INPUT_LEN_DISTS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class Workload:
    """What to send: ``num_requests`` arrivals at ``rate`` requests/s (``inf``: all at once).

    Gaps between arrivals are gamma distributed with shape ``burstiness`` and mean ``1 / rate``
    (vLLM's ``--burstiness``): 1 is a Poisson process, below 1 burstier, above 1 more regular,
    ``inf`` evenly spaced; the coefficient of variation of the gaps is ``1 / sqrt(burstiness)``.

    Input lengths (in the server's tokens) are ``input_len`` for ``"fixed"``, uniform in
    ``input_len * (1 ± input_len_spread)`` for ``"uniform"``, and lognormal with mean ``input_len``
    and sigma ``input_len_spread`` for ``"lognormal"``. Every request asks for ``output_len`` tokens.
    ``seed`` drives arrivals and lengths; ``prompt_seed`` (default: ``seed``) the prompt words, so a
    sweep can keep one arrival pattern across rates while giving each rate fresh prompts.
    ``requests`` replaces the sampled arrivals and lengths by given ones (``replay``).
    """

    num_requests: int
    rate: float
    input_len: int
    output_len: int
    input_len_dist: str = "fixed"
    input_len_spread: float = 0.5
    seed: int = 0
    prompt_seed: int | None = None
    ignore_eos: bool = False  # send "ignore_eos": true (extension)
    min_tokens: bool = False  # send "min_tokens": output_len (extension)
    temperature: float = 0.0
    burstiness: float = 1.0  # shape of the gamma inter-arrival times (1: Poisson)
    # Given requests instead of sampled ones, (arrival_s, input_len, output_len) each in arrival
    # order, e.g. a simulator workload replayed against a server (``replay``).
    requests: tuple[tuple[float, int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 (inf: all requests at once), got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0 (inf: evenly spaced arrivals), got {self.burstiness}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input_len and output_len must be >= 1, got {self.input_len} and {self.output_len}")
        if self.input_len_dist not in INPUT_LEN_DISTS:
            raise ValueError(f"input_len_dist must be one of {INPUT_LEN_DISTS}, got {self.input_len_dist!r}")
        if self.input_len_spread < 0:
            raise ValueError(f"input_len_spread must be >= 0, got {self.input_len_spread}")
        if self.requests is not None:
            if len(self.requests) != self.num_requests:
                raise ValueError(f"num_requests is {self.num_requests} but {len(self.requests)} requests are given")
            arrivals = [a for a, _, _ in self.requests]
            if arrivals[0] < 0 or arrivals != sorted(arrivals):
                raise ValueError("given requests must arrive at times >= 0, in order")
            if min(min(i, o) for _, i, o in self.requests) < 1:
                raise ValueError("given requests need input and output lengths >= 1")

    @classmethod
    def replay(cls, requests: list[tuple[float, int, int]], **kwargs: object) -> Workload:
        """A workload of given (arrival_s, input_len, output_len) requests; ``rate``, ``input_len``
        and ``output_len`` are set to describe them (mean rate, mean input, longest output)."""
        if not requests:
            raise ValueError("no requests to replay")
        span = requests[-1][0] - requests[0][0]
        rate = (len(requests) - 1) / span if span > 0 else math.inf
        return cls(len(requests), rate, max(1, round(sum(i for _, i, _ in requests) / len(requests))),
                   max(o for _, _, o in requests), requests=tuple(requests), **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RequestSpec:
    """One request of a built workload: when to send it and its prompt."""

    index: int
    arrival_s: float  # scheduled send time, from the start of the run
    input_len: int  # target, in the server's tokens
    prompt: str
    output_len: int  # max_tokens


def poisson_arrivals(num_requests: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Arrival times (s) of a Poisson process at ``rate``/s; the first request arrives at 0."""
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = rng.exponential(1.0 / rate, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def gamma_arrivals(num_requests: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival times (s) whose gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate
    (vLLM's ``--burstiness``; 1 is ``poisson_arrivals``, the same draws); the first request arrives at 0."""
    if burstiness == 1.0:
        return poisson_arrivals(num_requests, rate, rng)
    if math.isinf(rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        return [i / rate for i in range(num_requests)]
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def sample_input_lengths(workload: Workload, rng: np.random.Generator) -> list[int]:
    """The target prompt length of every request, in the server's tokens."""
    n, mean, spread = workload.num_requests, workload.input_len, workload.input_len_spread
    if workload.input_len_dist == "fixed":
        lengths = np.full(n, float(mean))
    elif workload.input_len_dist == "uniform":
        lengths = rng.uniform(mean * (1 - spread), mean * (1 + spread), size=n)
    else:  # lognormal with the requested mean: E[X] = exp(mu + sigma^2 / 2)
        lengths = rng.lognormal(math.log(mean) - spread**2 / 2, spread, size=n)
    return [max(1, int(round(x))) for x in lengths]


def random_words(num_words: int, rng: np.random.Generator) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=num_words))


def words_for(input_len: int, tokens_per_word: float, overhead_tokens: float) -> int:
    """How many words make a prompt of ``input_len`` tokens."""
    return max(1, int(round((input_len - overhead_tokens) / tokens_per_word)))


def build_requests(workload: Workload, tokens_per_word: float = 1.0, overhead_tokens: float = 0.0) -> list[RequestSpec]:
    """The seeded workload: arrivals, target lengths and prompts (independent RNG streams, so
    arrivals do not change when the length distribution or the prompt seed does)."""
    arrival_ss, length_ss, word_ss = np.random.SeedSequence(workload.seed).spawn(3)
    if workload.prompt_seed is not None:
        word_ss = np.random.SeedSequence(workload.prompt_seed).spawn(3)[2]
    arrival_rng, length_rng, word_rng = (np.random.default_rng(s) for s in (arrival_ss, length_ss, word_ss))
    if workload.requests is not None:
        arrivals, lengths, outputs = (list(column) for column in zip(*workload.requests))
    else:
        arrivals = gamma_arrivals(workload.num_requests, workload.rate, workload.burstiness, arrival_rng)
        lengths = sample_input_lengths(workload, length_rng)
        outputs = [workload.output_len] * workload.num_requests
    return [
        RequestSpec(i, arrivals[i], lengths[i], random_words(words_for(lengths[i], tokens_per_word, overhead_tokens), word_rng),
                    outputs[i])
        for i in range(workload.num_requests)
    ]
