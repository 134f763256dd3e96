"""Simulator workloads: requests, length distributions by name, arrival processes and JSONL traces.

A workload is a list of ``Request``s (arrival time, prompt and output lengths, optional SLO class,
scheduling class — ``objective`` and task ``group``, as ``distserve.cluster.classes`` — and prompt
tokens). ``generate_requests`` draws one from a length distribution (``simulator.lengths``
holds the synthetic ones and the published statistics they imitate, ``simulator.distserve_lengths``
DistServe's datasets as its preparation builds them; ``get_length_distribution``
names them, and resamples a trace) and an arrival process; ``load_trace``/``write_trace`` read and
write JSONL traces; ``rescale`` and ``describe`` replay and summarise them. ``mixed_workload``
draws a mix of scheduling classes, each with its own lengths (``mix:latency=chatbot:0.3,throughput=summarization``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from distserve.cluster.admission import check_timeout
from distserve.cluster.classes import DEFAULT, DEFAULT_CLASS, RequestClass
from distserve.cluster.tenants import ANONYMOUS, DEFAULT_TIER
from distserve.config import PRIORITY_MAX, PRIORITY_MIN
from distserve.errors import DistServeError, InvalidConfigError
from simulator.distserve_lengths import DistServeShareGPTSample, LongBenchLengths, ShareGPTMultiTurn, humaneval_lengths
from simulator.lengths import FixedLengths, LengthDistribution, ResampledLengths, chatbot_lengths, check_int, code_lengths, summarization_lengths

__all__ = [
    "ARRIVAL_PROCESSES", "LENGTH_DISTRIBUTIONS", "MIX_PREFIX", "Request", "TraceLengths", "arrival_times", "check_positive", "describe",
    "generate_requests", "get_length_distribution", "load_trace", "mixed_workload", "parse_mix_spec", "rescale", "write_trace",
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
    objective: str = DEFAULT  # the scheduling class: default | latency | throughput
    group: str | None = None  # its task group, if any
    tenant: str = ANONYMOUS  # whose it is (``distserve.cluster.tenants``): fair queueing shares by tenant
    tier: str = DEFAULT_TIER  # interactive | default | batch
    priority: int = 0  # within its tenant, lower first (vLLM's convention)
    timeout_s: float | None = None  # longest wait in the admission queue before it is dropped

    def __post_init__(self) -> None:
        try:
            self.request_class
            check_priority(self.priority)
            check_timeout(self.timeout_s)
        except DistServeError as exc:
            raise InvalidConfigError(f"request {self.req_id}: {exc}", exc.param) from None
        if self.prompt_len < 1 or self.output_len < 1:
            raise InvalidConfigError(
                f"request {self.req_id}: prompt_len and output_len must be >= 1, got {self.prompt_len} and {self.output_len}"
            )
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise InvalidConfigError(
                f"request {self.req_id}: prompt_token_ids has {len(self.prompt_token_ids)} tokens, prompt_len is {self.prompt_len}"
            )

    @property
    def request_class(self) -> RequestClass:
        """What the runtime's admission, schedulers and routing see of its class and tenant."""
        if self.objective == DEFAULT and self.group is None and self.tenant == ANONYMOUS and self.tier == DEFAULT_TIER:
            return DEFAULT_CLASS
        return RequestClass(self.objective, self.group, self.tenant, self.tier)


def check_priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise DistServeError(f"priority must be a 64-bit signed integer, got {value!r:.80}", "priority")
    return value


# ---- length distributions by name ----------------------------------------------------------
class TraceLengths(ResampledLengths):
    """Resamples (prompt_len, output_len) pairs, with replacement, from a JSONL trace."""

    def __init__(self, path: str | os.PathLike[str]):
        requests = load_trace(path)
        self.path = os.fspath(path)
        prompt = np.array([r.prompt_len for r in requests], dtype=np.int64)  # [num_trace]
        output = np.array([r.output_len for r in requests], dtype=np.int64)  # [num_trace]
        super().__init__(prompt, output, f"trace:{os.path.basename(self.path)}",
                         f"(prompt_len, output_len) pairs resampled from {self.path} ({len(requests)} requests; prompt mean "
                         f"{prompt.mean():.1f}, output mean {output.mean():.1f})")


