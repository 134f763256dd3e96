"""find_goodput's ``min_rate`` (it stops a search that cannot reach a rate) and probes that end once
their verdict is certain change nothing else."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from distserve.placement import Placement
from distserve.slo import SLO, SLOSpec
from distserve.slo import attainment, meets
from simulator.goodput import _MissCounter, find_goodput, probe_at
from simulator.rate_search import PartialSearch, reaches, search_rate
from simulator.latency import FittedLatencyModel
from simulator.profiles import TpCoefficients
from simulator.simulation import Simulation, with_rate
from simulator.workload import generate_requests

OPT13B_A100 = TpCoefficients(
    (18.10254647486372, 0.1019122572698738, 7.122264314252114e-06),
    (19.934702624895458, 0.0006269356524350583, 0.03850697740828398),
    (7.1661889468253595, 0.0005798000403396046, 0.15831096191764046),
    95,
)


def test_min_rate_decides_exactly_what_the_full_search_would() -> None:
    """Over monotone and non-monotone pass/fail curves: same verdict, same result, fewer probes to say no."""
    rng = random.Random(0)
    bound = 10.0
    full_probes = early_probes = 0
    for trial in range(300):
        knee = rng.uniform(0.1, 1.3) * bound
        noise = {} if trial % 3 else {"p": 0.3}  # every third curve also passes at random above its knee
        table: dict[float, bool] = {}

        def passes(rate: float) -> bool:
            if rate not in table:
                table[rate] = rate <= knee or rng.random() < noise.get("p", 0.0)
            return table[rate]

        def search(oracle):  # the planner's call: start at half the bound, capped at it
            return search_rate(oracle, 0.5 * bound, bound, 0.05, 40)

        asked: list[float] = []
        full = search(lambda r: (asked.append(r), passes(r))[1])
        min_rate = rng.uniform(0.2, 0.99) * bound
        partial = PartialSearch(0.5 * bound, bound, 0.05, 40, max_first=False)
        reached = reaches(partial, passes, min_rate)
        assert reached == (full[0] >= min_rate)
        lo, hi = partial.extent()
        assert lo <= full[0] <= hi and (lo >= min_rate if reached else hi < min_rate)
        if reached:
            assert search(lambda r: partial.known[r] if r in partial.known else passes(r)) == full
        else:
            full_probes += len(asked)
            early_probes += len(partial.known)
    assert early_probes < 0.5 * full_probes


def test_find_goodput_with_min_rate_stops_below_and_matches_above() -> None:
    latency = FittedLatencyModel("facebook/opt-13b", {1: OPT13B_A100}, hardware="a100-80g")
    unit = generate_requests("chatbot", 1.0, 100, seed=3, max_total_len=2048)
    slo = SLOSpec(SLO(0.25, 0.1, 0.9))
    placement = Placement.disaggregated(1, 1)
    full = find_goodput(placement, latency, unit, slo, rel_tol=0.05)
    assert full.rate > 0 and full.below is None

    stopped = find_goodput(placement, latency, unit, slo, rel_tol=0.05, min_rate=1.2 * full.rate)
    assert stopped.rate == 0 and stopped.below == pytest.approx(1.2 * full.rate)
    assert len(stopped.probes) < len(full.probes) and not all(p.meets for p in stopped.probes)
    assert stopped.binding in ("ttft", "tpot", "both")

    reached = find_goodput(placement, latency, unit, slo, rel_tol=0.05, min_rate=0.8 * full.rate)
    assert reached.rate == full.rate and reached.below is None and reached.binding == full.binding
    assert {p.rate for p in full.probes} <= {p.rate for p in reached.probes}


def test_a_memo_of_another_searchs_simulations_changes_nothing_and_is_reused() -> None:
    """``memo``: a search with another ``min_rate`` (the planner's speculation) hands its simulations on."""
    latency = FittedLatencyModel("facebook/opt-13b", {1: OPT13B_A100}, hardware="a100-80g")
    unit = generate_requests("chatbot", 1.0, 100, seed=3, max_total_len=2048)
    slo = SLOSpec(SLO(0.25, 0.1, 0.9))
    placement = Placement.disaggregated(1, 1)
    kwargs = {"rel_tol": 0.05, "max_rate": 20.0, "early_pass": True}
    full = find_goodput(placement, latency, unit, slo, **kwargs)
    for min_rate in (0.8 * full.rate, 1.2 * full.rate):
        alone = find_goodput(placement, latency, unit, slo, min_rate=min_rate, **kwargs)
        memo: dict = {}
        guessed = find_goodput(placement, latency, unit, slo, min_rate=None, memo=memo, **kwargs)
        simulated = len(memo)
        reused = find_goodput(placement, latency, unit, slo, min_rate=min_rate, memo=memo, **kwargs)
        assert (guessed.rate, guessed.binding, guessed.probes) == (full.rate, full.binding, full.probes)
        assert (reused.rate, reused.binding, reused.probes, reused.below) == (alone.rate, alone.binding, alone.probes, alone.below)
        # Only the probes the first search did not make were simulated again.
        assert len(memo) - simulated == len({p.rate for p in alone.probes} - {p.rate for p in full.probes})


@pytest.mark.parametrize("reach", [0.5, 1.0, 100.0])
def test_known_probes_made_elsewhere_give_the_full_searchs_record_without_simulating(reach: float) -> None:
    """``known``: the probes of a search made elsewhere (a planner worker's ``probe_at``, by rate) give the
    search's own record — rate, binding SLO, every probe — and nothing is simulated for them; where
    they are its only probes, ``result`` is None (a probe that stopped early at the lowest rate of a
    search finding nothing is simulated whole here, as the search itself does). ``reach`` scales the
    SLOs: a goodput found, and none (every probe fails)."""
    latency = FittedLatencyModel("facebook/opt-13b", {1: OPT13B_A100}, hardware="a100-80g")
    unit = generate_requests("chatbot", 1.0, 100, seed=3, max_total_len=2048)
    slo = SLOSpec(SLO(0.25 / reach, 0.1 / reach, 0.9))
    placement = Placement.disaggregated(1, 1)
    kwargs = {"rel_tol": 0.05, "max_rate": 20.0, "early_pass": True}
    full = find_goodput(placement, latency, unit, slo, **kwargs)
    known = {}
    for p in full.probes:
        made, binding, _ = probe_at(placement, latency, unit, slo, None, p.rate, True, True, {})
        known[p.rate] = (made, binding)
    memo: dict = {}
    again = find_goodput(placement, latency, unit, slo, memo=memo, known=known, **kwargs)
    assert (again.rate, again.binding, again.probes) == (full.rate, full.binding, full.probes)
    if full.rate > 0:
        assert memo == {} and again.result is None
    else:
        assert all(not p.meets for p in full.probes) and again.result is not None and not again.result.stopped_early


@pytest.mark.parametrize("mode", ["joint", "separate"])
def test_probes_stop_once_they_cannot_pass_with_the_full_search_outcome(mode: str) -> None:
    """Early-stopped probes: every pass/fail verdict, the goodput and the returned simulation are
    those of complete probes; a stopped probe's attainment is a lower bound; it simulates less."""
    latency = FittedLatencyModel("facebook/opt-13b", {1: OPT13B_A100}, hardware="a100-80g")
    unit = generate_requests("chatbot", 1.0, 200, seed=5, max_total_len=2048)
    slo = SLOSpec(SLO(0.25, 0.1, 0.9), mode=mode)
    for placement in (Placement.disaggregated(1, 1), Placement.colocated_instances(1)):
        full = find_goodput(placement, latency, unit, slo, rel_tol=0.05, early_stop=False)
        fast = find_goodput(placement, latency, unit, slo, rel_tol=0.05)
        assert fast.rate == full.rate > 0
        assert [(p.rate, p.meets) for p in fast.probes] == [(p.rate, p.meets) for p in full.probes]
        stopped = [p for p in fast.probes if p.stopped_early]
        assert stopped and not any(p.meets for p in stopped)
        exact = {p.rate: p.attainment for p in full.probes}
        for p in fast.probes:
            for key in ("ttft", "tpot", "joint"):
                assert p.attainment[key] <= exact[p.rate][key] + 1e-12 if p.stopped_early else p.attainment == exact[p.rate]
        assert fast.result is not None and not fast.result.stopped_early
        assert [r.finish_s for r in fast.result.records] == [r.finish_s for r in full.result.records]
    # Nothing passes: the lowest probe's simulation is completed for the report.
    hopeless = SLOSpec(SLO(1e-4, 1e-4, 0.9), mode=mode)
    res = find_goodput(Placement.colocated_instances(1), latency, unit, hopeless, rel_tol=0.05, max_probes=3)
    ref = find_goodput(Placement.colocated_instances(1), latency, unit, hopeless, rel_tol=0.05, max_probes=3, early_stop=False)
    assert res.rate == 0 and res.result is not None and not res.result.stopped_early
    low = min(res.probes, key=lambda p: p.rate)
    assert not low.stopped_early and low.attainment == min(ref.probes, key=lambda p: p.rate).attainment


@pytest.mark.parametrize("mode", ["joint", "separate"])
def test_probes_also_stop_once_they_cannot_fail(mode: str) -> None:
    """``early_pass``: a probe also ends once enough requests met the SLO that no later one can make
    it fail; every verdict and the goodput are the complete probes', a passed probe's attainment is a
    lower bound that still meets the target. Requests of the throughput objective are judged as
    ``attainment`` judges them (no latency targets) in either direction."""
    latency = FittedLatencyModel("facebook/opt-13b", {1: OPT13B_A100}, hardware="a100-80g")
    unit = [replace(r, objective="throughput" if r.req_id % 5 == 0 else "default")
            for r in generate_requests("chatbot", 1.0, 200, seed=5, max_total_len=2048)]
    slo = SLOSpec(SLO(0.25, 0.1, 0.9), mode=mode)
    for placement in (Placement.disaggregated(1, 1), Placement.colocated_instances(1)):
        full = find_goodput(placement, latency, unit, slo, rel_tol=0.05, early_stop=False)
        fast = find_goodput(placement, latency, unit, slo, rel_tol=0.05, early_pass=True)
        assert fast.rate == full.rate > 0 and fast.binding == full.binding
        assert [(p.rate, p.meets) for p in fast.probes] == [(p.rate, p.meets) for p in full.probes]
        passed = [p for p in fast.probes if p.stopped_early and p.meets]
        assert passed and any(p.stopped_early and not p.meets for p in fast.probes)
        exact = {p.rate: p.attainment for p in full.probes}
        for p in passed:
            key = "joint" if mode == "joint" else "ttft"
            assert 0.9 - 1e-12 <= p.attainment[key] <= exact[p.rate][key] + 1e-12


def test_stop_when_ends_a_simulation_early() -> None:
    latency = FittedLatencyModel("facebook/opt-13b", {1: OPT13B_A100}, hardware="a100-80g")
    reqs = generate_requests("chatbot", 5.0, 100, seed=1, max_total_len=2048)
    from simulator.simulation import Simulation

    seen: list[int] = []
    res = Simulation(Placement.disaggregated(1, 1), latency).run(reqs, stop_when=lambda rec: seen.append(rec.req_id) or len(seen) == 10)
    assert res.stopped_early and len(seen) == 10
    assert 10 <= sum(r.finish_s is not None for r in res.records) < 100  # the last step ends whole
    whole = Simulation(Placement.disaggregated(1, 1), latency).run(reqs)
    assert not whole.stopped_early and all(r.finish_s is not None for r in whole.records)


def test_bound_first_gives_the_same_search_and_skips_the_start_when_the_bound_passes() -> None:
    """``max_first``: the bracket's probes at the start rate and at the bound in the other order — the
    same (lo, hi) for every monotone curve, one probe fewer where the bound passes."""
    bound = 10.0
    for knee in [0.01 * k * bound for k in range(1, 160)] + [0.5 * bound, bound]:
        runs = {}
        for first in (False, True):
            asked: list[float] = []
            result = search_rate(lambda r: (asked.append(r), r <= knee)[1], 0.5 * bound, bound, 0.02, 40, max_first=first)
            runs[first] = (result, asked)
        assert runs[True][0] == runs[False][0]
        assert sorted(runs[True][1]) == sorted(runs[False][1]) if 0.5 * bound <= knee < bound else True
        assert len(runs[True][1]) == len(runs[False][1]) - (knee >= bound) + (knee < 0.5 * bound)


def test_a_late_first_token_is_counted_as_a_miss_at_once() -> None:
    """A request whose first token comes after its TTFT target misses whatever follows: a probe counts
    it then (``stop_when.first_token``) and is decided before that many requests finish, with the
    verdict of the complete run; the records of the first tokens seen are the complete run's."""
    latency = FittedLatencyModel("facebook/opt-13b", {1: OPT13B_A100}, hardware="a100-80g")
    unit = generate_requests("chatbot", 1.0, 200, seed=5, max_total_len=2048)
    for mode in ("joint", "separate"):
        slo = SLOSpec(SLO(0.25, 0.1, 0.9), mode=mode)
        for placement, rate in ((Placement.disaggregated(1, 1), 40.0), (Placement.colocated_instances(1), 8.0)):
            reqs = with_rate(unit, rate)
            full = Simulation(placement, latency).run(reqs)
            assert not meets(attainment(full.records, slo), slo)
            counter = _MissCounter(len(reqs), slo)
            res = Simulation(placement, latency).run(reqs, counter)
            assert res.stopped_early and not counter.passed
            finished = [r for r in res.records if r.finish_s is not None]
            assert sum(not r.meets(slo.default) for r in finished) <= counter.allowed  # the finishes alone had not decided it
            late = [r for r in res.records if r.finish_s is None and r.first_token_s is not None]
            assert late and any(r.first_token_s - r.arrival_s > 0.25 for r in late)
            exact = {r.req_id: r.first_token_s for r in full.records}
            assert all(r.first_token_s == exact[r.req_id] for r in res.records if r.first_token_s is not None)
