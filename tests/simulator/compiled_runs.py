"""Run a few simulations and print, as JSON, how this process runs the simulator (``distserve.compiled``)
and a digest of every run's records: ``test_compiled.py`` runs this compiled and interpreted."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from distserve import compiled
from distserve.cluster.admission import AdmissionConfig
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


def main() -> None:
    digests = {}
    for name, (placement, config) in CASES.items():
        for fast in (True, False):
            res = Simulation(placement, opt13b(), replace(config, fast_forward=fast)).run(chat(12.0, 300, seed=5))
            h = hashlib.sha256(repr((records(res), res.instances, res.duration_s, res.num_migrations)).encode())
            digests[f"{name}{'' if fast else ', step by step'}"] = h.hexdigest()
    print(json.dumps({"mode": compiled.mode(), "digests": digests}))


if __name__ == "__main__":
    main()
