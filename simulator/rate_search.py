"""The search over arrival rates — bracket by doubling or halving, then bisect — and what can be known of
it part-way.

``search_rate`` runs the search over an oracle ``passes(rate)``: a simulation (``find_goodput``) or a
measurement of a real server (experiments/bench_serving.py). A ``PartialSearch`` is the same search
known in part — the outcomes of the rates probed so far — with every way it can still go: the lowest
and the highest rate it may still end at, whether it has ended, the rate it would probe next, and the
probe most likely to show that it does not end at some rates (``decisive``). A caller that only needs
to know whether a search reaches a rate (``find_goodput``'s ``min_rate``: ``reaches``), or which of
many searches ends highest (the planner's best-first chains), probes in that order instead of the
search's own. Every outcome it learns is one the search itself would get, so what it concludes is
exactly what the whole search would say.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

def search_rate(passes: Callable[[float], bool], start_rate: float, max_rate: float | None, rel_tol: float,
                max_probes: int, max_first: bool = False) -> tuple[float, float]:
    """The search over an oracle ``passes(rate)``: (lo, hi), the best passing rate and the failing one above it.

    ``lo`` is 0 if no rate passed, ``hi`` inf if none failed. The oracle may be a simulation or a
    measurement of a real server (experiments/bench_serving.py): the search is the same.
    ``max_first``: where the bracket's second probe would be ``max_rate`` (``start_rate`` passing),
    probe ``max_rate`` first: if it passes, the search ends there without ``start_rate``; if not,
    ``start_rate`` is next and the bracket (hence the search) is the one they give in the other
    order — the same (lo, hi) wherever passing ``max_rate`` implies passing ``start_rate``, with a
    probe fewer when the bound is reached (the planner's throughput-capped candidates).
    """
    rate = start_rate if max_rate is None else min(start_rate, max_rate)
    lo, hi = 0.0, math.inf
    num_probes = 0
    if max_first and max_rate is not None and rate < max_rate <= 2.0 * rate:
        num_probes += 1
        if passes(max_rate):
            return max_rate, math.inf
        hi = max_rate
    # Bracket: grow or shrink by 2x until one rate passes and one fails.
    while num_probes < max_probes:
        num_probes += 1
        if passes(rate):
            lo = rate
            if hi < math.inf or (max_rate is not None and rate >= max_rate):
                break
            rate = rate * 2.0 if max_rate is None else min(rate * 2.0, max_rate)
        else:
            hi = rate
            if lo > 0:
                break
            rate /= 2.0
            if rate < 1e-4 * start_rate:
                break
    while lo > 0 and hi < math.inf and (hi - lo) / hi > rel_tol and num_probes < max_probes:
        num_probes += 1
        mid = 0.5 * (lo + hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


_MAX_PATHS = 4096  # beyond this many ways to go, a PartialSearch stops weighing them (it follows the search)
_Search = Callable[[Callable[[float], bool]], tuple[float, float]]
_Paths = list[tuple[float, dict[float, bool]]]  # each way the search can go: its result and the outcomes it assumes


class _Unknown(Exception):
    def __init__(self, rate: float) -> None:
        self.rate = rate


def _run_until_unknown(search: _Search, outcomes: dict[float, bool]) -> tuple[float, float] | float:
    """The search's (lo, hi) if ``outcomes`` answer everything it asks, else the first rate they don't."""

    def oracle(rate: float) -> bool:
        if rate in outcomes:
            return outcomes[rate]
        raise _Unknown(rate)

    try:
        return search(oracle)
    except _Unknown as unknown:
        return unknown.rate


def _paths(search: _Search, known: dict[float, bool]) -> _Paths | None:
    """Every way the search can still go given the ``known`` outcomes: (its result, the outcomes it assumes)."""
    out: _Paths = []
    stack: list[dict[float, bool]] = [{}]
    while stack:
        assumed = stack.pop()
        step = _run_until_unknown(search, {**known, **assumed})
        if isinstance(step, tuple):
            out.append((step[0], assumed))
            continue
        stack += [{**assumed, step: True}, {**assumed, step: False}]
        if len(stack) + len(out) > _MAX_PATHS:
            return None
    return out


def _narrowed(paths: _Paths, rate: float, outcome: bool) -> _Paths:
    """``_paths(search, known)`` from the ``paths`` of ``known`` without ``rate``, now that ``rate``'s
    ``outcome`` is known: the ways that assumed the other outcome go, the rest lose the assumption.
    Exactly ``_paths``' answer, in its order (the search tree with ``rate``'s forks cut to one side,
    walked as before) — and never more than ``_MAX_PATHS`` of them, as those were not."""
    return [(lo, {r: ok for r, ok in assumed.items() if r != rate} if rate in assumed else assumed)
            for lo, assumed in paths if assumed.get(rate, outcome) == outcome]


class PartialSearch:
    """``search_rate(passes, start_rate, max_rate, rel_tol, max_probes, max_first)`` known in part:
    ``learn`` each probe's outcome, in any order; the ways it can still go follow."""

    def __init__(self, start_rate: float, max_rate: float | None, rel_tol: float, max_probes: int = 40,
                 max_first: bool = True) -> None:
        self.max_rate = max_rate
        self.known: dict[float, bool] = {}
        self._search: _Search = lambda passes: search_rate(passes, start_rate, max_rate, rel_tol, max_probes, max_first)
        self._paths: _Paths | None = None  # (computed when first asked for)
        self._weighed = False  # whether ``_paths`` is up to date (None then means: too many to weigh)
        self._step: tuple[float, float] | float | None = None

    def learn(self, rate: float, passed: bool) -> None:
        """``rate``'s outcome (a rate already known keeps its first)."""
        if rate in self.known:
            return
        self.known[rate] = passed
        self._step = None
        if self._weighed and self._paths is not None:
            self._paths = _narrowed(self._paths, rate, passed)
        else:
            self._weighed = False

    def assuming(self, rate: float, passed: bool) -> PartialSearch:
        """A copy that has also learned ``rate``'s outcome (this one is unchanged)."""
        self.paths()  # (weighed here once, narrowed in each copy)
        other = copy.copy(self)
        other.known = dict(self.known)
        other.learn(rate, passed)
        return other

    @property
    def _next(self) -> tuple[float, float] | float:
        if self._step is None:
            self._step = _run_until_unknown(self._search, self.known)
        return self._step

    @property
    def result(self) -> tuple[float, float] | None:
        """The search's (lo, hi) once the known outcomes answer every probe it makes, else None."""
        step = self._next
        return step if isinstance(step, tuple) else None

    @property
    def next_rate(self) -> float:
        """The rate the search probes next (it has not ended)."""
        step = self._next
        assert not isinstance(step, tuple), "the search has ended"
        return step

    def paths(self) -> _Paths | None:
        """Every way the search can still go (its ``lo``, the outcomes it assumes); None if too many to weigh."""
        if not self._weighed:
            self._paths, self._weighed = _paths(self._search, self.known), True
        return self._paths

    def extent(self) -> tuple[float, float]:
        """The lowest and the highest ``lo`` the search may still end with."""
        if (done := self.result) is not None:
            return done[0], done[0]
        top = math.inf if self.max_rate is None else self.max_rate
        if not self.known:
            return 0.0, top
        paths = self.paths()
        if paths is None:
            return 0.0, top
        los = [lo for lo, _ in paths]
        return min(los), max(los)

    def decisive(self, wins: Callable[[float], bool]) -> float:
        """The probe most likely to rule out the ways the search ends with a ``lo`` that ``wins``.

        With a ``max_rate``: under a prior where the goodput lies uniformly between the best known pass
        and the lowest known fail (or 1.5 x ``max_rate``: the search often passes there), the rate
        with the greatest chance of ruling out each way, weighed by that way's own chance. So a rate
        just below the winning ones that the search would have to pass is tried early, and rates it
        would surely pass are left for last. Without one, or with too many ways to weigh, or when
        every way or none wins: the search's own next probe.
        """
        paths = self.paths()
        if paths is None or self.max_rate is None or self.result is not None:
            return self.next_rate
        won = [assumed for lo, assumed in paths if wins(lo)]
        if not won or len(won) == len(paths):
            return self.next_rate
        prior = self._prior()
        p_pass = {r: prior(r) for r in {r for _, assumed in paths for r in assumed}}

        def weight(assumed: dict[float, bool]) -> float:
            return math.prod(p_pass[r] if ok else 1.0 - p_pass[r] for r, ok in assumed.items())

        score = dict.fromkeys(p_pass, 0.0)
        for assumed in won:
            w = weight(assumed)
            for r, ok in assumed.items():
                score[r] += w * (1.0 - p_pass[r] if ok else p_pass[r])  # the chance that r rules this way out
        return max(score, key=lambda r: (score[r], r))

    def _prior(self) -> Callable[[float], float]:
        """``decisive``'s prior chance that a rate passes: falling linearly from the best known pass to
        the lowest known fail (or 1.5 x ``max_rate``), kept within [0.02, 0.98]."""
        top = min((r for r, ok in self.known.items() if not ok), default=1.5 * (self.max_rate or math.inf))
        bottom = max((r for r, ok in self.known.items() if ok and r < top), default=0.0)
        if math.isinf(top):
            return lambda rate: 0.5
        return lambda rate: min(0.98, max(0.02, (top - rate) / (top - bottom)))

    def likely(self, rate: float) -> bool:
        """The likelier outcome of a probe at ``rate``, under ``decisive``'s prior."""
        return self._prior()(rate) >= 0.5


def reaches(search: PartialSearch, probe: Callable[[float], bool], min_rate: float) -> bool:
    """Whether ``search`` ends at or above ``min_rate``, probing (``probe`` then ``search.learn``) only
    what it takes to know, most decisive probe first. Exact: the outcomes that decide it are the
    search's own; only the order of the probes differs. With too many ways to weigh: True (let the
    search run)."""
    while True:
        paths = search.paths()
        if paths is None:
            return True
        won = sum(lo >= min_rate for lo, _ in paths)
        if won == 0:
            return False
        if won == len(paths):
            return True
        rate = search.decisive(lambda lo: lo >= min_rate)
        search.learn(rate, probe(rate))
