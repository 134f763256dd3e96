"""Fast-forward (``simulator.fast_forward``) changes nothing but the speed: every request's record,
every instance's figures and the simulated duration equal the step-by-step run's
(``SimConfig(fast_forward=False)``), on colocated and disaggregated deployments, chunked prefill,
fair admission of a flood, preemption under KV pressure, pipelines, classes and priorities, runs that
stop early, instant prefills, the SLO step budget and a prefix cache, and pipelined (pp > 1)
instances' micro-batches. Each case also checks that lazy decodes carried steps (``skipped``), so a
fast-forward that never fires cannot pass as identical. The simulation's skipped dispatch retries
are checked the same way, against retries at every instant."""

from __future__ import annotations

import gc
from dataclasses import fields, replace

import pytest

from distserve.cluster.admission import AdmissionConfig
from distserve.config import SchedulerConfig
from distserve.placement import InstanceSpec, Placement
from simulator.latency import FittedLatencyModel
from simulator.metrics import RequestRecord, SimResult
from simulator.multi_tenant import flood_workload
from simulator.profiles import TpCoefficients
from simulator.simulation import SimConfig, Simulation
from simulator.workload import Request, generate_requests

MODEL = "facebook/opt-13b"


def opt13b() -> FittedLatencyModel:
    """DistServe's fitted OPT-13B step times on A100s (tp 1 and 2, as ``test_fairness_sim``)."""
    c = TpCoefficients((18.10254647486372, 0.1019122572698738, 7.122264314252114e-06),
                       (19.934702624895458, 0.0006269356524350583, 0.03850697740828398),
                       (7.1661889468253595, 0.0005798000403396046, 0.15831096191764046), 95)
    return FittedLatencyModel(MODEL, {1: c, 2: c}, hardware="a100-80g")


def chat(rate: float, n: int, seed: int = 0) -> list[Request]:
    return generate_requests("chatbot", rate, n, seed=seed, max_total_len=2048)


def records(res: SimResult) -> list[tuple[object, ...]]:
    return [tuple(getattr(r, f.name) for f in fields(RequestRecord)) for r in res.records]


def both(placement: Placement, requests: list[Request], config: SimConfig = SimConfig(), stop_when=None) -> tuple[SimResult, Simulation]:
    """Run step by step and with fast-forward; assert every figure equal; return the fast run."""
    slow_sim = Simulation(placement, opt13b(), replace(config, fast_forward=False))
    slow = slow_sim.run(requests, stop_when)
    fast_sim = Simulation(placement, opt13b(), config)
    fast = fast_sim.run(requests, stop_when)
    assert slow_sim.num_fast_forward_steps == 0
    assert records(fast) == records(slow)
    assert fast.instances == slow.instances
    assert (fast.duration_s, fast.num_migrations, fast.migration_bytes, fast.mean_migration_s, fast.stopped_early) == (
        slow.duration_s, slow.num_migrations, slow.migration_bytes, slow.mean_migration_s, slow.stopped_early)
    assert fast.num_prefill_tokens_computed == slow.num_prefill_tokens_computed
    assert fast.admission == slow.admission
    return fast, fast_sim


def skipped(sim: Simulation, res: SimResult) -> float:
    """The share of all steps whose decodes the scheduler did not plan one by one (lazy decodes)."""
    return sim.num_fast_forward_steps / sum(i["num_steps"] for i in res.instances.values())


@pytest.mark.parametrize("num_colocated", [1, 2])
def test_colocated(num_colocated: int) -> None:
    res, sim = both(Placement.colocated_instances(num_colocated), chat(2.0 * num_colocated, 200))
    assert all(r.completed for r in res.records)
    assert skipped(sim, res) > 0.3


@pytest.mark.parametrize("num_prefill,num_decode", [(1, 1), (2, 2)])
def test_disaggregated(num_prefill: int, num_decode: int) -> None:
    res, sim = both(Placement.disaggregated(num_prefill, num_decode), chat(3.0 * num_prefill, 200))
    assert res.num_migrations == 200
    assert skipped(sim, res) > 0.2


def test_chunked_prefill() -> None:
    config = SimConfig(scheduler=SchedulerConfig(enable_chunked_prefill=True, max_num_batched_tokens=128))
    res, sim = both(Placement.colocated_instances(1), chat(3.0, 150), config)
    assert skipped(sim, res) > 0.2


