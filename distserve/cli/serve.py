"""``distserve serve``: one ``DeploymentConfig`` from the flags, served over HTTP by the Ray or the in-process runtime."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from distserve.cli.args import admission_config_of, check_placement_args, placement_from_args

if TYPE_CHECKING:
    from distserve.dataflow.limits import SessionLimits
    from distserve.runtime.config import DeploymentConfig
    from distserve.serving.api_keys import ApiKeys
    from distserve.slo import SLO
    from distserve.config import SchedulerConfig
    from distserve.placement import Placement
    from distserve.serving.cors import CorsOptions
    from distserve.serving.limits import HttpLimits


def _check_serve_args(args: argparse.Namespace) -> None:
    from distserve.errors import InvalidConfigError
    from distserve.serving.limits import HttpLimits

    parallel = any(getattr(args, f) != 1 for f in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp"))
    if args.runtime == "local" and (parallel or args.placement is not None):
        raise InvalidConfigError(
            "--runtime local runs tp = pp = 1 instances only; TP/PP degrees and --placement need --runtime ray"
        )
    check_placement_args(args)
    if args.kv_transfer_timeout is not None and args.runtime == "local":
        raise InvalidConfigError("--kv-transfer-timeout applies to the Ray runtime; --runtime local copies KV in-process")
    for flag, given in (("--prefill-chunk", args.prefill_chunk is not None), ("--no-layer-preemption", args.no_layer_preemption)):
        if given and args.colocated is not None:
            raise InvalidConfigError(f"{flag} applies to prefill instances (a disaggregated placement)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InvalidConfigError("--enable-auto-tool-choice needs --tool-call-parser (e.g. --tool-call-parser hermes)")
    if args.structured_output_backend == "xgrammar":
        from distserve.engine.grammar_backends import import_xgrammar

        try:
            import_xgrammar()
        except InvalidConfigError as exc:
            raise InvalidConfigError(f"--structured-output-backend: {exc}") from exc
    if args.ray_serve and args.shutdown_grace is not None:
        raise InvalidConfigError("--shutdown-grace applies to plain `distserve serve`; Ray Serve drains its replicas itself")
    if args.ray_serve and args.request_log is not None:
        raise InvalidConfigError("--request-log applies to plain `distserve serve`, not --ray-serve (each replica would write its own)")
    if args.ray_serve and args.runtime == "local":
        raise InvalidConfigError("--ray-serve deploys the placement on the Ray runtime; --runtime local does not apply")
    if args.ray_serve and http_limits_of(args) != HttpLimits():  # Ray Serve's proxy owns the connections
        raise InvalidConfigError("--max-request-body-bytes/--h11-*/--timeout-keep-alive/--request-read-timeout: only for plain "
                                 "`distserve serve`, not --ray-serve")
    cors_given = {"--allowed-methods": args.allowed_methods != ("*",), "--allowed-headers": args.allowed_headers != ("*",),
                  "--allow-credentials": args.allow_credentials}
    if args.allowed_origins is None and any(cors_given.values()):
        flags = "/".join(f for f, given in cors_given.items() if given)
        raise InvalidConfigError(f"{flags}: only with --allowed-origins (without it the server sends no CORS headers)")


def serve_slo(args: argparse.Namespace, placement: "Placement | None") -> "SLO | None":
    """The deployment's SLO: --ttft-slo/--tpot-slo over the placement's ``slo``; None if neither says."""
    from distserve.slo import SLO

    base = placement.slo if placement is not None else None
    ttft = args.ttft_slo if args.ttft_slo is not None else (base.ttft_s if base else None)
    tpot = args.tpot_slo if args.tpot_slo is not None else (base.tpot_s if base else None)
    if ttft is None and tpot is None:
        return None
    return SLO(ttft if ttft is not None else float("inf"), tpot if tpot is not None else float("inf"))


def session_limits(args: argparse.Namespace) -> "SessionLimits":
    """The semantic-variable sessions' limits from --session-ttl/--max-sessions/--max-variables/..."""
    from distserve.dataflow.limits import SessionLimits

    return SessionLimits(
        ttl_s=args.session_ttl, max_sessions=args.max_sessions, max_variables=args.max_variables,
        max_pending_calls=args.max_pending_calls, max_value_chars=args.max_value_chars,
        require_auth_on_calls=not args.parrot_unauthenticated_calls,
    )


