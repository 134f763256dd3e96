"""Latency objectives and how requests are scored against them: the one ``SLO`` type, the SLO set a
run is scored against (``SLOSpec``), and the per-request TTFT/TPOT/E2E, attainment and latency
summaries shared by the load generator, the simulator, the serving metrics and the experiments.

A request's latencies, from its timestamps (seconds on one clock):

* start: when the request was sent (the load generator: the moment the client sent it; the
  simulator and in-process replays: its arrival);
* TTFT = first token - start;
* TPOT = (last token - first token) / (output tokens - 1): the mean gap between output tokens.
  A one-token answer has no TPOT (``None``): it meets any TPOT SLO and is left out of TPOT
  percentiles;
* E2E = finish - start.

A request meets its SLO when it completed (no error, not cancelled, not still open), its TTFT <=
``ttft_s`` and its TPOT (if any) <= ``tpot_s``; anything else is a miss. Attainment is the fraction
of *all* requests that meet an SLO: ``ttft`` and ``tpot`` each alone, ``joint`` both (DistServe's
definition). ``SLOSpec.mode`` says which of them must reach the attainment target: ``joint``, or
``separate`` (TTFT and TPOT each). Latency percentiles are over completed requests.

A request's scheduling-class objective (``distserve.cluster.classes``) decides which targets it is
judged by, here and nowhere else (``slo_for_objective``): ``latency`` and ``default`` requests by
the SLO, ``throughput`` requests (steps of a larger job, which no one watches token by token) by
completion alone.

An infinite target is not checked (``SLO()`` checks nothing). This module is a leaf: numpy and
the class names only.

Latency targets on a command line (``parse_latency``) take a unit: ``200ms``, ``0.2s``, or a bare
number of seconds (``0.2``). A bare number above ``MAX_BARE_SECONDS`` is refused: vLLM's
``--goodput`` and AIConfigurator take milliseconds, so ``--ttft 200`` almost surely means 200 ms,
and silently reading it as 200 s would make every request meet the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from distserve.cluster.classes import THROUGHPUT
from distserve.errors import InvalidConfigError

ATTAINMENT_MODES = ("joint", "separate")
MAX_BARE_SECONDS = 60.0  # a bare latency above this is refused (likely milliseconds)
_LATENCY_UNITS = {"ms": 1e-3, "s": 1.0}  # longest suffix first when matching
LATENCIES = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds (``inf``: not checked) and the fraction of requests that must meet them."""

    ttft_s: float = math.inf
    tpot_s: float = math.inf
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise InvalidConfigError(f"ttft_s and tpot_s must be > 0 (inf: not checked), got {self.ttft_s} and {self.tpot_s}")
        if not 0 < self.attainment <= 1:
            raise InvalidConfigError(f"attainment must be in (0, 1], got {self.attainment}")

    def ttft_met(self, ttft_s: float | None) -> bool:
        """Whether a TTFT meets the target (``None``: no first token, a miss)."""
        return ttft_s is not None and ttft_s <= self.ttft_s

    def tpot_met(self, tpot_s: float | None) -> bool:
        """Whether a TPOT meets the target (``None``: fewer than two tokens, met)."""
        return tpot_s is None or tpot_s <= self.tpot_s


@dataclass(frozen=True)
class SLOSpec:
    """The SLO set a run is scored against: the default SLO (whose ``attainment`` is the run's
    target), optional per-class SLOs for requests that name a class, and the attainment mode."""

    default: SLO
    classes: Mapping[str, SLO] = field(default_factory=dict)
    mode: str = "joint"

    def __post_init__(self) -> None:
        if self.mode not in ATTAINMENT_MODES:
            raise InvalidConfigError(f"attainment mode must be one of {ATTAINMENT_MODES}, got {self.mode!r}")

    def for_class(self, name: str | None) -> SLO:
        if name is None:
            return self.default
        slo = self.classes.get(name)
        if slo is None:
            raise InvalidConfigError(f"request SLO class {name!r} is not defined; known classes: {sorted(self.classes)}")
        return slo


def parse_latency(text: str, flag: str, *, allow_inf: bool = False) -> float:
    """``"200ms"``, ``"0.2s"`` or ``"0.2"`` -> 0.2 (seconds, > 0); ``"inf"`` when ``allow_inf`` (not checked).

    Raises InvalidConfigError naming ``flag`` for anything else, including a bare number above
    ``MAX_BARE_SECONDS`` (with the hint that we take seconds where vLLM takes milliseconds).
    """
    raw = text.strip().lower()
    unit = next((u for u in sorted(_LATENCY_UNITS, key=len, reverse=True) if raw.endswith(u) and raw != "inf"), None)
    number = raw[: -len(unit)].strip() if unit else raw
    try:
        value = float(number) * (_LATENCY_UNITS[unit] if unit else 1.0)
    except ValueError:
        raise InvalidConfigError(f"{flag} {text!r}: expected a latency such as 200ms, 0.2s or 0.2 (seconds)", flag.lstrip("-").replace("-", "_")) from None
    if math.isinf(value) and allow_inf and value > 0:
        return value
    if not (value > 0 and math.isfinite(value)):
        what = "a finite latency > 0" + (", or inf (not checked)" if allow_inf else "")
        raise InvalidConfigError(f"{flag} {text!r}: must be {what}", flag.lstrip("-").replace("-", "_"))
    if unit is None and value > MAX_BARE_SECONDS:
        raise InvalidConfigError(
            f"{flag} {text!r}: a bare number is seconds here, and {value:g} s is longer than any latency SLO; "
            f"vLLM and AIConfigurator take milliseconds: write {number}ms (or {value / 1000:g}s), or {value:g}s if you mean it",
            flag.lstrip("-").replace("-", "_"))
    return value