LENGTH_DISTRIBUTIONS: dict[str, Callable[..., LengthDistribution]] = {
    "chatbot": chatbot_lengths,
    "code": code_lengths,
    "summarization": summarization_lengths,
    # DistServe's datasets as its preparation script builds them (``simulator.distserve_lengths``)
    "sharegpt-multiturn": ShareGPTMultiTurn,
    "sharegpt-distserve": DistServeShareGPTSample,  # the requests of DistServe's real OPT-13B runs, resampled
    "humaneval": humaneval_lengths,
    "longbench": LongBenchLengths,
    "fixed": FixedLengths,  # FixedLengths(prompt_len, output_len), or the spec "fixed:<prompt>:<output>"
    "trace": TraceLengths,  # TraceLengths(path), or the spec "<path>.jsonl"
}
_SPEC_CHOICES = ("chatbot, code, summarization, fixed:<prompt>:<output>, sharegpt-multiturn, sharegpt-distserve, humaneval, longbench, "
                 "or a path to a .jsonl trace")


def get_length_distribution(spec: str, **params: Any) -> LengthDistribution:
    """The length distribution named by ``spec``.

    Args:
        spec: ``"chatbot" | "code" | "summarization" | "sharegpt-multiturn" | "sharegpt-distserve" | "humaneval" | "longbench" |
            "fixed:<prompt>:<output>"`` or the path of a
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


def check_positive(name: str, value: float) -> None:
    """``value`` is a finite number > 0, or ``InvalidConfigError`` naming ``name`` (also its ``param``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value) or value <= 0:
        raise InvalidConfigError(f"{name} must be a finite number > 0, got {value!r:.80}", name)


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
    check_positive("rate", rate)
    check_positive("cv", cv)
    check_int("n (number of arrivals)", n, 1)
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
        check_int("max_total_len", max_total_len, 2, "(one prompt and one output token)")
    check_int("num_requests", num_requests, 1)
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


# ---- a mix of scheduling classes -----------------------------------------------------------
MIX_PREFIX = "mix:"
_MIX_FORM = "mix:<objective>=<lengths>[:<fraction>],... e.g. mix:latency=chatbot:0.3,throughput=summarization"


def parse_mix_spec(spec: str) -> list[tuple[str, str, float]]:
    """(objective, length spec, fraction) of each class of ``mix:latency=chatbot:0.3,throughput=summarization``;
    classes without a fraction share what the others leave, equally."""
    if not spec.startswith(MIX_PREFIX):
        raise InvalidConfigError(f"bad mix workload {spec!r}: expected {_MIX_FORM}", "workload")
    parts: list[tuple[str, str, float | None]] = []
    for item in spec[len(MIX_PREFIX):].split(","):
        objective, sep, rest = item.partition("=")
        if not sep or not rest:
            raise InvalidConfigError(f"bad mix workload {spec!r}: {item!r} is not <objective>=<lengths>; expected {_MIX_FORM}", "workload")
        try:
            RequestClass(objective.strip())
        except DistServeError as exc:
            raise InvalidConfigError(f"bad mix workload {spec!r}: {exc}", "workload") from None
        lengths, fraction = rest, None
        head, colon, tail = rest.rpartition(":")
        if colon:
            try:
                value = float(tail)
                get_length_distribution(head)
                lengths, fraction = head, value
            except (ValueError, InvalidConfigError):
                pass
        if fraction is not None and not 0 < fraction <= 1:
            raise InvalidConfigError(f"bad mix workload {spec!r}: fraction of {objective} must be in (0, 1], got {fraction}", "workload")
        get_length_distribution(lengths)  # an unknown one is refused with the choices
        parts.append((objective.strip(), lengths, fraction))
    if len({o for o, _, _ in parts}) != len(parts):
        raise InvalidConfigError(f"bad mix workload {spec!r}: an objective is named twice", "workload")
    given = sum(f for _, _, f in parts if f is not None)
    num_free = sum(f is None for _, _, f in parts)
    if given > 1 + 1e-9 or (num_free == 0 and abs(given - 1) > 1e-6) or (num_free and given >= 1):
        raise InvalidConfigError(f"bad mix workload {spec!r}: the fractions must add up to 1", "workload")
    rest_each = (1 - given) / num_free if num_free else 0.0
    return [(o, lengths, f if f is not None else rest_each) for o, lengths, f in parts]


