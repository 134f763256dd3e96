"""Goodput-driven placement search (DistServe's algorithms) over our simulator.

Given a model, a cluster, a workload, SLOs and a latency model, find the placement with the highest
SLO-meeting rate per GPU:

* **high node-affinity** (fast network between nodes): the best prefill (tp, pp) and the best decode
  (tp, pp) are searched *independently* — prefill with single-token requests (only TTFT counts),
  decode with instant prefills (only TPOT counts) — each by simulation + bisection of its goodput;
  then ``n = ⌈R / goodput_p⌉`` prefill and ``m = ⌈R / goodput_d⌉`` decode replicas (nPmD);
* **low node-affinity** (KV must not cross nodes): a *unit* puts every pipeline stage's prefill and
  decode segments on one node (stage i of all its instances on node i); units of
  ``n_p × (tp_p, pp) + n_d × (tp_d, pp)`` are simulated whole (migrations on NVLink) and replicated;
* the **colocated** baseline searched the same way (best (tp, pp), replicas), so every plan says how
  disaggregation compares and recommends colocated when it wins.

Cheap bounds prune before simulating: a candidate whose unloaded latency already misses the SLO
(its M/D/1 floor) is dropped, and a candidate's throughput bound (full batches back to back, no SLO)
caps its goodput. Each search's candidates form a chain (``planner.chains``) searched best first:
the candidate whose goodput per GPU may still be highest is probed next, and each loser only until it
certainly loses (one whose bound cannot beat the winner is never simulated): which candidates win,
and their goodputs, are exactly those of the full search. With ``max_workers`` > 1 the chains' probes
run in parallel, and probes a chain is likely to make next ahead, with exactly the one-process outcome.

With an SLO per scheduling class (``PlanRequest.class_slos``) and a workload of two or more
classes, the best disaggregated plan is also weighed divided into class pools of decode instances
(``planner.classes``), and replaced by the split the rule there chooses.

This module owns the search (``Planner``); what it is asked and answers is in ``planner.plan``, the
layouts it tries and their bounds in ``planner.candidates``, the class pools in ``planner.classes``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from distserve.errors import InvalidConfigError
from distserve.placement import CAPS, InstanceSpec, Placement
from distserve.planner.candidates import assign_nodes, decode_bound, parallel_configs, prefill_bound, replicate_units
from distserve.planner.chains import Chain, FollowUp, Job, best_of, run_all, run_chains
from distserve.planner.classes import ClassComparison, compare_pools, workload_objectives
from distserve.planner.plan import Candidate, PlanOption, PlanRequest, PlanResult
from distserve.slo import SLO, SLOSpec
from simulator.latency import LatencyModel
from simulator.simulation import SimConfig, simulate, with_rate
from simulator.workload import Request


Wanted = tuple[str, Placement, float, "str | None"]  # an option: (name, placement, rate, colocated step budget)
Placed = tuple[str, Placement, float, "SimConfig | None", "str | None"]  # ... as deployed: (name, placement, rate, config, budget)


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values)


def _quantile(values: Sequence[int], q: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _predicted(placement: Placement, latency: LatencyModel, unit_requests: tuple[Request, ...], rate: float,
               config: SimConfig, slo: SLOSpec) -> dict[str, Any]:
    """A plan simulated at its rate: the predicted figures written into its Placement."""
    s = simulate(placement, latency, with_rate(unit_requests, rate), config).summary(slo)
    return {k: s[k] for k in ("attainment", "meets_slo", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")}


class Planner:
    """Runs the search; ``plan()`` returns a ``PlanResult``."""

    def __init__(self, request: PlanRequest, progress: Callable[[str, int, int], None] | None = None) -> None:
        self.req = request
        self.progress = progress or (lambda label, done, total: None)
        reqs = request.unit_requests
        self.prompt_mean = _mean([r.prompt_len for r in reqs])
        self.output_mean = _mean([r.output_len for r in reqs])
        self.prompt_p90 = _quantile([r.prompt_len for r in reqs], 0.9)
        self.num_simulated = 0
        self.notes: list[str] = []
        cfg = request.sim_config
        self.configs = parallel_configs(request.latency, request.cluster, cfg.mem_utilization)
        if not self.configs:
            raise InvalidConfigError(
                f"{request.latency.model.name} fits no (tp, pp) layout on {request.cluster.num_nodes} x "
                f"{request.cluster.gpus_per_node} {request.cluster.gpu.name} (weights "
                f"{request.latency.model.weight_bytes / 2**30:.0f} GiB): the model does not fit the cluster"
            )

    # -- phase SLOs and workloads --
    def _prefill_only(self) -> tuple[tuple[Request, ...], SLOSpec]:
        reqs = tuple(replace(r, output_len=1) for r in self.req.unit_requests)
        d = self.req.slo.default
        return reqs, replace(self.req.slo, default=SLO(d.ttft_s, math.inf, d.attainment), classes={})

    def _decode_only(self) -> SLOSpec:
        d = self.req.slo.default
        return replace(self.req.slo, default=SLO(math.inf, d.tpot_s, d.attainment), classes={})

    def _start_rate(self, bound: float) -> float:
        return max(1e-3, 0.5 * bound) if math.isfinite(bound) else 1.0

    def _run(self, chains: list[Chain], follow_ups: list[FollowUp]) -> None:
        """Evaluate the chains' candidates (``planner.chains``: best first, each search going on only
        while it may still win), and run the ``follow_ups`` (each option's verification, as soon as its
        chains are decided)."""
        num_simulated = run_chains(chains, max(1, self.req.max_workers), self.progress, follow_ups)  # (the follow-ups count theirs)
        self.num_simulated += num_simulated

    def _chain(self, label: str, jobs: list[tuple[Candidate, Job]]) -> Chain:
        return Chain(label, jobs, self.req.stop_losers)

    def _job(self, cand: Candidate, reqs: tuple[Request, ...], slo: SLOSpec, config: SimConfig) -> Job:
        bound = cand.bound_rate if math.isfinite(cand.bound_rate) else None
        return Job(cand.kind, cand.placement, self.req.latency, reqs, slo, config, self.req.rel_tol,
                    self._start_rate(cand.bound_rate), bound, early_stop=self.req.stop_probes)

    def _floor_misses(self, kind: str, tp: int, pp: int) -> str | None:
        """The unloaded latency (M/D/1 with no queue) already misses the SLO."""
        lat, slo, cfg = self.req.latency, self.req.slo.default, self.req.sim_config
        if kind in ("prefill", "colocated") and (t := cfg.prefill_scale * lat.prefill_time([self.prompt_p90], tp, pp)) > slo.ttft_s:
            return f"an unloaded P90 prompt takes {t:.3g} s > TTFT {slo.ttft_s} s"
        ctx = int(self.prompt_mean + self.output_mean)
        if kind in ("decode", "colocated") and (t := cfg.step_time_scale * lat.decode_time([ctx], tp, pp)) > slo.tpot_s:
            return f"an unloaded decode step takes {t:.3g} s > TPOT {slo.tpot_s} s"
        return None

    def _spec(self, tp: int, pp: int) -> InstanceSpec:
        """An instance as planned: with the torch threads per worker its latency was measured at."""
        return InstanceSpec(tp, pp, threads=self.req.latency.threads)

    # -- searches --
    def phase_chains(self) -> tuple[list[Candidate], list[Candidate], list[Chain]]:
        """High affinity: the prefill and the decode configs, each searched alone."""
        lat, cfg = self.req.latency, self.req.sim_config
        pre_reqs, pre_slo = self._prefill_only()
        dec_slo = self._decode_only()
        dec_cfg = replace(cfg, instant_prefill=True)
        pre: list[tuple[Candidate, Job]] = []
        dec: list[tuple[Candidate, Job]] = []
        out_p, out_d = [], []
        for tp, pp in self.configs:
            spec = self._spec(tp, pp)
            c = Candidate("prefill", Placement(prefill=(spec,), decode=(spec,)), tp * pp,
                          prefill_bound(lat, tp, pp, self.prompt_mean, cfg.prefill_scheduler.max_num_batched_tokens) / cfg.prefill_scale)
            c.skipped = self._floor_misses("prefill", tp, pp)
            out_p.append(c)
            if c.skipped is None:
                pre.append((c, self._job(c, pre_reqs, pre_slo, cfg)))
            kv = lat.max_kv_tokens(tp, pp, cfg.mem_utilization)
            d = Candidate("decode", Placement(prefill=(spec,), decode=(spec,)), tp * pp,
                          decode_bound(lat, tp, pp, self.prompt_mean, self.output_mean, cfg.decode_scheduler.max_num_seqs, kv)
                          / cfg.step_time_scale)
            d.skipped = self._floor_misses("decode", tp, pp)
            out_d.append(d)
            if d.skipped is None:
                dec.append((d, self._job(d, self.req.unit_requests, dec_slo, dec_cfg)))
        return out_p, out_d, [self._chain("prefill configs", pre), self._chain("decode configs", dec)]

    def colocated_configs(self) -> dict[str, SimConfig]:
        """The colocated scheduler policies to compare, by step budget: the configured one and, for a
        finite TPOT SLO, the "slo" budget (chunked prefill that keeps steps within the TPOT SLO, as
        a modern aggregated server runs) — the planner weighs disaggregation against the best one.
        A configured baseline step policy (``SchedulerConfig.step_policy``) is compared alone, keyed by its name."""
        cfg = self.req.sim_config
        if cfg.scheduler.step_policy != "mixed":  # a named baseline ("vllm-2023"): it alone, as it comes
            return {cfg.scheduler.step_policy: cfg}
        out = {cfg.scheduler.step_budget: cfg}
        tpot = self.req.slo.default.tpot_s
        if "slo" not in out and math.isfinite(tpot):
            out["slo"] = replace(cfg, scheduler=replace(cfg.scheduler, step_budget="slo", tpot_slo_s=tpot))
        return out

    def colocated_chain(self) -> tuple[list[Candidate], Chain]:
        lat = self.req.latency
        jobs, out = [], []
        for budget, cfg in self.colocated_configs().items():
            for tp, pp in self.configs:
                spec = self._spec(tp, pp)
                kv = lat.max_kv_tokens(tp, pp, cfg.mem_utilization)
                # One instance does both phases: per request it spends a prefill share and a decode share.
                bound = 1.0 / (
                    cfg.prefill_scale / prefill_bound(lat, tp, pp, self.prompt_mean, cfg.scheduler.max_num_batched_tokens)
                    + cfg.step_time_scale / decode_bound(lat, tp, pp, self.prompt_mean, self.output_mean, cfg.scheduler.max_num_seqs, kv)
                )
                c = Candidate("colocated", Placement(colocated=(spec,)), tp * pp, bound, step_budget=budget)
                c.skipped = self._floor_misses("colocated", tp, pp)
                out.append(c)
                if c.skipped is None:
                    jobs.append((c, self._job(c, self.req.unit_requests, self.req.slo, cfg)))
        return out, self._chain("colocated configs", jobs)

    def unit_chain(self) -> tuple[list[Candidate], Chain]:
        """Units whose every stage's prefill + decode segments share one node."""
        lat, cfg, cluster = self.req.latency, self.req.sim_config, self.req.cluster
        g = cluster.gpus_per_node
        configs = [(tp, pp) for tp, pp in self.configs if pp <= cluster.num_nodes]
        jobs, out = [], []
        for tp_p, pp in configs:
            for tp_d, pp_d in configs:
                if pp_d != pp:
                    continue
                for n_p in range(1, g // tp_p + 1):
                    for n_d in range(1, (g - n_p * tp_p) // tp_d + 1):
                        placement = Placement(
                            prefill=tuple(self._spec(tp_p, pp) for _ in range(n_p)),
                            decode=tuple(self._spec(tp_d, pp) for _ in range(n_d)),
                        )
                        kv = lat.max_kv_tokens(tp_d, pp, cfg.mem_utilization)
                        bound = min(
                            n_p * prefill_bound(lat, tp_p, pp, self.prompt_mean, cfg.prefill_scheduler.max_num_batched_tokens)
                            / cfg.prefill_scale,
                            n_d * decode_bound(lat, tp_d, pp, self.prompt_mean, self.output_mean, cfg.decode_scheduler.max_num_seqs, kv)
                            / cfg.step_time_scale,
                        )
                        c = Candidate("unit", placement, (n_p * tp_p + n_d * tp_d) * pp, bound)
                        c.skipped = self._floor_misses("prefill", tp_p, pp) or self._floor_misses("decode", tp_d, pp)
                        out.append(c)
                        if c.skipped is None:
                            jobs.append((c, self._job(c, self.req.unit_requests, self.req.slo, cfg)))
        return out, self._chain("low-affinity units", jobs)

    # -- assembling plans --
    def _replicate(self, kind: str, parts: list[tuple[InstanceSpec, float, str]], unit_gpus: int | None = None) -> tuple[list[int], float] | None:
        """Replica counts for each part (spec, goodput, phase): ⌈R/g⌉ each, or fill the GPU budget."""
        total = self.req.gpu_budget or self.req.cluster.num_gpus
        gpus = [s.tp * s.pp for s, _, _ in parts]
        if self.req.rate is not None:
            counts = [math.ceil(self.req.rate / g) for _, g, _ in parts]
            need = sum(c * n for c, n in zip(counts, gpus))
            if need > total:
                self.notes.append(f"{kind}: serving {self.req.rate:g} req/s needs {need} GPUs, the cluster has {total}")
                return None
            return counts, self.req.rate
        # GPU budget: the counts maximising the system rate min_i(count_i * g_i) within the cluster.
        best: tuple[list[int], float] | None = None
        if len(parts) == 1:
            n = total // gpus[0]
            return ([n], n * parts[0][1]) if n else None
        (sp, gp, _), (sd, gd, _) = parts
        for n in range(1, total // gpus[0] + 1):
            m = (total - n * gpus[0]) // gpus[1]
            if m < 1:
                break
            rate = min(n * gp, m * gd)
            # Don't keep GPUs that add nothing: trim the surplus side.
            n_used = math.ceil(rate / gp - 1e-9)
            m_used = math.ceil(rate / gd - 1e-9)
            used = n_used * gpus[0] + m_used * gpus[1]
            if best is None or rate / used > best[1] / max(1, sum(c * g for c, g in zip(best[0], gpus))):
                best = ([n_used, m_used], rate)
        return best

    def _verify(self, placement: Placement, rate: float, config: SimConfig | None = None) -> dict[str, Any]:
        """Simulate the whole plan at its rate: the predicted figures written into the Placement."""
        return self._verify_all([(placement, rate, config)])[0]

    def _verify_args(self, placement: Placement, rate: float, config: SimConfig | None) -> tuple[Any, ...]:
        """``_predicted``'s arguments for ``placement`` at ``rate``."""
        return placement, self.req.latency, self.req.unit_requests, rate, config or self.req.sim_config, self.req.slo

    def _verify_all(self, plans: list[tuple[Placement, float, SimConfig | None]]) -> list[dict[str, Any]]:
        """``_verify`` for each plan: with workers, in parallel."""
        self.num_simulated += len(plans)
        return run_all(_predicted, [self._verify_args(*plan) for plan in plans], max(1, self.req.max_workers))

    def _colocated_option(self, colo: list[Candidate]) -> Wanted | None:
        best = best_of(colo)
        if best is None:
            return None
        spec = best.placement.colocated[0]
        rep = self._replicate("colocated", [(spec, best.goodput, "colocated")])
        if rep is None:
            return None
        (n,), rate = rep
        return "colocated", Placement(colocated=tuple(spec for _ in range(n))), rate, best.step_budget

    def _high_affinity_option(self, pre: list[Candidate], dec: list[Candidate]) -> Wanted | None:
        bp, bd = best_of(pre), best_of(dec)
        if bp is None or bd is None:
            return None
        sp, sd = bp.placement.prefill[0], bd.placement.decode[0]
        rep = self._replicate("disagg", [(sp, bp.goodput, "prefill"), (sd, bd.goodput, "decode")])
        if rep is None:
            return None
        (n, m), rate = rep
        return "disaggregated (high affinity)", Placement(prefill=tuple(sp for _ in range(n)), decode=tuple(sd for _ in range(m))), rate, None

    def _low_affinity_option(self, units: list[Candidate]) -> Wanted | None:
        cluster = self.req.cluster
        bu = best_of(units)
        if bu is None:
            return None
        pp = bu.placement.prefill[0].pp
        nodes_per_unit = pp
        max_units = min(cluster.num_nodes // nodes_per_unit, (self.req.gpu_budget or cluster.num_gpus) // bu.num_gpus)
        k = max_units if self.req.rate is None else math.ceil(self.req.rate / bu.goodput)
        if not 1 <= k <= max_units:
            self.notes.append(f"low affinity: {k} units of {bu.label()} needed, {max_units} fit the cluster")
            return None
        rate = k * bu.goodput if self.req.rate is None else self.req.rate
        return "disaggregated (low affinity)", replicate_units(bu.placement, k, pp), rate, None

    def _option_follow_up(self, chains: list[Chain], build: Callable[[], Wanted | None]) -> FollowUp:
        """An option's verification, once ``chains`` are decided: ``build`` assembles the option (None:
        there is none), the follow-up's one task simulates it (``_placed`` keeps what it was built as)."""
        def make() -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
            # (its notes kept apart, for ``plan`` to add in the options' order whenever each was built)
            notes, self.notes = self.notes, self._notes_of[follow_up]
            try:
                wanted = build()
            finally:
                self.notes = notes
            if wanted is None:
                return []
            placed = self._placed[follow_up] = self._place(wanted)
            self.num_simulated += 1
            return [(_predicted, self._verify_args(placed[1], placed[2], placed[3]))]

        follow_up = FollowUp(chains, make)
        self._notes_of[follow_up] = []
        return follow_up

    def plan(self) -> PlanResult:
        affinity = self.req.affinity
        candidates: list[Candidate] = []
        # Every search's candidates evaluated at once (the chains are independent: with workers, in parallel),
        # each option verified as soon as the chains it comes from are decided.
        self._placed: dict[FollowUp, Placed] = {}  # each option that was built, as deployed (by its follow-up)
        self._notes_of: dict[FollowUp, list[str]] = {}  # what building each option noted
        colo, chain = self.colocated_chain()
        chains = [chain]
        follow_ups = [self._option_follow_up([chain], lambda: self._colocated_option(colo))]
        if affinity in ("high", "auto"):
            pre, dec, phase_chains = self.phase_chains()
            chains += phase_chains
            follow_ups.append(self._option_follow_up(phase_chains, lambda: self._high_affinity_option(pre, dec)))
        if affinity in ("low", "auto"):
            units, chain = self.unit_chain()
            chains.append(chain)
            follow_ups.append(self._option_follow_up([chain], lambda: self._low_affinity_option(units)))
        self._run(chains, follow_ups)
        candidates += colo
        if affinity in ("high", "auto"):
            candidates += pre + dec
        if affinity in ("low", "auto"):
            candidates += units
        for f in follow_ups:
            self.notes += self._notes_of[f]
        options = [self._option(self._placed[f], f.results[0]) for f in follow_ups if f in self._placed and f.results]
        options.sort(key=lambda o: -o.per_gpu)
        best = options[0] if options else None
        classes = self._class_pools(options) if self.req.class_slos else None
        if classes is not None and classes.chosen is not None:
            shared = next(o for o in options if o.placement == classes.shared.placement)
            split = self._pools_option(shared, classes)
            options.insert(options.index(shared), split)
            best = split if best is shared else best
        feasible = bool(options)
        closest = None if feasible else self._closest(candidates)
        return PlanResult(best, options, candidates, self.num_simulated, feasible, closest, self.notes, classes)

    def _class_pools(self, options: list[PlanOption]) -> ClassComparison | None:
        """The best disaggregated plan, weighed against its variants (``planner.classes``: class pools need two decode instances)."""
        if len(workload_objectives(self.req.unit_requests)) < 2:
            self.notes.append("class SLOs given, but the workload has one class: no class pools weighed")
            return None
        shared = next((o for o in options if o.placement.is_disaggregated), None)
        if shared is None:
            self.notes.append("no disaggregated plan to divide into class pools")
            return None
        comparison = compare_pools(shared.placement, shared.rate, self.req.latency, self.req.unit_requests, self.req.sim_config,
                                   self.req.class_slos, self.req.rel_tol)
        self.num_simulated += comparison.num_simulated
        if comparison.larger_cap is not None:
            cap = comparison.larger_cap.placement.decode[0].max_num_seqs
            self.notes.append(f"a larger decode batch cap alone ({cap}) serves every class more than the shared plan: "
                              f"try --max-num-seqs {cap} (see the per-class table)")
        return comparison

    def _pools_option(self, shared: PlanOption, classes: ClassComparison) -> PlanOption:
        """The chosen split as a deployable plan: the shared plan's instances and rate (it takes
        its place; the per-class gains are in the class table), its decode instances in pools."""
        chosen = classes.chosen
        assert chosen is not None
        placement, rate = chosen.placement, shared.rate
        option = PlanOption(f"{shared.name} + class pools", placement, shared.num_gpus, rate, self._verify(placement, rate))
        option.predicted.update({"rate": rate, "goodput_per_gpu": option.per_gpu, "num_gpus": option.num_gpus, "kind": option.name,
                                 "class_goodput": dict(classes.chosen.goodput), "class_goodput_shared": dict(classes.shared.goodput)})
        option.placement = self._deployable(placement, option.predicted)
        return option

    def _deployable(self, placement: Placement, predicted: dict[str, Any], config: SimConfig | None = None) -> Placement:
        """``placement`` as ``distserve serve`` deploys it: with its predicted figures, the SLO and the batch
        caps it was simulated with (the placement-wide ones; an instance's own where its phase's differ)."""
        cfg = config or self.req.sim_config
        main = cfg.scheduler if placement.colocated else cfg.decode_scheduler
        caps = {k: getattr(main, k) for k in CAPS}
        own = {k: getattr(cfg.prefill_scheduler, k) for k in CAPS}
        if placement.prefill and own != caps:  # prefill instances were simulated with caps of their own
            prefill = tuple(replace(s, **{k: v for k, v in own.items() if getattr(s, k) is None}) for s in placement.prefill)
            placement = replace(placement, prefill=prefill)
        return replace(placement, predicted=dict(predicted), slo=self.req.slo.default, max_model_len=cfg.max_model_len, **caps)

    def _place(self, wanted: Wanted) -> Placed:
        """An option (name, placement, rate, step budget) as deployed: its nodes assigned, the config it runs."""
        name, placement, rate, budget = wanted
        return (name, assign_nodes(placement, self.req.cluster) if "low" not in name else placement, rate,
                self.colocated_configs()[budget] if budget is not None else None, budget)

    def _option(self, placed: Placed, predicted: dict[str, Any]) -> PlanOption:
        """A placed option with its figures predicted (``_predicted``): deployable."""
        name, placement, rate, config, budget = placed
        option = PlanOption(name, placement, placement.num_workers, rate, predicted)
        option.predicted.update({"rate": rate, "goodput_per_gpu": option.per_gpu, "num_gpus": option.num_gpus, "kind": name})
        if budget is not None:
            option.predicted["step_budget"] = budget
        option.placement = self._deployable(placement, option.predicted, config)
        return option

    def _closest(self, candidates: list[Candidate]) -> str:
        """For impossible SLOs: the candidate with the best attainment at its lowest probe, and what binds.
        A phase searched alone (prefill or decode) counts only if the other phase had a candidate simulated
        too: decode instances that meet the TPOT SLO make no plan when no prefill can meet the TTFT SLO."""
        simulated = {c.kind for c in candidates if c.probes}
        best: tuple[float, Candidate, dict[str, float]] | None = None
        for c in candidates:
            if c.probes and (c.kind not in ("prefill", "decode") or {"prefill", "decode"} <= simulated):
                rate, att, _ = min(c.probes, key=lambda p: p[0])
                if best is None or att["joint"] > best[0]:
                    best = (att["joint"], c, att)
        if best is None:
            reasons = sorted({c.skipped for c in candidates if c.skipped})
            return "no candidate can meet the SLO even unloaded: " + "; ".join(reasons[:3])
        joint, c, att = best
        binding = "TTFT" if att["ttft"] < att["tpot"] else "TPOT"
        return (f"closest: {c.kind} {c.label()} reaches {joint:.0%} joint attainment (TTFT {att['ttft']:.0%}, "
                f"TPOT {att['tpot']:.0%}) at its lowest probed rate; the {binding} SLO binds")
