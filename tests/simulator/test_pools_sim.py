"""Class pools in the simulator: each decode instance runs with its spec's batch cap, requests decode
on their objective's pool, and a split (latency pool with a small cap, throughput pool with a large
one) measurably serves the latency class better than one shared pool of the same instances."""

from __future__ import annotations

from distserve.placement import InstanceSpec, Placement
from distserve.slo import SLO
from simulator.hardware import get_hardware
from simulator.latency import get_latency_model
from simulator.simulation import SimConfig, Simulation, with_rate
from simulator.workload import mixed_workload

LATENCY_SLO, THROUGHPUT_SLO = SLO(1.0, 0.04), SLO(10.0, 0.3)
P = InstanceSpec()
SHARED = Placement(prefill=(P, P, P), decode=(P, P))
SPLIT = Placement(prefill=(P, P, P), decode=(InstanceSpec(pool="latency", max_num_seqs=16), InstanceSpec(pool="throughput", max_num_seqs=128)))


def _run(placement: Placement, rate: float) -> tuple[Simulation, dict[str, str], dict[str, float]]:
    latency = get_latency_model("facebook/opt-13b", hardware=get_hardware("a100-80g"))
    unit = mixed_workload("mix:latency=chatbot:0.3,throughput=fixed:256:512", 1.0, 300, seed=0, max_total_len=2048)
    sim = Simulation(placement, latency, SimConfig())
    decoded_on: dict[str, str] = {}
    sim.on_migration = lambda rid, src, dst: decoded_on.__setitem__(rid, dst)
    res = sim.run(with_rate(unit, rate))
    att = {}
    for objective, slo in (("latency", LATENCY_SLO), ("throughput", THROUGHPUT_SLO)):
        recs = [r for r in res.records if r.objective == objective]
        att[objective] = sum(r.meets(slo) for r in recs) / len(recs)
    objective_of = {str(r.req_id): r.objective for r in res.records}
    return sim, {rid: f"{objective_of[rid]}->{dst}" for rid, dst in decoded_on.items()}, att


def test_each_pool_decodes_its_class_with_its_own_batch_cap() -> None:
    sim, routes, _ = _run(SPLIT, 12.0)
    assert [d.core.scheduler.max_running for d in sim.decodes] == [16, 128]
    assert [d.route.pool for d in sim.decodes] == ["latency", "throughput"]
    assert set(routes.values()) == {"latency->decode-0", "throughput->decode-1"}


def test_a_split_serves_the_latency_class_better_than_a_shared_pool() -> None:
    _, _, shared = _run(SHARED, 12.0)
    _, _, split = _run(SPLIT, 12.0)
    # Measured: latency 0.54 shared vs 0.89 split; throughput 1.0 in both.
    assert split["latency"] >= shared["latency"] + 0.2
    assert split["throughput"] >= 0.99 and shared["throughput"] >= 0.99