def api_keys_of(args: argparse.Namespace) -> "ApiKeys | None":
    """The tenants and keys of --api-keys (None without it); a bad file is an error naming the flag and the line."""
    if args.api_keys is None:
        return None
    from distserve.errors import DistServeError
    from distserve.serving.api_keys import load_api_keys

    try:
        return load_api_keys(args.api_keys)
    except DistServeError as exc:
        raise type(exc)(f"--api-keys {exc}") from None


def prefill_scheduler_config(args: argparse.Namespace, placement: "Placement | None" = None) -> "SchedulerConfig":
    """Prefill instances' scheduler: the placement's caps (default: ``serve_placement(args)``); whole prompts,
    or chunks of --prefill-chunk tokens per step; plans that yield between layers unless --no-layer-preemption."""
    from dataclasses import replace

    from distserve.config import SchedulerConfig

    placement = placement if placement is not None else serve_placement(args)
    base = placement.scheduler_config(SchedulerConfig(layer_preemption=not args.no_layer_preemption, **structured_output_backend(args)))
    if args.prefill_chunk is None:
        return base
    return replace(base, enable_chunked_prefill=True, max_num_batched_tokens=args.prefill_chunk)


def serve_placement(args: argparse.Namespace) -> "Placement":
    """The placement to deploy: --placement or the shorthand flags, with --max-model-len/--max-num-seqs/
    --max-num-batched-tokens over the JSON's deployment-wide caps (an instance's own caps still apply to it)."""
    return placement_from_args(args).with_caps(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                               max_num_batched_tokens=args.max_num_batched_tokens)


def chat_template_of(args: argparse.Namespace) -> "str | None":
    """--chat-template's template (None without it); a bad file or template is an error naming the flag."""
    if args.chat_template is None:
        return None
    from distserve.engine.tokenizer import load_chat_template
    from distserve.errors import DistServeError

    try:
        return load_chat_template(args.chat_template)
    except DistServeError as exc:
        raise type(exc)(f"--chat-template: {exc}", "chat_template") from None


def shutdown_grace(args: argparse.Namespace) -> dict[str, float]:
    """``run_server``'s grace period from --shutdown-grace (its default without the flag)."""
    return {} if args.shutdown_grace is None else {"shutdown_grace_s": args.shutdown_grace}


def cors_of(args: argparse.Namespace) -> "CorsOptions | None":
    from distserve.serving.cors import CorsOptions

    if args.allowed_origins is None:
        return None
    return CorsOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def http_limits_of(args: argparse.Namespace) -> "HttpLimits":
    """``serving.limits.HttpLimits`` from --max-request-body-bytes, --h11-max-*, --timeout-keep-alive, --request-read-timeout."""
    from distserve.serving.limits import HttpLimits

    return HttpLimits(max_request_body_bytes=args.max_request_body_bytes, max_header_bytes=args.h11_max_incomplete_event_size,
                      max_header_count=args.h11_max_header_count, timeout_keep_alive_s=args.timeout_keep_alive,
                      request_read_timeout_s=args.request_read_timeout)


def structured_output_backend(args: argparse.Namespace) -> dict[str, str]:
    """``SchedulerConfig``'s grammar library from --structured-output-backend (its default without the flag)."""
    return {} if args.structured_output_backend is None else {"structured_output_backend": args.structured_output_backend}


