"""Starting Ray the way this project needs it: loopback only, small explicit resources."""

from __future__ import annotations

import os
from typing import Any

RAY_NUM_CPUS = 8
# Ray records every call of every actor as a task event, for its dashboard and ``ray list tasks``, and
# keeps up to 100,000 of them in the GCS: our actors make many calls per step, so that memory grew for
# the whole of a 20-minute soak (experiments/chaos.py), and each event costs CPU. Our actors record none.
ACTOR_TASK_EVENTS: dict[str, Any] = {"enable_task_events": False}
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray's own metrics (its processes' counters, exported through the dashboard agent for Prometheus): our
# server reports its metrics itself (``/metrics``) and nothing reads Ray's, which cost the raylet memory —
# idle, its heap grew 9.6 -> 14.6 MB in 8 minutes with them and 9.1 -> 11.5 MB without — and every process CPU.
METRICS_ENV = "RAY_enable_metrics_collection"


def keep_ray_on_loopback() -> None:
    """Make Ray use 127.0.0.1 for every address; by default it swaps loopback for the host's IP.

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once at import, so the constant is set as well
    for a Ray imported earlier; the variable itself reaches the processes Ray starts.
    """
    from ray._private import ray_constants

    os.environ.setdefault(LOOPBACK_ENV, "0")
    ray_constants.ENABLE_RAY_CLUSTER = os.environ[LOOPBACK_ENV].lower() in ("1", "true")


def init_ray_local(temp_dir: str | None = None) -> bool:
    """Start a private loopback-only Ray instance unless one is initialised; True if this call started it."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    keep_ray_on_loopback()
    kwargs: dict[str, Any] = {"_temp_dir": temp_dir} if temp_dir else {}
    # Ray's processes (and this one's core worker) read the variable as they start; it is not left in this
    # process's environment for the processes it starts later (e.g. another Ray of a ``serve run``).
    metrics_was = os.environ.get(METRICS_ENV)
    os.environ.setdefault(METRICS_ENV, "0")
    try:
        ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, _node_ip_address="127.0.0.1", **kwargs)
    finally:
        if metrics_was is None:
            os.environ.pop(METRICS_ENV, None)
    return True
