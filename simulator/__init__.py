"""Latency models, workload generators and event-driven simulation of our real schedulers."""

from pathlib import Path

from distserve.compiled import activate

# A process that imports the simulator before any of the modules it drives (the planner's and the simulator's
# commands, the sweeps) runs them as mypyc compiled them, if they were built from these sources.
activate()

# DistServe's published A100-80G coefficients (OPT-13B, OPT-66B), shipped with the package.
DISTSERVE_A100_PROFILE = Path(__file__).resolve().parent / "data" / "distserve-a100-80g-profile.json"