def test_fair_admission_of_a_flood() -> None:
    requests = flood_workload(7.0, 300, max_total_len=2048)
    res, sim = both(Placement.disaggregated(1, 2), requests, SimConfig(admission=AdmissionConfig("fair")))
    assert len(res.tenants) > 2 and res.admission
    assert sim.num_fast_forward_steps > 0


@pytest.mark.parametrize("num_colocated,unit", [(1, "tokens"), (2, "tokens"), (2, "requests")])
def test_overload_behind_backpressure_with_deadlines(num_colocated: int, unit: str) -> None:
    """Past the knee requests wait in the admission queue (backpressure) and some time out there:
    steps that end while nothing can be dispatched are jumped over, up to the next deadline. By
    requests waiting, an instance's launch makes it accept again before its step ends: no jump then."""
    requests = [replace(r, timeout_s=(5.0, 2.0)[num_colocated - 1] if r.req_id % 3 == 0 else None)
                for r in chat((12.0, 30.0)[num_colocated - 1], 250, seed=4)]
    config = SimConfig(admission=AdmissionConfig(max_waiting=2, waiting_unit=unit))
    res, sim = both(Placement.colocated_instances(num_colocated), requests, config)
    assert any(r.dropped == "expired" for r in res.records) and any(r.admission_wait_s for r in res.records)
    assert skipped(sim, res) > 0.05


def test_saturated_decodes_and_class_pools() -> None:
    """Decode instances at their batch cap: finished prefills wait for room (one lane per class
    pool) and every step's end retries them; a full instance still jumps until it could take one."""
    requests = [replace(r, objective=("latency", "throughput")[r.req_id % 2]) for r in chat(10.0, 250, seed=5)]
    small = InstanceSpec(max_num_seqs=4)
    for decode in ((small, small), (replace(small, pool="latency"), InstanceSpec(pool="throughput", max_num_seqs=8))):
        res, sim = both(Placement(prefill=(InstanceSpec(),) * 2, decode=decode), requests)
        assert sim.num_fast_forward_steps > 0


@pytest.mark.parametrize("placement", [Placement.colocated_instances(1), Placement.disaggregated(1, 1)], ids=["colocated", "1p1d"])
def test_preemption_under_kv_pressure(placement: Placement) -> None:
    res, sim = both(placement, chat(4.0, 150, seed=1), SimConfig(num_blocks=160))
    assert sum(r.num_preemptions for r in res.records) > 0
    assert sim.num_fast_forward_steps > 0


def test_pipelines() -> None:
    """A pp = 2 prefill instance bounds the decode instances' jumps by its plans' ends; the pp = 2
    decode instance jumps its micro-batches, the pp = 1 one its steps."""
    placement = Placement(prefill=(InstanceSpec(tp=1, pp=2),), decode=(InstanceSpec(tp=1, pp=2), InstanceSpec(tp=2, pp=1)))
    res, sim = both(placement, chat(3.0, 150), SimConfig(num_blocks=2000))
    assert {i["pp"] for i in res.instances.values()} == {1, 2}
    assert skipped(sim, res) > 0.5


PIPELINES = {
    # fewer lanes than stages: one micro-batch holds every sequence, the launches in between plan nothing
    "colocated pp2": (Placement(colocated=(InstanceSpec(tp=1, pp=2),)), 4.0, SimConfig()),
    "colocated pp4": (Placement(colocated=(InstanceSpec(tp=1, pp=4),)), 8.0, SimConfig()),
    "2 colocated pp2": (Placement(colocated=(InstanceSpec(tp=1, pp=2),) * 2), 8.0, SimConfig()),
    # as many lanes as stages (a batch cap of 8 per micro-batch), requests waiting behind them
    "lanes = stages": (Placement(colocated=(InstanceSpec(tp=1, pp=2, max_num_seqs=8),)), 6.0, SimConfig()),
    "pp4 lanes": (Placement(colocated=(InstanceSpec(tp=1, pp=4, max_num_seqs=4),)), 10.0, SimConfig()),
    "1p1d pp2": (Placement(prefill=(InstanceSpec(tp=1, pp=2),), decode=(InstanceSpec(tp=1, pp=2),)), 4.0, SimConfig(num_blocks=2000)),
    "1p2d pp4": (Placement(prefill=(InstanceSpec(tp=1, pp=4),), decode=(InstanceSpec(tp=1, pp=4),) * 2), 6.0, SimConfig(num_blocks=2000)),
    # a saturated decode instance: finished prefills wait for its room, every step's end retries them
    "saturated decode": (Placement(prefill=(InstanceSpec(),) * 2, decode=(InstanceSpec(tp=1, pp=2, max_num_seqs=4),)), 8.0, SimConfig()),
    "preemption": (Placement(colocated=(InstanceSpec(tp=1, pp=2),)), 6.0, SimConfig(num_blocks=160)),
    "slo budget": (Placement(colocated=(InstanceSpec(tp=1, pp=2),)), 4.0,
                   SimConfig(scheduler=SchedulerConfig(step_budget="slo", tpot_slo_s=0.05, enable_chunked_prefill=True))),
    "prefix cache": (Placement(colocated=(InstanceSpec(tp=1, pp=2, max_num_seqs=8),)), 5.0, SimConfig(enable_prefix_caching=True, num_blocks=600)),
}


