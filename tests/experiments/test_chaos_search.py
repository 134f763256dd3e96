"""``experiments/chaos_rows.search_goodput``: the chaos report's planned goodput is a rate whose repeat probe passed
too — near the knee one probe passes by luck, and such a rate counts as failed."""

from __future__ import annotations

import asyncio

import pytest
from experiment_modules import load_experiment

load_experiment("chaos_client")
rows = load_experiment("chaos_rows")


class Server:
    """A server whose probes at a rate pass or fail in a set order (``outcomes[rate]``, then ``rate <= knee``)."""

    def __init__(self, knee: float, outcomes: dict[float, list[bool]] | None = None) -> None:
        self.knee, self.outcomes, self.calls = knee, outcomes or {}, []

    async def probe(self, rate: float, repeat: bool) -> bool:
        self.calls.append((round(rate, 3), repeat))
        queue = self.outcomes.get(round(rate, 3))
        return queue.pop(0) if queue else rate <= self.knee


def _search(server: Server, probes: int = 5, confirmations: int = 2) -> tuple[float, bool, bool]:
    return asyncio.run(rows.search_goodput(server.probe, 10.0, probes, confirmations))


def test_each_passing_probe_is_repeated_while_repeats_last() -> None:
    server = Server(knee=14.0)
    # 10 ✓ ✓, 15 ✗, 12.5 ✓ ✓, 13.75 ✓ (repeats used up), 14.375 ✗
    assert server.calls == [] and _search(server) == (13.75, True, False)
    assert server.calls == [(10.0, False), (10.0, True), (15.0, False), (12.5, False), (12.5, True), (13.75, False), (14.375, False)]


def test_a_repeated_rate_is_confirmed() -> None:
    server = Server(knee=11.0)
    # 10 ✓ ✓, 15 ✗, 12.5 ✗, 11.25 ✗, 10.625 ✓ ✓
    assert _search(server, confirmations=3) == (10.625, True, True)
    assert server.calls[-2:] == [(10.625, False), (10.625, True)]


def test_a_lucky_pass_counts_as_failed() -> None:
    # 12.5 passes once by luck and fails its repeat: the search goes on below it.
    server = Server(knee=13.0, outcomes={12.5: [True, False]})
    goodput, bracketed, confirmed = _search(server, confirmations=4)
    assert server.calls[3:6] == [(12.5, False), (12.5, True), (11.25, False)]
    assert (goodput, bracketed, confirmed) == (11.875, True, True)


def test_a_first_rate_failing_its_repeat_searches_down() -> None:
    server = Server(knee=8.0, outcomes={10.0: [True, False]})
    goodput, bracketed, confirmed = _search(server, probes=4)
    assert [c[0] for c in server.calls] == [10.0, 10.0, 6.667, 6.667, 8.333, 7.5]
    assert (goodput, bracketed, confirmed) == (7.5, True, False)  # the repeats ran out before 7.5


def test_without_repeats_the_highest_rate_that_passed() -> None:
    server = Server(knee=13.0, outcomes={13.75: [True]})
    assert _search(server, confirmations=0) == (13.75, True, True)
    assert not any(repeat for _, repeat in server.calls)


@pytest.mark.parametrize("confirmations", [0, 2])
def test_no_rate_passing_is_not_bracketed(confirmations: int) -> None:
    server = Server(knee=1.0)
    goodput, bracketed, confirmed = _search(server, probes=3, confirmations=confirmations)
    assert [c[0] for c in server.calls] == [10.0, 6.667, 4.444]  # down by 1.5x while nothing passed
    assert goodput == pytest.approx(10.0 / 1.5 ** 3) and (bracketed, confirmed) == (False, False)
