"""Latency models, workload generators and event-driven simulation of our real schedulers."""

from pathlib import Path

# DistServe's published A100-80G coefficients (OPT-13B, OPT-66B), shipped with the package.
DISTSERVE_A100_PROFILE = Path(__file__).resolve().parent / "data" / "distserve-a100-80g-profile.json"
