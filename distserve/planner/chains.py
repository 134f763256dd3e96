"""Evaluating the planner's candidates: each search's candidates as a *chain*, in one process or on a pool.

A chain is one search's candidates (colocated configs, prefill configs, decode configs, low-affinity
units), best throughput bound per GPU first. Its rules are sequential: a candidate whose bound per
GPU cannot beat the best goodput per GPU found so far in its chain is skipped, and a simulated one
only searches on while it may still beat that best (``find_goodput``'s ``min_rate``, just above
it: one that can at most tie it cannot win, as ``best_of`` prefers the earlier of equals). Chains
are independent of each other.

``run_chains`` with one worker walks the chains in order. With more, it keeps every worker busy and
still gives exactly the sequential answer — every candidate's goodput, probes, binding or skip:

* the next candidate of every chain, with its true ``min_rate``, is evaluated first (chains are
  independent, so this is never wasted);
* a free worker then evaluates a later candidate *speculatively*, with the ``min_rate`` it would get
  if the candidates before it (still running) do not raise their chain's best — the usual case,
  as most candidates lose;
* a candidate is committed, in chain order, only from an evaluation with its true ``min_rate``;
  a speculation made with another one is not used as such, but its simulations are: a candidate's
  probe at a given rate is the same simulation whatever its ``min_rate`` (``find_goodput``'s
  ``memo``), so evaluating it again mostly reuses them.

``run_all`` runs other independent simulations (the options' verification) on a pool the same way.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from distserve.placement import Placement
from distserve.planner.plan import Candidate
from distserve.slo import SLOSpec
from simulator.goodput import GoodputResult, find_goodput
from simulator.latency import LatencyModel
from simulator.metrics import SimResult
from simulator.simulation import SimConfig
from simulator.workload import Request

_Memo = dict[tuple[float, bool], tuple[SimResult, bool]]  # find_goodput's simulations, by (rate, may stop early)
T = TypeVar("T")
Evaluation = tuple[float, str | None, list[tuple[float, dict[str, float], bool]], float | None, int]


def rounded(rate: float) -> float:
    """``rate`` to 9 significant digits: equal bounds computed along different paths compare equal."""
    return float(f"{rate:.9g}")


@dataclass(frozen=True)
class Job:
    """One candidate's goodput search, as a worker process runs it."""

    kind: str
    placement: Placement
    latency: LatencyModel
    unit_requests: tuple[Request, ...]
    slo: SLOSpec
    config: SimConfig
    rel_tol: float
    start_rate: float
    max_rate: float | None
    min_rate: float | None = None  # the lowest rate that beats the best candidate so far
    early_stop: bool = True  # probes end once their verdict is certain


def evaluate(job: Job, memo: _Memo | None = None) -> Evaluation:
    g: GoodputResult = find_goodput(job.placement, job.latency, job.unit_requests, job.slo, job.config,
                                    rel_tol=job.rel_tol, start_rate=job.start_rate, max_rate=job.max_rate,
                                    min_rate=job.min_rate, early_stop=job.early_stop, early_pass=job.early_stop,
                                    memo=memo)
    return (g.rate, g.binding, [(p.rate, p.attainment, p.meets) for p in g.probes], g.below,
            sum(p.stopped_early for p in g.probes))


def _evaluate_remote(job: Job, memo: _Memo, send_memo: bool) -> tuple[Evaluation, _Memo]:
    """``evaluate`` in a worker: also the simulations it added to ``memo``, if asked (a speculation's,
    for a later evaluation with another ``min_rate``: a certain one's would not be read)."""
    known = set(memo)
    result = evaluate(job, memo)
    return result, {k: v for k, v in memo.items() if k not in known} if send_memo else {}


def chain_order(cand: Candidate) -> tuple[float, int]:
    """A chain's order: best bound per GPU first; bounds per GPU that differ by rounding only (pp
    scales them linearly) tie, fewer GPUs first (then as listed: the sort is stable)."""
    return -rounded(cand.bound_rate / cand.num_gpus), cand.num_gpus


def best_of(candidates: list[Candidate]) -> Candidate | None:
    """The winner among a chain's evaluated ``candidates`` (as listed): the best goodput per GPU,
    and of equals the first in chain order — the one a chain's rules let win (a later one is only
    searched while it may beat it), so a full search chooses as an early-stopped one."""
    return min((c for c in candidates if c.goodput > 0), key=lambda c: (-c.per_gpu, chain_order(c)), default=None)


@dataclass
class Chain:
    """One search's candidates and their jobs, sorted in ``chain_order`` (``run_chains``' rules)."""

    label: str
    jobs: list[tuple[Candidate, Job]]
    stop_losers: bool = True

    def __post_init__(self) -> None:
        self.jobs.sort(key=lambda cj: chain_order(cj[0]))

    def skip_reason(self, i: int, best: float) -> str | None:
        cand = self.jobs[i][0]
        if rounded(cand.bound_rate / cand.num_gpus) <= rounded(best):
            return f"bound {cand.bound_rate / cand.num_gpus:.3g} req/s/GPU <= best {best:.3g}"
        return None

    def min_rate(self, i: int, best: float) -> float | None:
        """The lowest rate at which candidate ``i`` beats ``best`` per GPU (a tie does not win)."""
        return math.nextafter(best * self.jobs[i][0].num_gpus, math.inf) if best > 0 and self.stop_losers else None

    def job(self, i: int, best: float) -> Job:
        return replace(self.jobs[i][1], min_rate=self.min_rate(i, best))

    def per_gpu(self, i: int, result: Evaluation) -> float:
        """The candidate's goodput per GPU given its evaluation (what ``record`` sets)."""
        cand = self.jobs[i][0]
        return min(result[0], cand.bound_rate) / cand.num_gpus

    def record(self, i: int, result: Evaluation) -> None:
        cand = self.jobs[i][0]
        cand.goodput, cand.binding, cand.probes, cand.goodput_below, cand.num_probes_stopped = result
        # A finite workload lets an overloaded deployment meet its SLO for a while (the TPOT of long
        # outputs absorbs seconds of queueing), so a simulated goodput can exceed what the deployment
        # sustains: it is capped at the candidate's steady-state throughput bound.
        if cand.goodput >= cand.bound_rate:
            cand.goodput = cand.bound_rate
            cand.binding = "throughput"


