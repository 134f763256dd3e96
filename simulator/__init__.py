"""Latency models, workload generators and event-driven simulation of our real schedulers.

Populated by the simulator work (issue 5); the package exists so the project installs as designed.
"""
