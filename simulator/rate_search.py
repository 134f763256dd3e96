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
    First a bracket: from ``start_rate`` (capped at ``max_rate``), double while the rate passes (at
    most to ``max_rate``), halve while it fails, until one rate passes and one fails; then bisect
    until (hi - lo) / hi <= ``rel_tol``; at most ``max_probes`` probes in all.
    ``max_first``: where the bracket's second probe would be ``max_rate`` (``start_rate`` passing),
    probe ``max_rate`` first: if it passes, the search ends there without ``start_rate``; if not,
    ``start_rate`` is next and the bracket (hence the search) is the one they give in the other
    order — the same (lo, hi) wherever passing ``max_rate`` implies passing ``start_rate``, with a
    probe fewer when the bound is reached (the planner's throughput-capped candidates).
    """
    steps = _Steps(start_rate, max_rate, rel_tol, max_probes, max_first)
    state = steps.first
    while not _ended(state):
        state = steps.advance(state, passes(steps.rate(state)))  # type: ignore[arg-type]
    return state  # type: ignore[return-value]


# The search as a state machine (``_Steps``): a state is (phase, rate, lo, hi, probes made) — phase
# 0: probing ``max_rate`` first, 1: the bracket at ``rate``, 2: bisecting (lo, hi) — or, once it has
# ended, its result (lo, hi). ``search_rate`` walks it; a ``PartialSearch`` walks every way at once.
_State = tuple[int, float, float, float, int]
_End = tuple[float, float]


class _Steps:
    def __init__(self, start_rate: float, max_rate: float | None, rel_tol: float, max_probes: int, max_first: bool) -> None:
        self.start_rate, self.max_rate, self.rel_tol, self.max_probes = start_rate, max_rate, rel_tol, max_probes
        rate = start_rate if max_rate is None else min(start_rate, max_rate)
        if max_first and max_rate is not None and rate < max_rate <= 2.0 * rate:
            self.first: _State | _End = (0, rate, 0.0, math.inf, 0)
        else:
            self.first = self._bracket(rate, 0.0, math.inf, 0)

    def rate(self, state: _State) -> float:
        """The rate a state probes."""
        phase, rate, lo, hi, _ = state
        if phase == 0:
            return self.max_rate  # type: ignore[return-value]
        return rate if phase == 1 else 0.5 * (lo + hi)

    def advance(self, state: _State, passed: bool) -> _State | _End:
        """The next state once the state's probe ``passed`` or not."""
        phase, rate, lo, hi, n = state
        n += 1
        if phase == 0:
            return (self.max_rate, math.inf) if passed else self._bracket(rate, lo, self.max_rate, n)  # type: ignore[return-value,arg-type]
        if phase == 2:
            mid = 0.5 * (lo + hi)
            return self._bisect(mid, hi, n) if passed else self._bisect(lo, mid, n)
        max_rate = self.max_rate
        if passed:
            lo = rate
            if hi < math.inf or (max_rate is not None and rate >= max_rate):
                return self._bisect(lo, hi, n)
            rate = rate * 2.0 if max_rate is None else min(rate * 2.0, max_rate)
        else:
            hi = rate
            if lo > 0:
                return self._bisect(lo, hi, n)
            rate /= 2.0
            if rate < 1e-4 * self.start_rate:
                return self._bisect(lo, hi, n)
        return self._bracket(rate, lo, hi, n)

    def _bracket(self, rate: float, lo: float, hi: float, n: int) -> _State | _End:
        return (1, rate, lo, hi, n) if n < self.max_probes else self._bisect(lo, hi, n)

    def _bisect(self, lo: float, hi: float, n: int) -> _State | _End:
        if lo > 0 and hi < math.inf and (hi - lo) / hi > self.rel_tol and n < self.max_probes:
            return (2, 0.0, lo, hi, n)
        return lo, hi


_MAX_PATHS = 4096  # beyond this many ways to go, a PartialSearch stops weighing them (it follows the search)
_Paths = list[tuple[float, dict[float, bool]]]  # each way the search can go: its result and the outcomes it assumes


def _ended(state: _State | _End) -> bool:
    return len(state) == 2


def _walk(steps: _Steps, state: _State | _End, known: dict[float, bool], assumed: dict[float, bool]) -> _State | _End:
    """From ``state``, following the outcomes ``known`` or ``assumed``: the search's end, or the first state they don't answer."""
    while not _ended(state):
        rate = steps.rate(state)  # type: ignore[arg-type]
        outcome = known.get(rate, assumed.get(rate))
        if outcome is None:
            return state
        state = steps.advance(state, outcome)  # type: ignore[arg-type]
    return state


def _paths(steps: _Steps, known: dict[float, bool]) -> _Paths | None:
    """Every way the search can still go given the ``known`` outcomes: (its result, the outcomes it assumes)."""
    out: _Paths = []
    stack: list[tuple[_State | _End, dict[float, bool]]] = [(steps.first, {})]
    while stack:
        state, assumed = stack.pop()
        state = _walk(steps, state, known, assumed)
        if _ended(state):
            out.append((state[0], assumed))
            continue
        rate = steps.rate(state)  # type: ignore[arg-type]
        stack += [(steps.advance(state, True), {**assumed, rate: True}),  # type: ignore[arg-type]
                  (steps.advance(state, False), {**assumed, rate: False})]  # type: ignore[arg-type]
        if len(stack) + len(out) > _MAX_PATHS:
            return None
    return out


def _narrowed(paths: _Paths, rate: float, outcome: bool) -> _Paths:
    """``_paths(steps, known)`` from the ``paths`` of ``known`` without ``rate``, now that ``rate``'s
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
        self._steps = _Steps(start_rate, max_rate, rel_tol, max_probes, max_first)
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
            state = _walk(self._steps, self._steps.first, self.known, {})
            self._step = state if _ended(state) else self._steps.rate(state)  # type: ignore[arg-type,assignment]
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
            self._paths, self._weighed = _paths(self._steps, self.known), True
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
