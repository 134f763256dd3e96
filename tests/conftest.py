"""Shared fixtures: one 2-node Ray cluster on loopback for the whole session (started on first use)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """Ray on this machine as two nodes (``distserve_node_0`` / ``distserve_node_1`` resources)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Keep every Ray address on loopback: otherwise Ray swaps 127.0.0.1 for the host's IP.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    from distserve.runtime.ray_env import keep_ray_on_loopback

    keep_ray_on_loopback()  # also when ray was imported before this fixture ran

    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length limit
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 8, "resources": {"distserve_node_0": 100}, "include_dashboard": False,
            "node_ip_address": "127.0.0.1", "temp_dir": temp_dir,
        },
    )
    cluster.add_node(num_cpus=8, resources={"distserve_node_1": 100}, node_ip_address="127.0.0.1", temp_dir=temp_dir)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