@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_pipelined_instances_jump(case: str) -> None:
    """pp > 1 instances jump their micro-batches (``simulator.lazy_lanes``): every record, step count
    and clock equals the step-by-step run's, and most steps were jumped."""
    placement, rate, config = PIPELINES[case]
    requests = chat(rate, 150, seed=1)
    if case == "prefix cache":  # shared prompt prefixes: commits register hashes, reused blocks evict them
        shared = tuple(range(7, 7 + 96))
        requests = [replace(r, prompt_token_ids=shared[: 32 + r.req_id % 64] + tuple(range(r.prompt_len)),
                            prompt_len=32 + r.req_id % 64 + r.prompt_len) for r in requests]
        requests = [r for r in requests if r.prompt_len + r.output_len <= 2048]
    res, sim = both(placement, requests, config)
    assert all(i["pp"] > 1 for n, i in res.instances.items() if not n.startswith("prefill") or case != "saturated decode")
    assert skipped(sim, res) > (0.2 if case in ("preemption", "saturated decode") else 0.5)
    if case == "preemption":
        assert sum(r.num_preemptions for r in res.records) > 0
    if case == "prefix cache":
        assert res.num_prefix_cache_hit_tokens > 0


def test_pipelines_stopped_early() -> None:
    """The planner's probes on pipelines: instant prefills, stopped at every 20th finished request
    (jumps that ran past the stop count only the steps launched before it)."""
    finished: list[int] = []

    def stop(rec: RequestRecord) -> bool:
        finished.append(rec.req_id)
        return len(finished) % 20 == 0

    placement = Placement(prefill=(InstanceSpec(tp=1, pp=2),), decode=(InstanceSpec(tp=1, pp=2),) * 2)
    res, sim = both(placement, chat(6.0, 200), SimConfig(instant_prefill=True), stop)
    assert res.stopped_early and sum(r.completed for r in res.records) == 20
    assert sim.num_fast_forward_steps > 0


def test_classes_and_priorities() -> None:
    base = chat(3.0, 160, seed=2)
    requests = [replace(r, objective=("latency", "throughput", "default")[r.req_id % 3], priority=r.req_id % 4,
                        slo_class=("a", "b")[r.req_id % 2]) for r in base]
    priority = SchedulerConfig(policy="priority")
    config = SimConfig(scheduler=priority, prefill_scheduler=priority, decode_scheduler=priority,
                       admission=AdmissionConfig("priority"))
    for placement in (Placement.colocated_instances(1), Placement.disaggregated(1, 2)):
        res, sim = both(placement, requests, config)
        assert sim.num_fast_forward_steps > 0


def test_stop_when_and_instant_prefill() -> None:
    """The planner's probes: instant prefills, stopped at the 20th finished request."""
    finished: list[int] = []

    def stop(rec: RequestRecord) -> bool:
        finished.append(rec.req_id)
        return len(finished) % 20 == 0  # the same count in both runs: each runs from an empty list's multiple

    res, sim = both(Placement.disaggregated(1, 2), chat(6.0, 200), SimConfig(instant_prefill=True), stop)
    assert res.stopped_early and sum(r.completed for r in res.records) == 20
    assert sim.num_fast_forward_steps > 0


