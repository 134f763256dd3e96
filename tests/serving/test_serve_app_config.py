"""The Ray Serve app's config (``serving.app_config``) and the replicas' metrics merge, without Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from distserve.cli.args import build_parser
from distserve.cli.serve import deployment_config_of, serve_placement, serve_slo
from distserve.errors import InvalidConfigError
from distserve.placement import InstanceSpec, Placement
from distserve.serving.app_config import MAX_ONGOING_HEADROOM, SERVE_FIELDS, ServeAppConfig
from distserve.serving.metrics import ServingMetrics


def test_every_field_is_the_serve_flag_of_its_name() -> None:
    flags = vars(build_parser().parse_args(["serve"]))
    assert set(ServeAppConfig.model_fields) - set(SERVE_FIELDS) <= set(flags)
    defaults = ServeAppConfig()
    for name in set(ServeAppConfig.model_fields) - set(SERVE_FIELDS):
        assert getattr(defaults, name) == flags[name], name


def test_the_app_deploys_what_distserve_serve_deploys() -> None:
    argv = ["serve", "--model", "tiny", "--prefill", "2", "--decode-tp", "2", "--kv-cache-gb", "0.25", "--tpot-slo", "50ms",
            "--max-queued-requests", "32", "--admission-policy", "fcfs", "--prefill-chunk", "64", "--threads", "2",
            "--kv-transfer-timeout", "12", "--max-num-seqs", "8", "--max-model-len", "512"]
    args = build_parser().parse_args(argv)
    placement = serve_placement(args).with_threads(2)
    expected = deployment_config_of(args, placement, serve_slo(args, placement), None)
    assert ServeAppConfig.from_cli_args(args).resolve().deployment == expected
    # the same as `serve run ... key=value` strings
    given = {"model": "tiny", "prefill": "2", "decode_tp": "2", "kv_cache_gb": "0.25", "tpot_slo": "50ms", "max_queued_requests": "32",
             "admission_policy": "fcfs", "prefill_chunk": "64", "threads": "2", "kv_transfer_timeout": "12", "max_num_seqs": "8",
             "max_model_len": "512"}
    assert ServeAppConfig.from_args(given).resolve().deployment == expected


def test_a_placement_by_file_or_inline(tmp_path: Path) -> None:
    placement = Placement(prefill=(InstanceSpec(tp=2),), decode=(InstanceSpec(pp=2, node=0), InstanceSpec()))
    path = tmp_path / "plan.json"
    placement.to_json(path)
    for value in (str(path), placement.to_dict(), json.dumps(placement.to_dict())):
        assert ServeAppConfig.from_args({"model": "tiny", "placement": value}).resolve().deployment.placement == placement
    colocated = ServeAppConfig.from_args({"model": "tiny", "colocated": 3}).resolve().deployment.placement
    assert colocated == Placement.colocated_instances(3)


def test_the_http_options_reach_the_replicas(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    app = ServeAppConfig.from_args({"model": "tiny", "chat_template": str(template), "allowed_origins": '["https://a.example"]',
                                    "tool_call_parser": "hermes", "enable_auto_tool_choice": "true"}).resolve()
    assert app.chat_template == template.read_text() and app.cors is not None and app.cors.allowed_origins == ("https://a.example",)
    assert (app.tool_call_parser, app.enable_auto_tool_choice, app.served_model_name) == ("hermes", True, "tiny")


def test_max_ongoing_requests_follows_the_queue_bound() -> None:
    app = ServeAppConfig.from_args({"model": "tiny", "max_queued_requests": "40", "num_replicas": "3"}).resolve()
    assert (app.max_ongoing_requests, app.num_replicas) == (40 + MAX_ONGOING_HEADROOM, 3)
    assert ServeAppConfig.from_args({"model": "tiny", "max_ongoing_requests": 7}).resolve().max_ongoing_requests == 7


def test_build_app_sets_the_deployment_options() -> None:
    from distserve.serving.app import build_app

    deployment = build_app({"model": "tiny", "num_replicas": "2", "max_queued_requests": "100", "replica_cpus": "0.05"})._bound_deployment
    assert (deployment.num_replicas, deployment.max_ongoing_requests) == (2, 100 + MAX_ONGOING_HEADROOM)
    assert deployment.ray_actor_options["num_cpus"] == 0.05


def test_replicas_of_one_config_share_a_controller_name() -> None:
    def name(args: dict[str, Any], app: str = "distserve") -> str:
        return ServeAppConfig.from_args({"model": "tiny", **args}).resolve().controller_name(app)

    assert name({"num_replicas": 1}) == name({"num_replicas": 4})  # HTTP side only: the same deployment
    assert name({}) != name({"prefill": 2}) and name({}) != name({}, "other-app")


@pytest.mark.parametrize("args,field,needle", [
    ({"kv_cache_gb": "lots"}, "kv_cache_gb", "valid number"),
    ({"modle": "tiny"}, "modle", "unknown field 'modle'"),
    ({"router": "random"}, "router", "least-loaded, prefix-affinity"),
    ({"ttft_slo": "200"}, "ttft_slo", "200ms"),
    ({"num_replicas": 0}, "num_replicas", "greater than 0"),
    ({"dtype": "int4"}, "dtype", "float32"),
    ({"metrics_prefix": "sglang"}, "metrics_prefix", "distserve, vllm"),
    ({"enable_auto_tool_choice": True}, "enable_auto_tool_choice", "tool_call_parser"),
    ({"placement": "/no/such/plan.json"}, "placement", "cannot read placement file"),
    ({"placement": "{not json"}, "placement", "not valid JSON"),
    ({"placement": {"prefill": [{"tp": 0}], "decode": [{}]}}, "placement", "prefill[0].tp"),
    ({"placement": {"prefill": [{}], "decode": [{}]}, "prefill": 2}, "placement", "cannot be combined with colocated/prefill/decode"),
    ({"api_keys": "/no/such/keys.yaml"}, "api_keys", "cannot read the key file"),
    ({"allowed_methods": "GET"}, "allowed_origins", "allowed_methods/allowed_headers/allow_credentials need it"),
    ({"max_model_len": "4k"}, "max_model_len", "valid integer"),
])
def test_a_bad_value_is_refused_naming_its_field(args: dict[str, Any], field: str, needle: str) -> None:
    with pytest.raises(InvalidConfigError) as err:
        ServeAppConfig.from_args({"model": "tiny", **args}).resolve()
    assert f"app config {field}:" in str(err.value) or f"app config: {field}" in str(err.value) or f"'{field}'" in str(err.value)
    assert needle in str(err.value) and err.value.param == field


class Board:
    """An in-memory ``MetricsPeers``: what a shared controller keeps for its holders."""

    def __init__(self) -> None:
        self.snapshots: dict[int, tuple[Any, bool]] = {}

    def peers_of(self, me: int) -> Any:
        board = self

        class Peers:
            async def publish(self, snapshot: Any) -> None:
                board.snapshots[me] = (snapshot, board.snapshots.get(me, (None, True))[1])

            async def published(self) -> list[tuple[Any, bool]]:
                return [entry for holder, entry in board.snapshots.items() if holder != me]

        return Peers()


def samples(metrics: ServingMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_replica_shows_every_replicas_requests() -> None:
    import asyncio

    replicas = [ServingMetrics(model_name="tiny") for _ in range(2)]
    board = Board()
    for i, (prompt_tokens, ttft) in enumerate([(3, 0.003), (4, 0.3)]):
        replicas[i].prompt_tokens_total.inc(prompt_tokens)
        replicas[i].ttft.observe(ttft)
        replicas[i].request_success.labels(finished_reason="length").inc()
    replicas[1].tenant_running.labels(tenant="anonymous").inc()  # a stream in flight on replica 1
    asyncio.run(replicas[1].exchange(board.peers_of(1)))
    asyncio.run(replicas[0].exchange(board.peers_of(0)))
    model = (("model_name", "tiny"),)
    seen = samples(replicas[0])
    assert seen[("distserve:prompt_tokens_total", model)] == 7
    assert seen[("distserve:request_success_total", (("finished_reason", "length"), ("model_name", "tiny")))] == 2
    assert seen[("distserve:time_to_first_token_seconds_count", model)] == 2
    assert seen[("distserve:time_to_first_token_seconds_sum", model)] == pytest.approx(0.303)
    assert seen[("distserve:time_to_first_token_seconds_bucket", (("le", "0.005"), ("model_name", "tiny")))] == 1
    assert seen[("distserve:tenant_requests_running", (("model_name", "tiny"), ("tenant", "anonymous")))] == 1
    names = [f.name for f in replicas[0].families()]
    assert len(names) == len(set(names))  # one family each, the engine's once
    board.snapshots[1] = (board.snapshots[1][0], False)  # replica 1 is gone: its gauges leave, its counts stay
    asyncio.run(replicas[0].exchange(board.peers_of(0)))
    seen = samples(replicas[0])
    assert seen[("distserve:tenant_requests_running", (("model_name", "tiny"), ("tenant", "anonymous")))] == 0
    assert seen[("distserve:prompt_tokens_total", model)] == 7
