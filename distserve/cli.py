"""Command line: argument handling only; every subcommand calls into the packages."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from distserve.errors import DistServeError

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from distserve.slo import SLO
    from distserve.placement import Placement
    from distserve.runtime.client import EngineClient


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="tiny | smollm2-135m | HF folder | .gguf file")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA or CPUs with AMX/AVX512-BF16, else float32",
    )
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="memory for the paged KV cache")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--colocated", type=_positive_int, default=None, metavar="N", help="N colocated engines instead of xPyD")
    p.add_argument("--prefill", type=_positive_int, default=None, metavar="N", help="prefill instances (default 1)")
    p.add_argument("--decode", type=_positive_int, default=None, metavar="M", help="decode instances (default 1)")
    for phase in ("prefill", "decode"):
        for kind, what in (("tp", "tensor"), ("pp", "pipeline")):
            p.add_argument(f"--{phase}-{kind}", type=_positive_int, default=1, help=f"{what}-parallel degree of {phase}")
    p.add_argument("--placement", default=None, metavar="FILE", help="a Placement JSON (from `distserve plan`)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a known HF id (facebook/opt-13b, ...), alias, or config.json path")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="latency profile JSON (`distserve profile`, or DistServe's coefficients); default: roofline model")
    p.add_argument("--hardware", default=None, help="a100-80g | h100-sxm | h200 | l40s | cpu (default: the profile's, else a100-80g)")
    _add_placement_args(p)
    p.add_argument("--workload", default="chatbot", help="chatbot | code | summarization | fixed:P:O | trace.jsonl")
    p.add_argument("--rate", type=_positive_float, default=None, help="arrival rate, requests/s (a trace is rescaled to it)")
    p.add_argument("--num-requests", type=_positive_int, default=1000, help="requests of a synthetic workload")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma", "fixed"], help="arrival process")
    p.add_argument("--cv", type=_positive_float, default=1.0, help="coefficient of variation of gamma inter-arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft", type=_positive_float, required=True, help="TTFT SLO, seconds")
    p.add_argument("--tpot", type=_positive_float, required=True, help="TPOT SLO, seconds")
    p.add_argument("--attainment", type=_fraction, default=0.9, help="fraction of requests that must meet the SLO")
    p.add_argument("--attainment-mode", default="joint", choices=["joint", "separate"],
                   help="joint: a request must meet both SLOs; separate: each SLO on its own fraction (DistServe's 90%%/90%%)")
    p.add_argument("--goodput", action="store_true", help="also search the highest rate meeting the SLO (bisection)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=None, help="sequences per batch (default: as serve)")
    p.add_argument("--max-batched-tokens", type=_positive_int, default=None, help="tokens per step (default: as serve)")
    p.add_argument("--num-blocks", type=_positive_int, default=None, help="KV blocks per instance (default: what fits)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0, help="extra fixed cost per step of the runtime")
    p.add_argument("--step-budget", default="static", choices=["static", "slo"],
                   help="colocated/decode step budget: static (whole prompts) or slo (chunk prompts to keep steps within --tpot, "
                   "as serve --tpot-slo does)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a known HF id (facebook/opt-13b, meta-llama/Llama-3.1-8B, ...) or a config.json path")
    p.add_argument("--gpu", default="a100-80g", help="a100-80g | h100-sxm | h200 | l40s | cpu (this machine, measured)")
    p.add_argument("--nodes", type=_positive_int, default=1)
    p.add_argument("--gpus-per-node", type=_positive_int, default=8)
    p.add_argument("--intra-node-bandwidth", type=_positive_float, default=None, metavar="GB/s", help="override the GPU's NVLink/PCIe bandwidth")
    p.add_argument("--inter-node-bandwidth", type=_positive_float, default=None, metavar="GB/s", help="override the network bandwidth per GPU")
    p.add_argument("--workload", default="chatbot", help="chatbot | code | summarization | fixed:P:O | trace.jsonl")
    p.add_argument("--num-requests", type=_positive_int, default=300, help="requests simulated per probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft", type=_positive_float, required=True, help="TTFT SLO, seconds")
    p.add_argument("--tpot", type=_positive_float, required=True, help="TPOT SLO, seconds")
    p.add_argument("--attainment", type=_fraction, default=0.9)
    p.add_argument("--attainment-mode", default="joint", choices=["joint", "separate"])
    p.add_argument("--rate", type=_positive_float, default=None, help="target traffic (req/s): size the plan for it")
    p.add_argument("--gpus", type=_positive_int, default=None, help="GPU budget (default: the whole cluster)")
    p.add_argument("--profile", default=None, metavar="FILE", help="latency profile JSON (default: roofline model of --gpu)")
    p.add_argument("--affinity", default="auto", choices=["high", "low", "auto"],
                   help="high: KV may cross nodes; low: prefill and decode of a stage share a node; auto: both")
    p.add_argument("--max-num-seqs", type=_positive_int, default=None, help="sequences per batch (default: as serve)")
    p.add_argument("--max-batched-tokens", type=_positive_int, default=None, help="tokens per step (default: as serve)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0, help="extra fixed cost per step of the runtime (see validate_simulator)")
    p.add_argument("--workers", type=_positive_int, default=1, help="processes simulating candidates in parallel")
    p.add_argument("--out", default=None, metavar="FILE", help="write the best Placement JSON here")
    p.add_argument("--plot", default=None, metavar="PNG", help="attainment vs rate of the best disaggregated and colocated plans")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    p.add_argument("--max-queued-requests", type=_positive_int, default=256, help="requests in flight before 429")
    _add_placement_args(p)
    p.add_argument(
        "--runtime",
        default="auto",
        choices=["auto", "ray", "local"],
        help="ray: every instance in its own Ray actor(s), KV over torch.distributed; local: all instances in "
        "this process; auto: ray when a TP/PP degree > 1 or --placement is given, else local",
    )
    p.add_argument("--kv-transfer-timeout", type=_positive_float, default=None, metavar="S",
                   help="seconds before a KV migration is failed and the request re-prefilled (Ray runtime; default 30)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="torch threads per engine (local runtime; default: all cores) or per Ray worker "
                   "(default: the placement's per-instance threads, else 1)")
    p.add_argument("--ttft-slo", type=_positive_float, default=None, metavar="S",
                   help="TTFT SLO in seconds: /metrics counts requests meeting the SLO (default: the placement's)")
    p.add_argument("--tpot-slo", type=_positive_float, default=None, metavar="S",
                   help="TPOT SLO in seconds: colocated and decode steps chunk prompts to stay within it "
                   "(the 'slo' step budget; default: the placement's, else whole prompts per step)")
    p.add_argument("--ray-serve", action="store_true", help="run as a Ray Serve application (default: plain uvicorn)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distserve", description="distserve: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt with the colocated engine")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, ids and timings")
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_model_args(srv)
    _add_serve_args(srv)
    srv.set_defaults(func=cmd_serve)
    sim = sub.add_parser(
        "simulate",
        help="predict TTFT/TPOT/attainment (and goodput) of a placement with the simulator",
        description="Runs our real prefill/decode/colocated schedulers on a simulated clock, with step times from a "
        "latency model (a profile JSON, or the roofline model of --hardware).",
    )
    _add_simulate_args(sim)
    sim.set_defaults(func=cmd_simulate)
    pl = sub.add_parser(
        "plan",
        help="search the placement with the highest goodput per GPU and write it as a Placement JSON",
        description="Enumerates per-phase tensor/pipeline parallelism that fits, finds each configuration's goodput "
        "by simulation + bisection (DistServe's high/low node-affinity algorithms and the colocated baseline), and "
        "writes the best placement for `distserve serve --placement`.",
    )
    _add_plan_args(pl)
    pl.set_defaults(func=cmd_plan)
    prof = sub.add_parser(
        "profile",
        help="time the real engine's prefill/decode steps on this machine and fit a latency model",
        description="Times ModelRunner.execute on real scheduler plans over a grid of batch sizes and lengths, "
        "fits the simulator's latency model per tp degree and writes it as a profile JSON. "
        "Pipeline parallelism is not profiled: the simulator models pp from the tp profile.",
    )
    prof.add_argument("--model", default="smollm2-135m", help="tiny | smollm2-135m | HF folder | .gguf file")
    prof.add_argument("--tp", type=_positive_int, action="append", default=None, metavar="N",
                      help="tensor-parallel degree to profile, repeatable (default 1); tp > 1 spawns N gloo processes")
    prof.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                      help="auto: bfloat16 on CPUs with AMX/AVX512-BF16, else float32 (what serving resolves)")
    prof.add_argument("--threads", type=_positive_int, default=1,
                      help="torch threads per rank (default 1: the Ray runtime runs each worker with one thread)")
    prof.add_argument("--quick", action="store_true", help="a tiny grid (seconds for tiny, minutes for smollm2-135m)")
    prof.add_argument("--repeats", type=_positive_int, default=3, help="timed steps per point (median), after a warm-up")
    prof.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    prof.add_argument("--quiet", action="store_true",
                      help="tp 1: time a step again (after waiting, at most --max-quiet-wait-s in all) when other "
                           "processes used the CPU meanwhile; the profile's meta counts them")
    prof.add_argument("--max-quiet-wait-s", type=float, default=600.0, metavar="S", help="with --quiet: longest total wait")
    prof.add_argument("--concurrency", action="store_true",
                      help="also measure how much a step slows down while another worker of this machine computes "
                           "(meta.concurrent_slowdown; the simulator's SimConfig.concurrent_slowdown)")
    prof.add_argument("--out", default="profile.json", metavar="FILE", help="where to write the profile JSON")
    prof.set_defaults(func=cmd_profile)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from distserve.config import CacheConfig, SamplingParams
    from distserve.engine.llm_engine import LLMEngine

    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(
        args.model,
        dtype=args.dtype,
        cache_config=CacheConfig(block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_gb),
    )
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    last = None
    for out in engine.stream(prompt, sampling):
        if not args.json:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        last = out
    assert last is not None
    if args.json:
        m = last.metrics
        print(
            json.dumps(
                {
                    "model": args.model,
                    "text": last.text,
                    "token_ids": last.token_ids,
                    "finish_reason": last.finish_reason,
                    "num_prompt_tokens": m.num_prompt_tokens,
                    "num_output_tokens": m.num_output_tokens,
                    "ttft_s": m.ttft_s,
                    "tpot_s": m.tpot_s,
                    "e2e_s": (m.finish_time or 0.0) - m.arrival_time,
                }
            )
        )
    else:
        sys.stdout.write("\n")
    return 0


def _check_serve_args(args: argparse.Namespace) -> None:
    from distserve.errors import InvalidConfigError

    parallel = any(getattr(args, f) != 1 for f in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp"))
    if args.runtime == "local" and (parallel or args.placement is not None):
        raise InvalidConfigError(
            "--runtime local runs tp = pp = 1 instances only; TP/PP degrees and --placement need --runtime ray"
        )
    _check_placement_args(args)
    if args.kv_transfer_timeout is not None and args.runtime == "local":
        raise InvalidConfigError("--kv-transfer-timeout applies to the Ray runtime; --runtime local copies KV in-process")
    if args.ray_serve and args.threads is not None:
        raise InvalidConfigError("--threads applies to plain `distserve serve` (local or Ray runtime), not --ray-serve")
    if args.ray_serve and (parallel or args.placement is not None or args.runtime == "ray"):
        raise InvalidConfigError("--ray-serve serves in-process engines; use plain `distserve serve --runtime ray` for placements")


def _placement_from_args(args: argparse.Namespace) -> "Placement":
    from distserve.placement import Placement

    if args.placement is not None:
        try:
            return Placement.load(args.placement)
        except DistServeError as exc:
            raise type(exc)(f"--placement {args.placement}: {exc}") from exc
    if args.colocated is not None:
        return Placement.colocated_instances(args.colocated)
    return Placement.disaggregated(
        args.prefill or 1, args.decode or 1, args.prefill_tp, args.prefill_pp, args.decode_tp, args.decode_pp
    )


def _serve_slo(args: argparse.Namespace, placement: "Placement | None") -> "SLO | None":
    """The deployment's SLO: --ttft-slo/--tpot-slo over the placement's ``slo``; None if neither says."""
    from distserve.slo import SLO

    base = placement.slo if placement is not None else None
    ttft = args.ttft_slo if args.ttft_slo is not None else (base.ttft_s if base else None)
    tpot = args.tpot_slo if args.tpot_slo is not None else (base.tpot_s if base else None)
    if ttft is None and tpot is None:
        return None
    return SLO(ttft if ttft is not None else float("inf"), tpot if tpot is not None else float("inf"))


def _print_ready(url: str, model: str, layout: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32})
    print(f"distserve: serving {model!r} ({layout}) at {url}/v1  (metrics: {url}/metrics)")
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    _check_serve_args(args)
    served = args.served_model_name or args.model
    if args.colocated is not None:
        layout = f"{args.colocated} colocated engine{'s' if args.colocated > 1 else ''}"
    else:
        layout = f"{args.prefill or 1}P{args.decode or 1}D disaggregated"
    if args.ray_serve:
        from distserve.serving.app import ServeOptions, run_ray_serve

        options = ServeOptions(
            model=args.model,
            served_model_name=served,
            colocated=args.colocated or 0,
            prefill=args.prefill or 1,
            decode=args.decode or 1,
            dtype=args.dtype,
            kv_cache_gb=args.kv_cache_gb,
            block_size=args.block_size,
            max_queued_requests=args.max_queued_requests,
            tpot_slo=args.tpot_slo,
        )
        run_ray_serve(options, args.host, args.port, on_ready=lambda url: _print_ready(url, served, f"{layout}, Ray Serve"))
        return 0
    from distserve.config import CacheConfig, SchedulerConfig, slo_scheduler_config
    from distserve.serving.api import open_listen_socket, run_server
    from distserve.runtime.threaded_client import build_local_engine_client

    parallel = any(getattr(args, f) != 1 for f in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp"))
    if args.runtime == "ray" or (args.runtime == "auto" and (parallel or args.placement is not None)):
        from distserve.runtime.ray_client import ControllerClient

        placement = _placement_from_args(args)
        if args.threads is not None:
            placement = placement.with_threads(args.threads)
        slo = _serve_slo(args, placement)
        sock = open_listen_socket(args.host, args.port)
        cache = CacheConfig(block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_gb)

        def factory() -> "Awaitable[EngineClient]":
            return ControllerClient.create(
                args.model, placement, dtype=args.dtype, cache_config=cache,
                max_queued_requests=args.max_queued_requests, kv_transfer_timeout_s=args.kv_transfer_timeout,
                scheduler_config=slo_scheduler_config(slo.tpot_s if slo else None),
                prefill_scheduler_config=SchedulerConfig(),
            )

        ray_layout = " + ".join(
            f"{len(specs)}x {kind} tp{specs[0].tp}pp{specs[0].pp}"
            for kind, specs in (("prefill", placement.prefill), ("decode", placement.decode), ("colocated", placement.colocated))
            if specs
        )
        return run_server(
            factory, served, sock, on_ready=lambda url: _print_ready(url, served, f"{ray_layout}, Ray runtime"),
            log_level=args.log_level, slo=slo,
        )

    slo = _serve_slo(args, None)
    sock = open_listen_socket(args.host, args.port)
    client = build_local_engine_client(
        args.model,
        num_colocated=args.colocated or 0,
        num_prefill=args.prefill or 1,
        num_decode=args.decode or 1,
        dtype=args.dtype,
        cache_config=CacheConfig(block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_gb),
        max_queued_requests=args.max_queued_requests,
        scheduler_config=slo_scheduler_config(slo.tpot_s if slo else None),
        num_threads=args.threads,
    )
    return run_server(client, served, sock, on_ready=lambda url: _print_ready(url, served, layout), log_level=args.log_level, slo=slo)


def _check_placement_args(args: argparse.Namespace) -> None:
    from distserve.errors import InvalidConfigError

    parallel = any(getattr(args, f) != 1 for f in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp"))
    if args.placement is not None and (args.colocated is not None or args.prefill is not None or args.decode is not None or parallel):
        raise InvalidConfigError("--placement cannot be combined with --colocated/--prefill/--decode or TP/PP flags")
    if args.colocated is not None and (args.prefill is not None or args.decode is not None):
        raise InvalidConfigError("--colocated cannot be combined with --prefill/--decode")


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from simulator import report
    from simulator.simulation import SimConfig

    _check_placement_args(args)
    from distserve.errors import InvalidConfigError

    if args.step_overhead_ms < 0:
        raise InvalidConfigError(f"--step-overhead-ms must be >= 0, got {args.step_overhead_ms}")
    placement = _placement_from_args(args)
    config = SimConfig(
        num_blocks=args.num_blocks, step_overhead_s=args.step_overhead_ms / 1e3,
        **report.scheduler_configs(args.max_num_seqs, args.max_batched_tokens, args.tpot if args.step_budget == "slo" else None),
    )
    request = report.SimulateRequest(
        model=args.model, placement=placement, workload=args.workload,
        slo=report.slo_spec(args.ttft, args.tpot, args.attainment, args.attainment_mode),
        rate=args.rate, num_requests=args.num_requests, arrival=args.arrival, cv=args.cv, seed=args.seed,
        profile=args.profile, hardware=args.hardware, goodput=args.goodput, config=config,
    )
    out = report.run(request)
    if args.json:
        print(json.dumps(out, default=float))
        return 0
    console = Console()
    for table in report.render(out):
        console.print(table)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import pathlib

    from distserve.errors import InvalidConfigError
    from distserve.planner import report as plan_report
    from simulator import report
    from simulator.simulation import SimConfig

    if args.step_overhead_ms < 0:
        raise InvalidConfigError(f"--step-overhead-ms must be >= 0, got {args.step_overhead_ms}")
    for flag, value in (("--out", args.out), ("--plot", args.plot)):
        if value is not None and not pathlib.Path(value).resolve().parent.is_dir():
            raise InvalidConfigError(f"{flag} {value}: directory {pathlib.Path(value).parent} does not exist")
    plan_args = plan_report.PlanArgs(
        model=args.model, gpu=args.gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node, workload=args.workload,
        ttft_s=args.ttft, tpot_s=args.tpot, attainment=args.attainment, attainment_mode=args.attainment_mode,
        rate=args.rate, gpus=args.gpus, profile=args.profile, affinity=args.affinity, num_requests=args.num_requests,
        seed=args.seed, intra_node_gbps=args.intra_node_bandwidth, inter_node_gbps=args.inter_node_bandwidth,
        workers=args.workers,
        sim_config=SimConfig(step_overhead_s=args.step_overhead_ms / 1e3, **report.scheduler_configs(args.max_num_seqs, args.max_batched_tokens)),
    )
    req, result = plan_report.run_plan(plan_args, show_progress=not args.json)
    if args.json:
        print(json.dumps(plan_report.summary(req, result), default=float))
    else:
        plan_report.print_tables(plan_report.render(req, result))
        for note in result.notes:
            print(f"note: {note}")
    if not result.feasible:
        print(f"distserve plan: no placement meets the SLO on this cluster. {result.closest}", file=sys.stderr)
        return 1
    best = result.best
    assert best is not None
    colo = result.colocated
    if not args.json:
        verdict = ""
        if colo is not None and colo.per_gpu > 0:
            ratio = best.per_gpu / colo.per_gpu
            verdict = f" ({ratio:.2f}x colocated)" if best is not colo else " (colocated wins for this workload)"
        print(f"best: {best.name}, {best.num_gpus} GPUs, {best.rate:.3g} req/s, {best.per_gpu:.3g} req/s per GPU{verdict}")
    if args.out is not None:
        plan_report.write_plan(result, args.out)
        if not args.json:
            print(f"wrote {args.out} (deploy with: distserve serve --model ... --placement {args.out})")
    if args.plot is not None:
        plan_report.plot(req, result, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import pathlib

    from rich.console import Console
    from rich.table import Table

    from distserve.measure import profiler
    from distserve.errors import InvalidConfigError

    out = pathlib.Path(args.out)
    if not out.parent.is_dir():
        raise InvalidConfigError(f"--out {args.out}: directory {out.parent} does not exist")
    if out.is_dir():
        raise InvalidConfigError(f"--out {args.out}: is a directory")
    if not args.max_quiet_wait_s >= 0:
        raise InvalidConfigError(f"--max-quiet-wait-s must be >= 0, got {args.max_quiet_wait_s}")
    try:
        config = profiler.model_config(args.model, args.dtype)
    except DistServeError as exc:
        raise type(exc)(f"--model {args.model}: {exc}") from exc
    try:
        tps = profiler.check_tps(config, args.tp or [1])
    except DistServeError as exc:
        raise type(exc)(f"--tp: {exc}") from exc
    profile = profiler.profile_engine(
        args.model, tps, dtype=args.dtype, threads=args.threads, quick=args.quick,
        repeats=args.repeats, block_size=args.block_size, quiet=args.quiet, concurrency=args.concurrency,
        max_quiet_wait_s=args.max_quiet_wait_s,
    )
    profiler.write_profile(profile, out)
    meta = profile["meta"]
    table = Table(title=f"{args.model}, {meta['dtype']}, {args.threads} thread(s)/rank: step time (ms)",
                  caption=f"{meta['cpu']}, measured in {meta['profile_seconds']} s")
    for col in ("tp", "phase", "coefficients", "MAPE"):
        table.add_column(col, justify="right" if col in ("tp", "MAPE") else "left")
    for tp, fit in profile["tp"].items():
        err = fit["fit_error"]
        table.add_row(tp, "prefill", _fmt_coeffs(fit["prefill"]), f"{err['prefill_mape']:.1%}")
        threshold = fit["decoding_large_small_bs_threshold"]
        table.add_row(tp, f"decode bs<{threshold}", _fmt_coeffs(fit["decoding_smallbs"]), f"{err['decode_mape']:.1%}")
        table.add_row(tp, f"decode bs>={threshold}", _fmt_coeffs(fit["decoding_largebs"]), "")
    Console().print(table)
    print(f"wrote {out}")
    return 0


def _fmt_coeffs(coeffs: Seq[float]) -> str:
    return "[" + ", ".join(f"{c:.4g}" for c in coeffs) + "]"


def main(argv: Seq[str] | None = None) -> int:
    """Bad flags and bad input both exit with code 2 and a message naming the problem."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except DistServeError as exc:
        print(f"distserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