def slo_for_objective(slo: SLO, objective: str) -> SLO:
    """The targets a request of scheduling-class ``objective`` is judged by under ``slo``: a
    throughput request's TTFT and TPOT are not checked (it must complete); the others', as ``slo``."""
    if objective == THROUGHPUT:
        return SLO(attainment=slo.attainment)
    return slo


def ttft(start_s: float | None, first_token_s: float | None) -> float | None:
    """Time to first token; None until both happened."""
    return None if start_s is None or first_token_s is None else first_token_s - start_s


def tpot(first_token_s: float | None, last_token_s: float | None, num_output_tokens: int) -> float | None:
    """Mean time per output token after the first; None for fewer than two tokens."""
    if first_token_s is None or last_token_s is None or num_output_tokens < 2:
        return None
    return (last_token_s - first_token_s) / (num_output_tokens - 1)


class TimedRequest:
    """Mixin for a request's record: its latencies and SLO checks, from the timestamps it keeps.

    The record provides (as fields or properties) ``start_s``, ``first_token_s``, ``last_token_s``,
    ``finish_s`` (None until they happen), ``num_output_tokens`` and ``completed``; ``slo_class``
    (the class of ``SLOSpec.classes`` it is scored under) defaults to None, ``objective`` to "default".
    """

    __slots__ = ()
    start_s: float | None
    first_token_s: float | None
    last_token_s: float | None
    finish_s: float | None
    num_output_tokens: int
    completed: bool
    slo_class: str | None = None
    objective: str = "default"  # the scheduling class's objective (``slo_for_objective``)

    @property
    def ttft_s(self) -> float | None:
        return ttft(self.start_s, self.first_token_s)

    @property
    def tpot_s(self) -> float | None:
        return tpot(self.first_token_s, self.last_token_s, self.num_output_tokens)

    @property
    def e2e_s(self) -> float | None:
        return None if self.start_s is None or self.finish_s is None else self.finish_s - self.start_s

    def meets_ttft(self, slo: SLO) -> bool:
        return self.completed and slo.ttft_met(self.ttft_s)

    def meets_tpot(self, slo: SLO) -> bool:
        return self.completed and slo.tpot_met(self.tpot_s)

    def meets(self, slo: SLO) -> bool:
        """Completed, and within both targets."""
        return self.meets_ttft(slo) and self.meets_tpot(slo)


def as_spec(slo: SLO | SLOSpec) -> SLOSpec:
    return slo if isinstance(slo, SLOSpec) else SLOSpec(slo)


def attainment(records: Sequence[TimedRequest], slo: SLO | SLOSpec) -> dict[str, float]:
    """Fractions of all ``records`` meeting the TTFT target, the TPOT target, and both (``joint``)."""
    if not records:
        raise InvalidConfigError("no requests to score")
    spec = as_spec(slo)
    ok_ttft = ok_tpot = ok_both = 0
    targets: dict[tuple[str | None, str], SLO] = {}  # by (class, objective): a planner scores every probe
    for r in records:
        target = targets.get((r.slo_class, r.objective))
        if target is None:
            target = targets[r.slo_class, r.objective] = slo_for_objective(spec.for_class(r.slo_class), r.objective)
        a, b = r.meets_ttft(target), r.meets_tpot(target)
        ok_ttft += a
        ok_tpot += b
        ok_both += a and b
    n = len(records)
    return {"ttft": ok_ttft / n, "tpot": ok_tpot / n, "joint": ok_both / n}


def meets(att: Mapping[str, float], slo: SLOSpec) -> bool:
    """Whether an ``attainment`` dict reaches the spec's target under its mode."""
    target = slo.default.attainment - 1e-12
    if slo.mode == "joint":
        return att["joint"] >= target
    return att["ttft"] >= target and att["tpot"] >= target


def max_misses(num_requests: int, target_attainment: float) -> int:
    """How many of ``num_requests`` may miss while attainment stays >= ``target_attainment``."""
    return num_requests - math.ceil(target_attainment * num_requests - 1e-9)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def latency_summary(
    records: Sequence[TimedRequest], *, with_mean: bool = True, empty: float | None = math.nan
) -> dict[str, float | None]:
    """``{ttft,tpot,e2e}_{mean,p50,p90,p99}_s`` over the completed ``records`` (``empty`` where
    there is no value: no completed request, or only one-token answers for TPOT)."""
    done = [r for r in records if r.completed]
    out: dict[str, float | None] = {}
    for name in LATENCIES:
        values = [v for r in done if (v := getattr(r, f"{name}_s")) is not None]
        if with_mean:
            out[f"{name}_mean_s"] = float(np.mean(values)) if values else empty
        for q in (50, 90, 99):
            p = percentile(values, q)
            out[f"{name}_p{q}_s"] = empty if p is None else p
    return out
