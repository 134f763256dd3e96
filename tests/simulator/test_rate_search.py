"""The rate search as a state machine (``rate_search._Steps``): the same probes and results as the
plain loop it replaced, and a ``PartialSearch``'s ways enumerated as replaying that loop would."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from simulator.rate_search import PartialSearch, _paths, _Steps, search_rate


def loop_search(passes: Callable[[float], bool], start_rate: float, max_rate: float | None, rel_tol: float,
                max_probes: int, max_first: bool = False) -> tuple[float, float]:
    """The search as a plain loop (its implementation until session 30): the reference."""
    rate = start_rate if max_rate is None else min(start_rate, max_rate)
    lo, hi = 0.0, math.inf
    num_probes = 0
    if max_first and max_rate is not None and rate < max_rate <= 2.0 * rate:
        num_probes += 1
        if passes(max_rate):
            return max_rate, math.inf
        hi = max_rate
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


class _Unknown(Exception):
    pass


def replayed_paths(args: tuple, known: dict[float, bool]) -> list[tuple[float, dict[float, bool]]]:
    """Every way the loop can go given ``known``, found by replaying it (depth first, a failing outcome first)."""
    out, stack = [], [{}]
    while stack:
        assumed = stack.pop()
        asked: list[float] = []

        def oracle(rate: float) -> bool:
            outcomes = {**known, **assumed}
            if rate not in outcomes:
                asked.append(rate)
                raise _Unknown
            return outcomes[rate]

        try:
            out.append((loop_search(oracle, *args)[0], assumed))
        except _Unknown:
            stack += [{**assumed, asked[0]: True}, {**assumed, asked[0]: False}]
    return out


def settings(rng: random.Random) -> tuple:
    bound = rng.choice([None, rng.uniform(1.0, 50.0)])
    start = rng.uniform(0.1, 1.0) * (bound or 20.0)
    return start, bound, rng.choice([0.02, 0.05, 0.2]), rng.choice([3, 8, 40]), rng.random() < 0.5


def test_the_state_machine_asks_and_answers_as_the_loop() -> None:
    rng = random.Random(1)
    for trial in range(2000):
        args = settings(rng)
        knee = rng.uniform(0.0, 1.5) * (args[1] or 40.0)
        noise = rng.random() < 0.3
        table: dict[float, bool] = {}

        def passes(rate: float) -> bool:
            if rate not in table:
                table[rate] = rate <= knee or (noise and rng.random() < 0.3)
            return table[rate]

        asked_loop: list[float] = []
        asked_steps: list[float] = []
        expected = loop_search(lambda r: (asked_loop.append(r), passes(r))[1], *args)
        assert search_rate(lambda r: (asked_steps.append(r), passes(r))[1], *args) == expected
        assert asked_steps == asked_loop


def test_a_partial_search_weighs_the_ways_replaying_the_loop_finds() -> None:
    rng = random.Random(2)
    for trial in range(150):
        args = settings(rng)
        knee = rng.uniform(0.0, 1.5) * (args[1] or 40.0)
        partial = PartialSearch(*args)
        for _ in range(4):
            assert _paths(_Steps(*args), partial.known) == replayed_paths(args, partial.known)
            assert partial.paths() == replayed_paths(args, partial.known)  # (narrowed after the first)
            if partial.result is not None:
                break
            rate = partial.next_rate
            partial.learn(rate, rate <= knee)