def deployment_config_of(
    args: argparse.Namespace, placement: "Placement", slo: "SLO | None", api_keys: "ApiKeys | None",
) -> "DeploymentConfig":
    """What ``distserve serve`` (and the Ray Serve app, whose fields are these flags) deploys: ``placement``
    with the model, cache, scheduler and admission flags; ``slo`` the deployment's (``serve_slo``)."""
    from distserve.config import CacheConfig, SchedulerConfig, slo_scheduler_config
    from distserve.runtime.config import DeploymentConfig

    return DeploymentConfig(
        args.model, placement, dtype=args.dtype,
        cache_config=CacheConfig(block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_gb, decode_attention=args.decode_attention),
        # Prefill steps hold no decodes whose TPOT a step budget would protect.
        scheduler_config=slo_scheduler_config(slo.tpot_s if slo else None,
                                              placement.scheduler_config(SchedulerConfig(
                                                  layer_preemption=not args.no_layer_preemption, **structured_output_backend(args)))),
        prefill_scheduler_config=prefill_scheduler_config(args, placement),
        max_queued_requests=args.max_queued_requests, num_threads_per_worker=args.threads, router=args.router,
        admission=admission_config_of(args, slo.tpot_s if slo else None, tuple(api_keys.tenants.values()) if api_keys else ()),
        **({} if args.kv_transfer_timeout is None else {"kv_transfer_timeout_s": args.kv_transfer_timeout}),
    )


def ray_layout(placement: "Placement") -> str:
    """``1x prefill tp1pp1 + 1x decode tp1pp1``: the placement's instances, for the ready message."""
    return " + ".join(
        f"{len(specs)}x {kind} tp{specs[0].tp}pp{specs[0].pp}"
        for kind, specs in (("prefill", placement.prefill), ("decode", placement.decode), ("colocated", placement.colocated))
        if specs
    )


def _print_ready(url: str, model: str, layout: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32})
    print(f"distserve: serving {model!r} ({layout}) at {url}/v1  (metrics: {url}/metrics)")
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    _check_serve_args(args)
    api_keys = api_keys_of(args)  # before any model loads: a bad key file fails at once
    chat_template = chat_template_of(args)
    served = args.served_model_name or args.model
    if args.colocated is not None:
        layout = f"{args.colocated} colocated engine{'s' if args.colocated > 1 else ''}"
    else:
        layout = f"{args.prefill or 1}P{args.decode or 1}D disaggregated"
    if args.ray_serve:
        from distserve.serving.app import run_ray_serve
        from distserve.serving.app_config import ServeAppConfig

        placement_from_args(args)  # a bad --placement is refused naming the flag, before Ray starts
        app = ServeAppConfig.from_cli_args(args).resolve()
        ready = f"{ray_layout(app.deployment.placement)}, Ray Serve"
        run_ray_serve(app, args.host, args.port, on_ready=lambda url: _print_ready(url, served, ready))
        return 0
    from distserve.serving.server import open_listen_socket, run_server
    from distserve.serving.request_log import RequestLog

    request_log = RequestLog(args.request_log) if args.request_log is not None else None  # before the model loads: a bad path fails at once

    parallel = any(getattr(args, f) != 1 for f in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp"))
    on_ray = args.runtime == "ray" or (args.runtime == "auto" and (parallel or args.placement is not None))
    placement = serve_placement(args)
    if args.threads is not None and on_ray:
        placement = placement.with_threads(args.threads)
    slo = serve_slo(args, placement if on_ray else None)
    sock = open_listen_socket(args.host, args.port)
    config = deployment_config_of(args, placement, slo, api_keys)
    if on_ray:
        from distserve.runtime.ray_client import ControllerClient

        return run_server(
            lambda: ControllerClient.create(config), served, sock,
            on_ready=lambda url: _print_ready(url, served, f"{ray_layout(placement)}, Ray runtime"), log_level=args.log_level, slo=slo,
            session_limits=session_limits(args), api_keys=api_keys, request_log=request_log,
            tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
            metrics_prefix=args.metrics_prefix,
            chat_template=chat_template, cors=cors_of(args), http_limits=http_limits_of(args), **shutdown_grace(args),
        )

    from distserve.runtime.local_client import build_local_engine_client

    client = build_local_engine_client(config)
    return run_server(client, served, sock, on_ready=lambda url: _print_ready(url, served, layout), log_level=args.log_level, slo=slo,
                      session_limits=session_limits(args), api_keys=api_keys, request_log=request_log,
                      tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                      metrics_prefix=args.metrics_prefix, chat_template=chat_template, cors=cors_of(args),
                      http_limits=http_limits_of(args), **shutdown_grace(args))