def mixed_workload(spec: str, rate: float, num_requests: int, *, arrival: str = "poisson", cv: float = 1.0, seed: int = 0,
                   max_total_len: int | None = None) -> list[Request]:
    """``num_requests`` requests at ``rate`` in all, of the classes of the ``mix:`` ``spec``: each
    class its fraction of the requests and of the rate, its own lengths; ``req_id`` 0.. in arrival order."""
    classes = parse_mix_spec(spec)
    check_int("num_requests", num_requests, len(classes), "(one per class)")
    merged: list[Request] = []
    for k, (objective, lengths, fraction) in enumerate(classes):
        n = max(1, round(num_requests * fraction))
        reqs = generate_requests(lengths, rate * fraction, n, arrival=arrival, cv=cv, seed=seed * 7919 + k, max_total_len=max_total_len)
        merged.extend(replace(r, objective=objective) for r in reqs)
    merged.sort(key=lambda r: (r.arrival_s, r.objective))
    return [replace(r, req_id=i) for i, r in enumerate(merged)]


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


_CLASS_FIELDS = (("objective", DEFAULT), ("group", None), ("tenant", ANONYMOUS), ("tier", DEFAULT_TIER), ("priority", 0))


def _parse_record(record: Any, where: str) -> dict[str, Any]:
    """A trace line's ``Request`` fields (all but ``req_id``); errors name the line and the field."""
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
    fields = {name: record.get(name, default) for name, default in _CLASS_FIELDS}
    try:
        RequestClass(fields["objective"], fields["group"], fields["tenant"], fields["tier"])
        check_priority(fields["priority"])
        timeout_s = check_timeout(record.get("timeout"))
    except DistServeError as exc:
        raise InvalidConfigError(f"{where}: {exc}", exc.param) from None
    return {"arrival_s": float(arrival), "prompt_len": _length_field(record, "prompt_len", where),
            "output_len": _length_field(record, "output_len", where), "slo_class": slo_class, "timeout_s": timeout_s, **fields}


def load_trace(path: str | os.PathLike[str]) -> list[Request]:
    """Requests from a JSONL trace, sorted by arrival (stable), ``req_id`` in that order.

    One object per line: ``{"arrival_s": float, "prompt_len": int, "output_len": int,
    "slo_class": str, "objective": "default" | "latency" | "throughput", "group": str, "tenant": str,
    "tier": "interactive" | "default" | "batch", "priority": int, "timeout": seconds}`` (all but the
    first three optional); other keys are ignored, blank lines skipped.

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
    rows.sort(key=lambda row: row["arrival_s"])
    return [Request(i, **row) for i, row in enumerate(rows)]


def write_trace(path: str | os.PathLike[str], requests: Sequence[Request]) -> None:
    """Write ``requests`` as a JSONL trace that ``load_trace`` reads back unchanged."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            record: dict[str, Any] = {"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len}
            if r.slo_class is not None:
                record["slo_class"] = r.slo_class
            for name, default in _CLASS_FIELDS:
                if getattr(r, name) != default:
                    record[name] = getattr(r, name)
            if r.timeout_s is not None:
                record["timeout"] = r.timeout_s
            f.write(json.dumps(record) + "\n")


def _mean_rate(arrivals: np.ndarray) -> float:
    """1 / mean inter-arrival gap (NaN for fewer than two distinct times)."""
    duration = float(arrivals[-1] - arrivals[0]) if len(arrivals) else 0.0
    return (len(arrivals) - 1) / duration if duration > 0 else math.nan


def rescale(requests: Sequence[Request], rate: float) -> list[Request]:
    """The same requests replayed at mean rate ``rate`` (1 / mean gap): gaps are scaled by one
    factor about the first arrival; order, lengths, ids and classes are kept."""
    check_positive("rate", rate)
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
