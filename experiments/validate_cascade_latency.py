"""The simulator's shared-prefix (cascade) term against measured decode steps of SmolLM2.

For N requests sharing a P-token prompt prefix (the same physical KV blocks, as prefix caching
hands them out) plus a suffix of their own, one decode step of the whole model
(``ModelRunner.execute``, sampling included) is timed with the ``cascade`` and the ``exact``
decode attention over a KV cache of random values (prefilling real prompts that long would
dominate the run; values do not change the cost). Each measured step is compared with the fitted
latency model of the shipped SmolLM2 CPU profile (``experiments/results/validate_simulator_profile.json``,
measured with the exact kernel: ``decode_attention`` "sum") on the very plan that ran: without the
shared term (Σctx, what the simulator charged before) and with it (``decode_attention`` "cascade":
Σctx less ``BatchShape.decode_shared_saved``, computed by ``simulator.sim_instance.batch_shape``
from the plan's block tables with the cascade backend's rule). The exact steps check the profile
itself. What a shared token still costs each further member (``cascade_shared_fraction``: the
group's queries still meet every key) is fitted as the median residual over the read cost the term
removed, and reported with the errors it leaves; the residual per kept node after it
(``cascade_node_ms``) too.

Torch threads and dtype default to the profile's (``meta.threads``, ``meta.dtype``), so the
coefficients apply. Writes JSON + markdown under --out-dir; the last stdout line is one JSON
object of the figures.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import harness
from distserve.cli.arg_types import positive_int
from distserve.config import SamplingParams
from distserve.engine.model_runner import ModelRunner
from distserve.engine.step_plan import ScheduledChunk, StepPlan
from distserve.engine.weights import load_model
from harness import LoadWatch, Outputs
from simulator.latency import FittedLatencyModel
from simulator.profiles import read_profile
from simulator.sim_instance import batch_shape
from kernels.backends import get_decode_attention

PROFILE = Path(__file__).resolve().parent / "results" / "validate_simulator_profile.json"
BACKENDS = ("cascade", "exact")
BLOCK_SIZE = 16


def shared_prefix_plan(num_requests: int, prefix_len: int, suffix_len: int, vocab: int,
                       gen: torch.Generator) -> tuple[StepPlan, int]:
    """One decode per request: a shared prefix on the same (shuffled) physical blocks, then each
    request's own blocks; the plan and the number of cache blocks it needs."""
    shared_blocks, own_blocks = -(-prefix_len // BLOCK_SIZE), -(-suffix_len // BLOCK_SIZE)
    num_blocks = shared_blocks + num_requests * own_blocks + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    prefix = [perm.pop() for _ in range(shared_blocks)]
    ctx = prefix_len + suffix_len
    greedy = SamplingParams(temperature=0.0)
    chunks = [
        ScheduledChunk(f"r{i}", [int(torch.randint(10, vocab, (1,), generator=gen))], ctx - 1,
                       prefix + [perm.pop() for _ in range(own_blocks)], True, greedy, 1)
        for i in range(num_requests)
    ]
    return StepPlan(chunks), num_blocks


def time_backends(runner: ModelRunner, plan: StepPlan, repeats: int) -> dict[str, float]:
    """Median seconds of one step per backend; backends alternate, their order flipping each round."""
    seconds: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for r in range(repeats + 1):  # round 0 warms up
        for backend in BACKENDS if r % 2 == 0 else reversed(BACKENDS):
            runner.decode_attention = backend
            t0 = time.perf_counter()
            runner.execute(plan)
            if r:
                seconds[backend].append(time.perf_counter() - t0)
    return {b: statistics.median(ts) for b, ts in seconds.items()}


def relative_errors(rows: list[dict[str, Any]], predicted: str, measured: str) -> dict[str, float]:
    errors = [abs(r[predicted] - r[measured]) / r[measured] for r in rows]
    return {"median": round(statistics.median(errors), 4), "max": round(max(errors), 4)}


def main() -> None:
    ap = harness.parser(__doc__, "N in {4, 8}, P = 1024, 32-token suffixes, 2 repeats")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--profile", default=str(PROFILE), help="the fitted latency profile to validate")
    ap.add_argument("--requests", default="8,16,32", help="N: requests sharing the prefix")
    ap.add_argument("--prefixes", default="512,2048", help="P: shared prefix tokens")
    ap.add_argument("--suffix", type=positive_int, default=64, help="each request's own tokens after the prefix")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: the profile's meta.threads)")
    ap.add_argument("--dtype", default=None, help="model dtype (default: the profile's meta.dtype)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prefixes, args.suffix, args.repeats = "4,8", "1024", 32, 2
    contents = read_profile(args.profile)
    profile_meta = json.loads(Path(args.profile).read_text()).get("meta") or {}
    threads = args.threads or contents.threads or 1
    dtype = args.dtype or profile_meta.get("dtype") or "float32"
    torch.set_num_threads(threads)
    without = FittedLatencyModel(contents.model, contents.coeffs, contents.hardware, source=contents.source,
                                 decode_attention="sum", threads=contents.threads)
    with_term = FittedLatencyModel(contents.model, contents.coeffs, contents.hardware, source=contents.source,
                                   decode_attention="cascade", threads=contents.threads)
    rule = get_decode_attention("cascade").rule  # type: ignore[attr-defined]
    loaded = load_model(args.model, dtype)
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[dict[str, Any]] = []
    with LoadWatch(period=None) as watch:  # no polling thread: it would disturb the timings
        for prefix_len in (int(p) for p in args.prefixes.split(",")):
            for num_requests in (int(n) for n in args.requests.split(",")):
                plan, num_blocks = shared_prefix_plan(num_requests, prefix_len, args.suffix, loaded.config.vocab_size, gen)
                runner = ModelRunner(loaded.config, loaded.state_dict, num_blocks, BLOCK_SIZE)
                runner.kv_cache.normal_(generator=gen)
                seconds = time_backends(runner, plan, args.repeats)
                del runner
                shape = batch_shape(plan, rule, BLOCK_SIZE)
                rows.append({
                    "num_requests": num_requests, "prefix_len": prefix_len, "suffix_len": args.suffix,
                    "decode_ctx": shape.decode_ctx, "shared_saved": shape.decode_shared_saved, "shared_nodes": shape.decode_shared_nodes,
                    "cascade_ms": seconds["cascade"] * 1e3, "exact_ms": seconds["exact"] * 1e3,
                    "predicted_sum_ms": without.step_time(shape) * 1e3, "predicted_cascade_ms": with_term.step_time(shape) * 1e3,
                })
                r = rows[-1]
                print(f"N={num_requests:3d} P={prefix_len:5d}: cascade {r['cascade_ms']:7.1f} ms (predicted {r['predicted_cascade_ms']:7.1f}"
                      f" with the term, {r['predicted_sum_ms']:7.1f} without)  exact {r['exact_ms']:7.1f} ms", flush=True)
    # What a shared token still costs each further member (the group's queries meet every key), as a
    # fraction of reading it: the median of each step's residual over the read cost the term removed.
    fractions = [(r["cascade_ms"] - r["predicted_cascade_ms"]) / (r["predicted_sum_ms"] - r["predicted_cascade_ms"])
                 for r in rows if r["shared_saved"]]
    fraction = min(1.0, max(0.0, statistics.median(fractions))) if fractions else 0.0
    for r in rows:
        r["predicted_cascade_fitted_ms"] = r["predicted_cascade_ms"] + fraction * (r["predicted_sum_ms"] - r["predicted_cascade_ms"])
    # Then one more attention call and merge per kept node: the median residual per node left.
    per_node = [(r["cascade_ms"] - r["predicted_cascade_fitted_ms"]) / r["shared_nodes"] for r in rows if r["shared_nodes"]]
    node_ms = statistics.median(per_node) if per_node else 0.0
    figures: dict[str, Any] = {
        "model": args.model, "dtype": dtype, "threads": threads, "profile": Path(args.profile).name,
        "profile_decode_attention": contents.decode_attention, "cascade_min_saved_tokens": rule.min_saved_tokens, "cascade_member_cost_tokens": rule.member_cost_tokens,
        "cases": [[r["num_requests"], r["prefix_len"]] for r in rows],
        "cascade_error_with_term": relative_errors(rows, "predicted_cascade_ms", "cascade_ms"),
        "cascade_error_without_term": relative_errors(rows, "predicted_sum_ms", "cascade_ms"),
        "cascade_error_with_fitted_fraction": relative_errors(rows, "predicted_cascade_fitted_ms", "cascade_ms"),
        "cascade_shared_fraction_fit": round(fraction, 4),
        "exact_error": relative_errors(rows, "predicted_sum_ms", "exact_ms"),
        "cascade_node_ms_residual": round(node_ms, 2),
        "speedup": {f"{r['num_requests']}x{r['prefix_len']}": round(r["exact_ms"] / r["cascade_ms"], 2) for r in rows},
        "other_processes_busy_cores": round(watch.other_cores, 2),
    }
    out = Outputs.for_run(args, "validate_cascade_latency")
    out.json({"figures": figures, "rows": rows})
    md = [f"Decode step of {args.model} ({dtype}, {threads} thread(s)) with N requests sharing a P-token prefix "
          f"(+{args.suffix} own tokens each), median of {args.repeats}, vs the fitted model of {Path(args.profile).name} "
          f"(relative error; cascade rule: (members - 1) x tokens >= {rule.min_saved_tokens} + {rule.member_cost_tokens} x members; "
          "a batch below it runs exact, saved = 0).", "",
          "| N | P | Σctx | saved | exact ms | cascade ms | predicted Σctx | with term | with term, fitted f | err without | err with | err fitted f |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['num_requests']} | {r['prefix_len']} | {r['decode_ctx']} | {r['shared_saved']} | {r['exact_ms']:.1f} | {r['cascade_ms']:.1f} "
           f"| {r['predicted_sum_ms']:.1f} | {r['predicted_cascade_ms']:.1f} | {r['predicted_cascade_fitted_ms']:.1f} "
           + "".join(f"| {(r[k] - r['cascade_ms']) / r['cascade_ms']:+.0%} " for k in ("predicted_sum_ms", "predicted_cascade_ms", "predicted_cascade_fitted_ms"))
           + "|" for r in rows]
    md += ["", f"Fitted shared-token fraction f (``cascade_shared_fraction``): {fraction:.3f}; median residual per kept node after it: "
           f"{node_ms:.2f} ms. Cores kept busy by other processes meanwhile: {figures['other_processes_busy_cores']}"]
    out.markdown(md)
    harness.finish(figures)


if __name__ == "__main__":
    main()