def test_slo_step_budget_and_prefix_cache() -> None:
    slo_budget = SchedulerConfig(step_budget="slo", tpot_slo_s=0.05, enable_chunked_prefill=True)
    res, sim = both(Placement.colocated_instances(1), chat(3.0, 120), SimConfig(scheduler=slo_budget))
    assert sim.num_fast_forward_steps > 0
    # Shared prompt prefixes: commits register hashes and reused free blocks evict them, in order.
    shared = tuple(range(7, 7 + 96))
    requests = [replace(r, prompt_token_ids=shared[: 32 + r.req_id % 64] + tuple(range(r.prompt_len)),
                        prompt_len=32 + r.req_id % 64 + r.prompt_len) for r in chat(3.0, 120, seed=3)]
    requests = [r for r in requests if r.prompt_len + r.output_len <= 2048]
    res, sim = both(Placement.disaggregated(1, 1), requests, SimConfig(enable_prefix_caching=True, num_blocks=400))
    assert res.num_prefix_cache_hit_tokens > 0 and sim.num_fast_forward_steps > 0


def test_off_is_the_default_path_and_on_is_the_default() -> None:
    assert SimConfig().fast_forward is True
    sim = Simulation(Placement.colocated_instances(1), opt13b(), SimConfig(fast_forward=False))
    sim.run(chat(2.0, 30))
    assert sim.num_fast_forward_steps == 0


class RetryEveryInstant(Simulation):
    """Retries dispatch at the end of every instant something arrived or a step ended, as before the
    simulation skipped retries where nothing they read had changed."""

    @property
    def _admission_stale(self) -> bool:
        return True

    @_admission_stale.setter
    def _admission_stale(self, value: bool) -> None:
        pass


@pytest.mark.parametrize("case", ["flood", "deadlines", "colocated"])
def test_dispatch_retries_skipped_only_where_they_do_nothing(case: str) -> None:
    """Requests held back by backpressure (a flood of one tenant; deadlines past the knee): the
    retries the simulation skips (only decode instances changed since the last one, no deadline
    due) would have dispatched and expired nothing."""
    if case == "flood":
        placement, requests, config = Placement.disaggregated(1, 2), flood_workload(7.0, 300, max_total_len=2048), \
            SimConfig(admission=AdmissionConfig("fair"))
    else:
        requests = [replace(r, timeout_s=1.0 if r.req_id % 3 == 0 else None) for r in chat(60.0, 250, seed=4)]
        placement = Placement.disaggregated(1, 2) if case == "deadlines" else Placement.colocated_instances(2)
        config = SimConfig(admission=AdmissionConfig(max_waiting=2))
    for fast_forward in (True, False):
        cfg = replace(config, fast_forward=fast_forward)
        every, skipping = RetryEveryInstant(placement, opt13b(), cfg).run(requests), Simulation(placement, opt13b(), cfg).run(requests)
        assert records(skipping) == records(every) and skipping.admission == every.admission
        assert skipping.instances == every.instances
        assert any(r.admission_wait_s for r in every.records) and (case == "flood" or any(r.dropped == "expired" for r in every.records))


@pytest.mark.parametrize("case", ["colocated", "1p1d layered prefill", "pipelines", "stopped early"])
def test_a_finished_simulation_leaves_nothing_for_the_cyclic_collector(case: str) -> None:
    """No reference cycle in a simulation (the layer driver is handed its instance, not kept; a lazy-decode
    or lane driver left attached is dropped at the run's end; the admission policy a function of the tenants, not the queue's bound method): it is freed by
    reference counting as it goes out of use. The planner pauses the cyclic collector over its whole
    search; cycles left ~160k objects of its probes (in flight when they stopped early) for one pass at
    its end (~0.35 s of a 5 s plan)."""
    placement = {
        "colocated": Placement.colocated_instances(1),
        "1p1d layered prefill": Placement.disaggregated(1, 1),
        "pipelines": Placement(prefill=(InstanceSpec(tp=1, pp=2),), decode=(InstanceSpec(tp=1, pp=2), InstanceSpec())),
        "stopped early": Placement.disaggregated(2, 1),
    }[case]
    finished: list[int] = []

    def stop(rec: RequestRecord) -> bool:
        finished.append(rec.req_id)
        return len(finished) == 40

    def ours(o: object) -> bool:
        return type(o).__module__.startswith(("simulator", "distserve"))

    gc.collect()
    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        sim = Simulation(placement, opt13b(), SimConfig(num_blocks=2000))
        res = sim.run(chat(4.0, 120), stop if case == "stopped early" else None)
        assert sim.num_fast_forward_steps > 0 and res.stopped_early == (case == "stopped early")
        if case == "1p1d layered prefill":
            assert sim.instances[0].layered is not None
        del sim, res
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage if ours(o)]
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
    assert left == []
