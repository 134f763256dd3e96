"""Evaluating the planner's candidates: each search's candidates as a *chain*, searched best first.

A chain is one search's candidates (colocated configs, prefill configs, decode configs, low-affinity
units). Its answer is the candidate with the best goodput per GPU and, of equals, the first in
``chain_order`` (best throughput bound per GPU first). A candidate's goodput is where its own rate
search ends (``rate_search.search_rate`` over simulated probes); the chain weighs all of these
searches at once, each known in part (a ``PartialSearch``), and probes only what it takes to know
the winner — branch and bound over the candidates (``BestFirst``):

* each candidate's goodput per GPU lies between the lowest and the highest end its search may still
  reach (before its first probe: 0 and its throughput bound);
* the *top* — the candidate with the highest such upper end (of equals, the first in chain order) —
  is probed next. While another candidate is known to reach more than the top's lower end (the
  *incumbent*), the probe is the one most likely to show the top cannot reach a goodput part way
  from the incumbent's lower end to its own upper end (``AIM``; ``PartialSearch.decisive``):
  usually a probe that fails early and cheaply and brings the top's upper end down; one that passes
  lifts the top's lower end, and the incumbent with it. Otherwise it is the next probe of the top's
  own search;
* once the top's search has ended, no other candidate can beat it: the chain is decided.

So the candidate most likely to win is searched first, and each loser only until it certainly
loses. Every outcome is one its search would get itself, so the winner and its goodput are exactly
the full search's (``stop_losers=False``: every candidate searched to its end). What each candidate
records:

* one whose search ended (the winner, and others that got that far): its search's record — probes,
  goodput, binding SLO — exactly as a full search gives it (``find_goodput`` reading its probes);
* one probed, but not to the end: goodput 0, and ``goodput_below``: the most its search may still
  find, at most the winner's goodput per GPU on as many GPUs;
* one never probed: skipped (its throughput bound per GPU is at most the winner's goodput per GPU).

``run_chains`` with workers: the chains' probes are independent, so each chain's next probe is
simulated at once; a worker left free probes *ahead*, what a chain would probe next if the probes in
flight got their likelier outcomes (``PartialSearch.likely``). A chain makes its decisions in the
same order on the same outcomes however its probes were simulated: the same probes, records and
plan as one process. A ``FollowUp`` is work that waits for some chains (the planner's verification
of the option they make): once they are decided its simulations run on the same pool, while the
other chains are still searched (in one process: after every chain). ``run_all`` runs other
independent simulations on a pool.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.pool
import queue
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from distserve.placement import Placement
from distserve.planner.plan import Candidate
from distserve.slo import SLOSpec
from simulator.goodput import GoodputResult, Known, Probe, find_goodput, probe_at
from simulator.latency import LatencyModel
from simulator.rate_search import PartialSearch
from simulator.simulation import SimConfig, gc_paused
from simulator.workload import Request

T = TypeVar("T")
# How far from the incumbent's lower end towards its own upper end the top is tested (``BestFirst``).
# 0 would test whether it beats the incumbent at all: a candidate above it passes, expensively, and
# passes again as the incumbent rises; near 1 its upper end comes down a bisection step at a time.
# 0.6-0.7 made the fewest probes weighed by their cost (a passing one simulates ~2.5x a failing one)
# over planner_order.py's six settings (session 30).
AIM = 0.65
Evaluation = tuple[float, str | None, list[tuple[float, dict[str, float], bool]], float | None, int]
Progress = Callable[[str, int, int], None]


def rounded(rate: float) -> float:
    """``rate`` to 9 significant digits: equal bounds computed along different paths compare equal."""
    return float(f"{rate:.9g}")


@dataclass(frozen=True)
class Job:
    """One candidate's goodput search: what a worker process needs to simulate its probes."""

    kind: str
    placement: Placement
    latency: LatencyModel
    unit_requests: tuple[Request, ...]
    slo: SLOSpec
    config: SimConfig
    rel_tol: float
    start_rate: float
    max_rate: float | None
    early_stop: bool = True  # probes end once their verdict is certain

    def search(self) -> PartialSearch:
        """The search ``find_goodput`` makes for this job, before any probe."""
        return PartialSearch(self.start_rate, self.max_rate, self.rel_tol)


