"""``DeploymentConfig``: validated where it is built, before anything is deployed."""

from __future__ import annotations

import pytest

from distserve.config import CacheConfig
from distserve.errors import InvalidConfigError
from distserve.placement import Placement
from distserve.runtime.config import DEFAULT_MAX_QUEUED_REQUESTS, DeploymentConfig
from distserve.runtime.local_client import build_local_engine_client
from simulator.simulation import SimConfig


def test_defaults_deploy_one_prefill_and_one_decode_instance() -> None:
    config = DeploymentConfig("tiny")
    assert config.placement == Placement.disaggregated()
    assert config.router == "prefix-affinity" and config.max_queued_requests == DEFAULT_MAX_QUEUED_REQUESTS


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_transfer_timeout_s", 0.0), ("kv_transfer_timeout_s", float("nan")), ("max_instance_restarts", -1),
        ("max_instance_restarts", 1.5), ("max_queued_requests", 0), ("num_threads_per_worker", 0), ("router", "random"),
    ],
)
def test_a_bad_field_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(InvalidConfigError, match=field if field != "router" else "unknown router"):
        DeploymentConfig("tiny", **{field: value})  # type: ignore[arg-type]


def test_the_simulator_refuses_an_unknown_router_too() -> None:
    with pytest.raises(InvalidConfigError, match="unknown router"):
        SimConfig(router="random")


def test_the_in_process_runtime_refuses_what_it_cannot_run() -> None:
    tp2 = Placement.disaggregated(prefill_tp=2)
    with pytest.raises(InvalidConfigError, match="TP/PP"):
        build_local_engine_client(DeploymentConfig("tiny", tp2, cache_config=CacheConfig(num_blocks=64)))
