"""In-flight prefix sharing: N siblings with one long shared prefix submitted at once, sharing on vs off.

A map step's N calls over one document, or N users of a copilot's system prompt, arrive together
and share a long prefix that no instance has cached yet. With sharing off (``SchedulerConfig(
enable_inflight_prefix_sharing=False)``, the behaviour before it existed) every sibling admitted in
the same step computes the prefix itself; with sharing on (the default) the first computes it and
the others wait for its commit, then take it from the prefix cache. (Siblings admitted in a later
step hit the cache either way: the step token budget, ``--budgets``, decides how many share a step
without it.) For each engine (the colocated ``LLMEngine`` and the in-process disaggregated
``LocalDisaggEngine``, 1 prefill + 1 decode), budget and setting, on a fresh engine (empty cache), it
measures the prefill tokens computed and reused
(the engine's ``prefill_tokens_computed_total`` / ``prefix_cache_hit_tokens_total``), the time until
every sibling has its first token (all prefills done) and until all finish, and checks that greedy
outputs are the same either way. Runs alternate on/off; figures are medians over --repeats.
Default: SmolLM2-135M, 16 siblings x (512 shared + 32 own) tokens, 8 output tokens each.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

import harness
from distserve.cli.arg_types import non_negative_int, positive_int
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.local_disagg import LocalDisaggEngine
from harness import Outputs

BLOCK_SIZE = 16
ENGINES = ("colocated", "disagg")
SETTINGS = {"on": True, "off": False}


def make_prompts(num: int, prefix_len: int, suffix_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts: one random shared prefix, then each its own random suffix (ids clear of special tokens)."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)
    prefix = [rng.randrange(low, vocab_size) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(low, vocab_size) for _ in range(suffix_len)] for _ in range(num)]


def build(kind: str, loaded: LoadedModel, share: bool, budget: int, num_blocks: int) -> LLMEngine | LocalDisaggEngine:
    cache = CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    sched = SchedulerConfig(max_num_batched_tokens=budget, enable_inflight_prefix_sharing=share)
    if kind == "colocated":
        return LLMEngine(loaded, cache_config=cache, scheduler_config=sched)
    return LocalDisaggEngine(loaded, num_prefill=1, num_decode=1, cache_config=cache,
                             prefill_scheduler_config=sched, decode_scheduler_config=sched)


def run_once(engine: LLMEngine | LocalDisaggEngine, prompts: list[list[int]], sp: SamplingParams) -> dict[str, Any]:
    """Submit every prompt at once and step to the end: times, counters, outputs."""
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p in prompts]
    first: set[str] = set()
    outputs: dict[str, list[int]] = {}
    all_prefills_s = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.token_ids:
                first.add(out.request_id)
            if out.finished:
                outputs[out.request_id] = out.token_ids
        if all_prefills_s is None and len(first) == len(ids):
            all_prefills_s = time.perf_counter() - t0
    total_s = time.perf_counter() - t0
    stats = engine.stats()
    return {
        "all_prefills_s": all_prefills_s, "total_s": total_s,
        "prefill_tokens_computed": int(stats["prefill_tokens_computed_total"]),  # type: ignore[call-overload]
        "prefix_cache_hit_tokens": int(stats["prefix_cache_hit_tokens_total"]),  # type: ignore[call-overload]
        "token_ids": [outputs[i] for i in ids],
    }


def main() -> None:
    ap = harness.parser(__doc__, "tiny model, 8 siblings x (64 shared + 8 own) tokens, one repeat")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-siblings", type=positive_int, default=16)
    ap.add_argument("--prefix-len", type=positive_int, default=512)
    ap.add_argument("--suffix-len", type=non_negative_int, default=32)
    ap.add_argument("--max-tokens", type=positive_int, default=8)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--budgets", default="2048,8192", help="step token budgets (max_num_batched_tokens), comma-separated")
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    harness.add_quiet_args(ap, max_wait_s=600.0, retries=2)
    args = ap.parse_args()
    if args.quick:
        args.model, args.num_siblings, args.prefix_len, args.suffix_len, args.max_tokens, args.repeats = "tiny", 8, 64, 8, 4, 1
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    out = Outputs.for_run(args, "bench_prefix_sharing")
    guard = harness.QuietGuard.from_args(args)
    loaded = load_model(args.model, "float32")
    prompts = make_prompts(args.num_siblings, args.prefix_len, args.suffix_len, loaded.config.vocab_size)
    sp = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=0.0)
    per_request = -(-(args.prefix_len + args.suffix_len + args.max_tokens) // BLOCK_SIZE)
    num_blocks = args.num_siblings * per_request + 16  # room for every sibling unshared: no preemption either way

    configs = [(kind, budget) for kind in ENGINES for budget in budgets]
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {(k, b, s): [] for k, b in configs for s in SETTINGS}
    max_other_cores = 0.0
    for kind, budget in configs:
        for share in SETTINGS.values():  # warm up: every batch shape either setting runs
            run_once(build(kind, loaded, share, budget, num_blocks), prompts, sp)
        for rep in range(args.repeats):
            for setting, share in SETTINGS.items():  # alternating, so both see the same machine
                result, _, watch = guard.measure(
                    f"{kind} budget {budget} sharing {setting}",
                    lambda: run_once(build(kind, loaded, share, budget, num_blocks), prompts, sp),  # fresh: empty cache
                )
                max_other_cores = max(max_other_cores, watch.other_cores)
                runs[(kind, budget, setting)].append(result)
                print(f"{kind} budget {budget} sharing {setting} #{rep}: computed {result['prefill_tokens_computed']} reused "
                      f"{result['prefix_cache_hit_tokens']} tokens; all prefills {result['all_prefills_s']:.3f}s, "
                      f"all done {result['total_s']:.3f}s", flush=True)

    figures: dict[str, Any] = {
        "model": args.model, "num_siblings": args.num_siblings, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
        "max_tokens": args.max_tokens, "repeats": args.repeats, "threads": args.threads, "block_size": BLOCK_SIZE,
        "budgets": budgets, "max_other_cores": round(max_other_cores, 2),
    }
    rows = []
    for kind, budget in configs:
        name = f"{kind}_b{budget}"
        for setting in SETTINGS:
            rs = runs[(kind, budget, setting)]
            key = f"{name}_{setting}"
            figures[f"{key}_prefill_tokens_computed"] = rs[-1]["prefill_tokens_computed"]
            figures[f"{key}_prefix_cache_hit_tokens"] = rs[-1]["prefix_cache_hit_tokens"]
            figures[f"{key}_all_prefills_s"] = round(statistics.median(r["all_prefills_s"] for r in rs), 4)
            figures[f"{key}_total_s"] = round(statistics.median(r["total_s"] for r in rs), 4)
            rows.append([kind, str(budget), setting, str(figures[f"{key}_prefill_tokens_computed"]),
                         str(figures[f"{key}_prefix_cache_hit_tokens"]), harness.ms(figures[f"{key}_all_prefills_s"]),
                         harness.ms(figures[f"{key}_total_s"])])
        on, off = runs[(kind, budget, "on")], runs[(kind, budget, "off")]
        figures[f"{name}_greedy_same"] = all(a["token_ids"] == b["token_ids"] for a, b in zip(on, off))
        figures[f"{name}_prefill_speedup"] = round(figures[f"{name}_off_all_prefills_s"] / figures[f"{name}_on_all_prefills_s"], 3)
        figures[f"{name}_total_speedup"] = round(figures[f"{name}_off_total_s"] / figures[f"{name}_on_total_s"], 3)

    columns = ["engine", "budget", "sharing", "prefill tokens computed", "reused from cache", "all prefills (ms)", "all done (ms)"]
    title = (f"{args.num_siblings} siblings x ({args.prefix_len} shared + {args.suffix_len} own) tokens, "
             f"{args.max_tokens} out, {args.model}")
    harness.rich_table(title, columns, rows, left=("engine", "budget", "sharing"))
    out.json(figures)
    out.markdown([f"# In-flight prefix sharing: {title}", "", "| " + " | ".join(columns) + " |",
                  "|" + "---|" * len(columns), *("| " + " | ".join(r) + " |" for r in rows), "",
                  *(f"- {k}: prefills {figures[f'{k}_prefill_speedup']}x faster, all done {figures[f'{k}_total_speedup']}x, "
                    f"greedy outputs the same: {figures[f'{k}_greedy_same']}" for k in (f"{e}_b{b}" for e, b in configs))])
    harness.finish(figures)


if __name__ == "__main__":
    main()