def evaluate(job: Job, known: Known | None = None, min_rate: float | None = None) -> Evaluation:
    """The job's whole search (its probes taken from ``known``, ``probe``'s outcomes, where there): the
    candidate's record. ``min_rate``: ``find_goodput``'s (a search in turn that needs the goodput only
    if it reaches it)."""
    g: GoodputResult = find_goodput(job.placement, job.latency, job.unit_requests, job.slo, job.config,
                                    rel_tol=job.rel_tol, start_rate=job.start_rate, max_rate=job.max_rate,
                                    min_rate=min_rate, early_stop=job.early_stop, early_pass=job.early_stop, known=known)
    return (g.rate, g.binding, [(p.rate, p.attainment, p.meets) for p in g.probes], g.below,
            sum(p.stopped_early for p in g.probes))


def probe(job: Job, rate: float) -> tuple[Probe, str]:
    """One probe of the job's search, as ``find_goodput`` makes it: its verdict and the binding SLO
    (what ``evaluate`` reads later: not the simulation, which a worker would have to ship back)."""
    with gc_paused():
        outcome, binding, _ = probe_at(job.placement, job.latency, job.unit_requests, job.slo, job.config, rate,
                                       job.early_stop, job.early_stop, {})
    return outcome, binding


_worker_jobs: list[list[Job]] = []  # in a pool's worker: every chain's jobs, sent once (``_pool``)


def _probe_in_worker(c: int, i: int, rate: float) -> tuple[Probe, str]:
    """``probe`` of chain ``c``'s job ``i``, in a worker that holds the jobs."""
    return probe(_worker_jobs[c][i], rate)


def _hold_jobs(jobs: list[list[Job]]) -> None:
    """A pool worker's start: SIGTERM's default action (``_pool``), and the jobs it will probe."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_jobs[:] = jobs


def chain_order(cand: Candidate) -> tuple[float, int]:
    """A chain's order: best bound per GPU first; bounds per GPU that differ by rounding only (pp
    scales them linearly) tie, fewer GPUs first (then as listed: the sort is stable)."""
    return -rounded(cand.bound_rate / cand.num_gpus), cand.num_gpus


def best_of(candidates: list[Candidate]) -> Candidate | None:
    """The winner among a chain's evaluated ``candidates`` (as listed): the best goodput per GPU,
    and of equals the first in chain order — the one the best-first search decides for, as a full
    search of every candidate does."""
    return min((c for c in candidates if c.goodput > 0), key=lambda c: (-c.per_gpu, chain_order(c)), default=None)


@dataclass
class Chain:
    """One search's candidates and their jobs, sorted in ``chain_order``."""

    label: str
    jobs: list[tuple[Candidate, Job]]
    stop_losers: bool = True  # best first (else every candidate searched to its end)

    def __post_init__(self) -> None:
        self.jobs.sort(key=lambda cj: chain_order(cj[0]))

    def record(self, i: int, result: Evaluation) -> None:
        cand = self.jobs[i][0]
        cand.goodput, cand.binding, cand.probes, cand.goodput_below, cand.num_probes_stopped = result
        # A finite workload lets an overloaded deployment meet its SLO for a while (the TPOT of long
        # outputs absorbs seconds of queueing), so a simulated goodput can exceed what the deployment
        # sustains: it is capped at the candidate's steady-state throughput bound.
        if cand.goodput >= cand.bound_rate:
            cand.goodput = cand.bound_rate
            cand.binding = "throughput"


class _Searched:
    """One candidate's search as its chain weighs it: the probes made, the goodput per GPU it may end with."""

    def __init__(self, index: int, cand: Candidate, job: Job, search: PartialSearch | None = None) -> None:
        self.index, self.cand, self.job = index, cand, job
        self.search = search or job.search()
        lo, hi = self.search.extent()
        # (``record`` caps a goodput at the bound)
        self.low = min(lo, cand.bound_rate) / cand.num_gpus
        self.high = min(hi, cand.bound_rate) / cand.num_gpus

    def assuming(self, rate: float, passed: bool) -> _Searched:
        """This candidate as it would be had a probe at ``rate`` got ``passed`` (a copy)."""
        return _Searched(self.index, self.cand, self.job, self.search.assuming(rate, passed))

    def per_gpu(self, rate: float) -> float:
        return min(rate, self.cand.bound_rate) / self.cand.num_gpus


