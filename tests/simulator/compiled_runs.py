"""Run a few simulations and print, as JSON, how this process runs the simulator (``distserve.compiled``),
a digest of every run's records, and whether the objects the Ray runtime sends between processes come back
equal from pickle: ``test_compiled.py`` runs this compiled and interpreted."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
from dataclasses import replace

import ray.cloudpickle

import simulator  # noqa: F401 - first of ours: it loads the modules it drives compiled, if built (distserve.compiled)
from distserve import compiled
from distserve.cluster.admission import AdmissionConfig
from distserve.cluster.classes import RequestClass
from distserve.cluster.tenants import TenantSpec
from distserve.config import SamplingParams
from distserve.decode.scheduler import Reservation
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import SampledToken, ScheduledChunk, StepPlan
from distserve.placement import InstanceSpec, Placement
from simulator.simulation import SimConfig, Simulation
from test_sim_fast_forward import chat, opt13b, records

CASES = {
    "colocated": (Placement.colocated_instances(2), SimConfig()),
    "1p1d layered prefill, tpot backpressure": (
        Placement.disaggregated(1, 1), SimConfig(admission=AdmissionConfig("fcfs", tpot_slo_s=0.04, max_queue_delay_s=5.0))),
    "pipelines": (Placement(prefill=(InstanceSpec(tp=1, pp=2),), decode=(InstanceSpec(tp=1, pp=2), InstanceSpec())), SimConfig()),
    "4p2d": (Placement.disaggregated(4, 2), SimConfig()),
}


def sent_between_processes() -> list[object]:
    """Objects of the compiled modules that the Ray runtime pickles (requests, plans, configs)."""
    seq = Sequence("r1", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=1.5,
                   request_class=RequestClass("latency", "g", "acme", "interactive"))
    seq.token_ids.append(7)
    seq.forks = [Sequence("r1-1", [1, 2, 3], SamplingParams(max_tokens=4))]
    plan = StepPlan([ScheduledChunk("r1", [1, 2, 3], 0, [9], True, SamplingParams(max_tokens=4), 0)], [(1, 2)], [], ["r0"])
    return [seq, plan, SampledToken("r1", 7, -0.5), Reservation("r1", [4, 5], 1, 2),
            AdmissionConfig("fair", tenants=(TenantSpec("acme", weight=2.0, tier="interactive"),), tpot_slo_s=0.1)]


def round_trips() -> dict[str, bool]:
    out = {}
    for obj in sent_between_processes():
        name = type(obj).__name__
        out[name] = all(repr(back) == repr(obj) for back in (  # every field (a Sequence compares by identity)
            pickle.loads(pickle.dumps(obj)), ray.cloudpickle.loads(ray.cloudpickle.dumps(obj)), copy.deepcopy(obj)))
    return out


def main() -> None:
    digests = {}
    for name, (placement, config) in CASES.items():
        for fast in (True, False):
            res = Simulation(placement, opt13b(), replace(config, fast_forward=fast)).run(chat(12.0, 300, seed=5))
            h = hashlib.sha256(repr((records(res), res.instances, res.duration_s, res.num_migrations)).encode())
            digests[f"{name}{'' if fast else ', step by step'}"] = h.hexdigest()
    print(json.dumps({"mode": compiled.mode(), "digests": digests, "round_trips": round_trips()}))


if __name__ == "__main__":
    main()
