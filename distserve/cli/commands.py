"""The other subcommands: ``generate`` (the colocated engine), ``simulate``, ``plan`` and ``profile``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence as Seq

from distserve.cli.args import admission_config_of, check_placement_args, placement_from_args
from distserve.config import SchedulerConfig
from distserve.errors import DistServeError


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
        cache_config=CacheConfig(block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_gb, decode_attention=args.decode_attention),
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


def _colocated_policy(configs: dict[str, SchedulerConfig], policy: str) -> dict[str, SchedulerConfig]:
    """``configs`` (``simulator.report.scheduler_configs``) with the colocated scheduler's ``step_policy``
    (``--colocated-policy``); InvalidConfigError where it cannot go with the step budget."""
    from dataclasses import replace

    return {**configs, "scheduler": replace(configs["scheduler"], step_policy=policy)}


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from simulator import report
    from simulator.simulation import SimConfig

    check_placement_args(args)
    from distserve.errors import InvalidConfigError

    if args.step_overhead_ms < 0:
        raise InvalidConfigError(f"--step-overhead-ms must be >= 0, got {args.step_overhead_ms}")
    # The flags override a Placement JSON's batch caps, as `distserve serve`'s do.
    placement = placement_from_args(args).with_caps(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens)
    config = SimConfig(
        num_blocks=args.num_blocks, step_overhead_s=args.step_overhead_ms / 1e3, router=args.router,
        admission=admission_config_of(args, args.tpot),
        **_colocated_policy(report.scheduler_configs(args.max_num_seqs, args.max_batched_tokens, args.tpot if args.step_budget == "slo" else None),
                            args.colocated_policy),
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
    from distserve.planner.classes import parse_class_slo
    from simulator import report
    from simulator.simulation import SimConfig

    if args.step_overhead_ms < 0:
        raise InvalidConfigError(f"--step-overhead-ms must be >= 0, got {args.step_overhead_ms}")
    for flag, value in (("--out", args.out), ("--plot", args.plot)):
        if value is not None and not pathlib.Path(value).resolve().parent.is_dir():
            raise InvalidConfigError(f"{flag} {value}: directory {pathlib.Path(value).parent} does not exist")
    if args.save_dir is not None and pathlib.Path(args.save_dir).exists() and not pathlib.Path(args.save_dir).is_dir():
        raise InvalidConfigError(f"--save-dir {args.save_dir}: exists and is not a directory", "save_dir")
    class_slos = dict(parse_class_slo(text) for text in args.class_slo or ())
    if len(class_slos) != len(args.class_slo or ()):
        raise InvalidConfigError("--class-slo: an objective is given twice", "class_slo")
    plan_args = plan_report.PlanArgs(
        model=args.model, gpu=args.gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node, workload=args.workload,
        ttft_s=args.ttft, tpot_s=args.tpot, attainment=args.attainment, attainment_mode=args.attainment_mode,
        rate=args.rate, gpus=args.gpus, profile=args.profile, affinity=args.affinity, num_requests=args.num_requests,
        seed=args.seed, intra_node_gbps=args.intra_node_bandwidth, inter_node_gbps=args.inter_node_bandwidth,
        workers=args.workers, class_slos=class_slos,
        sim_config=SimConfig(step_overhead_s=args.step_overhead_ms / 1e3,
                             **_colocated_policy(report.scheduler_configs(args.max_num_seqs, args.max_batched_tokens), args.colocated_policy)),
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
        if result.classes is not None:
            chosen = result.classes.chosen
            print("class pools: " + (f"{chosen.name} replace the shared pool (every class's goodput/GPU >= shared, one higher)"
                                     if chosen is not None else "the shared pool stays (no split meets the rule)"))
    if args.out is not None:
        plan_report.write_plan(result, args.out)
        if not args.json:
            print(f"wrote {args.out} (deploy with: distserve serve --model ... --placement {args.out})")
    if args.plot is not None:
        plan_report.plot(req, result, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    if args.save_dir is not None:
        try:
            paths = plan_report.write_bundle(req, result, args.model, args.save_dir)
        except OSError as exc:
            raise InvalidConfigError(f"--save-dir {args.save_dir}: {exc}", "save_dir") from None
        if not args.json:
            print(f"wrote {', '.join(paths)} to {args.save_dir}; deploy with: {paths['serve_command.txt'].read_text().strip()}")
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