def run_all(fn: Callable[..., T], args: list[tuple[Any, ...]], workers: int) -> list[T]:
    """``[fn(*a) for a in args]``, on a pool of up to ``workers`` processes if there are two or more."""
    if workers <= 1 or len(args) <= 1:
        return [fn(*a) for a in args]
    with multiprocessing.Pool(min(workers, len(args))) as pool:
        return pool.starmap(fn, args)


Progress = Callable[[str, int, int], None]


def run_chains(chains: list[Chain], workers: int, progress: Progress) -> int:
    """Evaluate every chain's candidates (filling in their results); returns how many were simulated."""
    if workers <= 1:
        return sum(_run_sequential(chain, progress) for chain in chains)
    return _Speculation(chains, progress).run(workers)


def _run_sequential(chain: Chain, progress: Progress) -> int:
    best, simulated, total = 0.0, 0, len(chain.jobs)
    for i, (cand, _) in enumerate(chain.jobs):
        cand.skipped = chain.skip_reason(i, best)
        if cand.skipped is None:
            result = evaluate(chain.job(i, best))
            chain.record(i, result)
            best = max(best, cand.per_gpu)
            simulated += 1
        progress(chain.label, i + 1, total)
    return simulated


_Key = tuple[int, int, float | None]  # (chain, candidate, min_rate)


class _Speculation:
    """``run_chains`` on a process pool (see the module docstring): the sequential outcome, sooner."""

    def __init__(self, chains: list[Chain], progress: Progress) -> None:
        self.chains = chains
        self.progress = progress
        self.next = [0] * len(chains)  # each chain's first candidate not yet committed
        self.best = [0.0] * len(chains)  # each chain's best goodput per GPU among those committed
        self.memos: dict[tuple[int, int], _Memo] = {}
        self.done: dict[_Key, Evaluation] = {}
        self.simulated = 0

    def run(self, workers: int) -> int:
        finished: queue.SimpleQueue[tuple[_Key, tuple[Evaluation, _Memo] | BaseException]] = queue.SimpleQueue()
        running: set[_Key] = set()
        # (multiprocessing's Pool, not concurrent.futures': a speculation still running at the end is
        # killed, not waited for)
        with multiprocessing.Pool(workers) as pool:
            while self._commit():
                for key in self._wanted():
                    if len(running) >= workers:
                        break
                    if key not in self.done and key not in running:
                        c, i, min_rate = key
                        job = replace(self.chains[c].jobs[i][1], min_rate=min_rate)
                        certain = i == self.next[c] and min_rate == self.chains[c].min_rate(i, self.best[c])
                        # (a copy: the pool pickles it in another thread, while this one may add to it)
                        pool.apply_async(_evaluate_remote, (job, dict(self.memos.get((c, i), {})), not certain),
                                         callback=lambda out, key=key: finished.put((key, out)),
                                         error_callback=lambda err, key=key: finished.put((key, err)))
                        running.add(key)
                key, out = finished.get()
                if isinstance(out, BaseException):
                    raise out
                running.discard(key)
                result, memo = out
                if key[1] >= self.next[key[0]]:  # (else committed meanwhile)
                    self.memos.setdefault(key[:2], {}).update(memo)
                self.done[key] = result
        return self.simulated

    def _commit(self) -> bool:
        """Commit every chain's candidates whose true evaluation is known; False once all are."""
        for c, chain in enumerate(self.chains):
            total = len(chain.jobs)
            while (i := self.next[c]) < total:
                cand = chain.jobs[i][0]
                cand.skipped = chain.skip_reason(i, self.best[c])
                if cand.skipped is None:
                    result = self.done.get((c, i, chain.min_rate(i, self.best[c])))
                    if result is None:
                        break
                    chain.record(i, result)
                    self.best[c] = max(self.best[c], cand.per_gpu)
                    self.simulated += 1
                self.memos.pop((c, i), None)  # (a speculation still running may add to it: unused)
                self.next[c] += 1
                self.progress(chain.label, i + 1, total)
        return any(n < len(chain.jobs) for n, chain in zip(self.next, self.chains))

    def _wanted(self) -> list[_Key]:
        """Evaluations to run, most useful first: every chain's next candidate (certain to be needed),
        then later ones with the ``min_rate`` they get if the candidates before them do not win."""
        certain: list[_Key] = []
        guesses: list[list[_Key]] = []
        for c, chain in enumerate(self.chains):
            best, mine = self.best[c], []
            for i in range(self.next[c], len(chain.jobs)):
                if chain.skip_reason(i, best) is not None:
                    continue
                key = (c, i, chain.min_rate(i, best))
                if key in self.done:
                    best = max(best, chain.per_gpu(i, self.done[key]))
                else:
                    mine.append(key)  # (running or not: assume it loses)
            if mine and mine[0][1] == self.next[c]:
                certain.append(mine.pop(0))
            guesses.append(mine)
        depth = max((len(g) for g in guesses), default=0)
        return certain + [g[d] for d in range(depth) for g in guesses if d < len(g)]