class BestFirst:
    """One chain searched best first (the module docstring): ``next_probe``, then ``learn`` its outcome,
    until it returns None; then ``finish`` records every candidate."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.cands = [_Searched(i, c, j) for i, (c, j) in enumerate(chain.jobs)]
        self.probes: list[list[tuple[Probe, str]]] = [[] for _ in self.cands]
        self._next: tuple[int, float] | None | bool = False  # (False: not weighed since the last outcome)

    def next_probe(self, assumed: dict[int, _Searched] | None = None) -> tuple[int, float] | None:
        """The next probe (candidate, rate); None once the chain is decided. ``assumed``: candidates
        replaced by what-ifs (``_Searched.assuming``), to look ahead."""
        if assumed is None and self._next is not False:
            return self._next  # type: ignore[return-value]
        cands = [assumed.get(c.index, c) for c in self.cands] if assumed else self.cands
        top = max(cands, key=lambda c: (c.high, -c.index), default=None)
        if top is None or top.search.result is not None:
            out = None
        else:
            incumbent = max(cands, key=lambda c: (c.low, -c.index))
            if incumbent is top or incumbent.low == 0:
                out = top.index, top.search.next_rate
            else:
                # (of equals the first in chain order wins: the top reaches the aim or beats it)
                aim = incumbent.low + AIM * (top.high - incumbent.low)
                if top.index < incumbent.index:
                    out = top.index, top.search.decisive(lambda lo: top.per_gpu(lo) >= aim)
                else:
                    out = top.index, top.search.decisive(lambda lo: top.per_gpu(lo) > aim)
        if assumed is None:
            self._next = out
        return out

    def learn(self, i: int, outcome: Probe, binding: str) -> None:
        """A probe's outcome (``probe``'s answer) for candidate ``i``."""
        self.probes[i].append((outcome, binding))
        c = self.cands[i]
        c.search.learn(outcome.rate, outcome.meets)
        self.cands[i] = _Searched(i, c.cand, c.job, c.search)
        self._next = False

    def ahead(self, i: int, rate: float, known: Callable[[int, float], bool | None]) -> Iterator[tuple[int, float]]:
        """The probes after (``i``, ``rate``), each assuming the ones before it got their ``known``
        outcome (None: not known yet) or else their likelier one."""
        assumed: dict[int, _Searched] = {}
        while True:
            c = assumed.get(i, self.cands[i])
            outcome = known(i, rate)
            assumed[i] = c.assuming(rate, c.search.likely(rate) if outcome is None else outcome)
            step = self.next_probe(assumed)
            if step is None:
                return
            yield step
            i, rate = step

    def settled(self) -> int:
        """Candidates that certainly lose, or whose search has ended (for progress)."""
        floor = max((c.low for c in self.cands), default=0.0)
        return sum(c.high < floor or c.search.result is not None for c in self.cands)

    def run(self, progress: Progress) -> None:
        """In this process."""
        while (step := self.next_probe()) is not None:
            i, rate = step
            self.learn(i, *probe(self.chain.jobs[i][1], rate))
            progress(self.chain.label, self.settled(), len(self.cands))

    def finish(self, progress: Progress) -> int:
        """Record every candidate (the module docstring); returns how many were simulated."""
        winner = max(self.cands, key=lambda c: (c.high, -c.index), default=None)
        for c, probes in zip(self.cands, self.probes):
            cand = c.cand
            if c.search.result is not None:
                self.chain.record(c.index, evaluate(c.job, {p.rate: (p, binding) for p, binding in probes}))
            elif probes:
                failed = min((p for p in probes if not p[0].meets), key=lambda p: p[0].rate, default=None)
                cand.goodput, cand.goodput_below = 0.0, c.high * cand.num_gpus
                cand.binding = failed[1] if failed is not None else None
                cand.probes = [(p.rate, p.attainment, p.meets) for p, _ in probes]
                cand.num_probes_stopped = sum(p.stopped_early for p, _ in probes)
            else:
                assert winner is not None
                cand.skipped = f"bound {c.high:.3g} req/s/GPU <= best {winner.high:.3g}"
        progress(self.chain.label, len(self.cands), len(self.cands))
        return sum(bool(p) for p in self.probes)


def run_all(fn: Callable[..., T], args: list[tuple[Any, ...]], workers: int) -> list[T]:
    """``[fn(*a) for a in args]``, on a pool of up to ``workers`` processes if there are two or more."""
    if workers <= 1 or len(args) <= 1:
        return [fn(*a) for a in args]
    with _pool(min(workers, len(args))) as pool:
        return pool.starmap(fn, args)


WORKER_CHECK_S = 1.0  # how often a wait for an outcome checks that the pool's workers are alive


class WorkerDiedError(RuntimeError):
    """A planner worker process died (killed, out of memory, a crash): its probe is lost."""


def _next_outcome(finished: queue.SimpleQueue[tuple[Any, Any]], pool: multiprocessing.pool.Pool) -> tuple[Any, Any]:
    """The next probe's or task's outcome. ``multiprocessing.Pool`` replaces a worker that dies but never
    reports the task it was running, so waiting for that task would never end: a worker gone (its process
    no longer among the pool's: they end only with the pool) is a ``WorkerDiedError`` instead."""
    workers = list(pool._pool)  # type: ignore[attr-defined]  # (Pool keeps no public list of its processes)
    while True:
        try:
            return finished.get(timeout=WORKER_CHECK_S)
        except queue.Empty:
            dead = [w for w in workers if w.exitcode is not None]
            if dead:
                raise WorkerDiedError(
                    f"a planner worker process died (pid {dead[0].pid}, exit code {dead[0].exitcode}); "
                    "its probe is lost: run again, or with --workers 1") from None


@contextlib.contextmanager
def _pool(workers: int, jobs: list[list[Job]] | None = None) -> Iterator[multiprocessing.pool.Pool]:
    """A pool of forked workers that ``terminate`` (on leaving it) kills outright: each starts with
    SIGTERM's default action. A handler inherited from this process (a Ray driver's raises
    SystemExit) could otherwise unwind a worker caught in its exit path out of the fork and on
    through this process's code — a second copy of the caller running on. ``jobs``: handed to each
    worker as it starts (``_probe_in_worker`` then names a job by its place, instead of pickling it
    with every probe)."""
    try:
        inherited = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (for the fork to copy)
    except ValueError:  # not the main thread: the workers reset it as they start
        inherited = None
    try:
        pool = multiprocessing.Pool(workers, initializer=_hold_jobs, initargs=(jobs or [],))
    finally:
        if inherited is not None:
            signal.signal(signal.SIGTERM, inherited)
    with pool:
        yield pool


@dataclass(eq=False)  # (hashed by identity: a task's key names its follow-up)
class FollowUp:
    """Work that waits for some chains to be decided: once they are (their candidates recorded),
    ``make`` gives its simulations as (function, arguments) tasks, and their results land in
    ``results``, in order. ``run_chains`` runs it on its pool while other chains are still searched
    (the planner verifies a plan as soon as the chains it comes from are decided)."""

    chains: list[Chain]
    make: Callable[[], list[tuple[Callable[..., Any], tuple[Any, ...]]]]
    results: list[Any] | None = None  # (None: not run yet)


def run_follow_ups(follow_ups: list[FollowUp]) -> None:
    """Each follow-up's tasks in this process, in order (its chains decided already)."""
    for f in follow_ups:
        f.results = [fn(*args) for fn, args in f.make()]


def run_chains(chains: list[Chain], workers: int, progress: Progress, follow_ups: list[FollowUp] | None = None) -> int:
    """Evaluate every chain's candidates (filling in their results), and run the ``follow_ups``;
    returns how many candidates were simulated."""
    full = [(chain, i) for chain in chains if not chain.stop_losers for i in range(len(chain.jobs))]
    results = run_all(evaluate, [(chain.jobs[i][1],) for chain, i in full], workers)
    for (chain, i), result in zip(full, results):
        chain.record(i, result)
        progress(chain.label, i + 1, len(chain.jobs))
    searches = [BestFirst(chain) for chain in chains if chain.stop_losers]
    # (the cyclic collector off for the whole search: turned back on after each chain, its first pass
    # walked all the chain's probes and their simulations — ~4% of a plan's time, once per chain)
    with gc_paused():
        if workers > 1:
            return len(full) + _run_on_pool(searches, workers, progress, follow_ups or [])
        for search in searches:
            search.run(progress)
        num_simulated = len(full) + sum(search.finish(progress) for search in searches)
        run_follow_ups(follow_ups or [])
        return num_simulated


_Key = tuple[int, int, float]  # (chain, candidate, rate)
_TaskKey = tuple[FollowUp, int]  # (its follow-up, its place there)


def _run_on_pool(searches: list[BestFirst], workers: int, progress: Progress, follow_ups: list[FollowUp]) -> int:
    """Every chain's ``run`` at once on a pool of ``workers`` processes (the module docstring), each
    follow-up's tasks as soon as its chains are decided, and every chain's ``finish``; returns how many
    candidates were simulated."""
    done: dict[_Key, tuple[Probe, str]] = {}
    finished: queue.SimpleQueue[tuple[_Key | _TaskKey, Any]] = queue.SimpleQueue()
    running: set[_Key | _TaskKey] = set()
    search_of = {id(search.chain): search for search in searches}
    waiting = list(follow_ups)  # (not made yet)
    recorded: set[int] = set()  # the searches finished (their candidates recorded)
    num_simulated = 0

    def known(c: int) -> Callable[[int, float], bool | None]:
        return lambda i, rate: done[c, i, rate][0].meets if (c, i, rate) in done else None

    def decided(chain: Chain) -> bool:
        search = search_of.get(id(chain))
        return search is None or search.next_probe() is None  # (a chain searched in full is done already)

    def record(search: BestFirst) -> None:
        nonlocal num_simulated
        if id(search) not in recorded:
            recorded.add(id(search))
            num_simulated += search.finish(progress)

    # (multiprocessing's Pool, not concurrent.futures': a probe ahead still running at the end is killed, not waited for)
    with _pool(workers, [[job for _, job in search.chain.jobs] for search in searches]) as pool:

        def submit(key: _Key | _TaskKey, fn: Callable[..., Any] = _probe_in_worker, args: tuple[Any, ...] | None = None) -> None:
            """A probe (``key`` names it) or a follow-up's task, its outcome put in ``finished`` under ``key``."""
            pool.apply_async(fn, key if args is None else args,
                             callback=lambda out: finished.put((key, out)),
                             error_callback=lambda err: finished.put((key, err)))
            running.add(key)

        while True:
            wanted: list[_Key] = []
            for c, search in enumerate(searches):
                while (step := search.next_probe()) is not None and (c, *step) in done:
                    search.learn(step[0], *done.pop((c, *step)))
                    progress(search.chain.label, search.settled(), len(search.cands))
                if step is not None:
                    wanted.append((c, *step))
            for f in [f for f in waiting if all(decided(chain) for chain in f.chains)]:
                waiting.remove(f)
                for chain in f.chains:
                    if chain_search := search_of.get(id(chain)):
                        record(chain_search)
                tasks = f.make()
                f.results = [None] * len(tasks)
                for j, (fn, args) in enumerate(tasks):
                    submit((f, j), fn, args)
            tasks_running = any(len(key) == 2 for key in running)
            if not wanted and not tasks_running:
                break
            for key in wanted:  # every chain's next probe: certain to be needed
                if key not in running:
                    submit(key)
            for c, i, rate in wanted:  # then, on free workers, the probes each chain is likely to make next
                if len(running) >= workers:
                    break  # (before weighing what-ifs: that is most of this process's work)
                for step in searches[c].ahead(i, rate, known(c)):
                    if (c, *step) not in done and (c, *step) not in running:
                        submit((c, *step))
                    if len(running) >= workers:
                        break
            key, out = _next_outcome(finished, pool)
            running.discard(key)
            if isinstance(out, BaseException):
                raise out
            if len(key) == 2:
                follow_up, j = key  # type: ignore[misc]
                follow_up.results[j] = out
            else:
                done[key] = out  # type: ignore[index]
    for search in searches:
        record(search)
    return num_simulated
