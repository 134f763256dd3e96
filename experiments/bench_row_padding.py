"""Padded rows in the prepacked linears: memory and time of an engine that meets many batch shapes.

``PrepackedLinear`` runs oneDNN, which builds (JIT-compiles) and caches a primitive for every input
shape it meets. A packed batch's row count is its number of new tokens, different at almost every
prefill step, and a process's heap grew with the number of row counts it had met (the chaos suite's
soak: a prefill instance that never stopped growing). ``distserve.engine.model.padded_rows`` pads
every input to one of few row counts. This runs the same workload on our colocated ``LLMEngine``
with the rows padded (``padded``) and as they come (``unpadded``, ``padded_rows`` replaced by the
identity), each in its own subprocess, interleaved: requests with random prompt lengths arrive a
few at a time while others decode, so prefill and mixed steps meet hundreds of row counts.

Figures per variant (median over ``--repeats``): engine wall and CPU seconds, generated tokens per
second, the process's anonymous memory (heap) after the first half of the requests and at the end,
and the distinct row counts oneDNN met. The ratios compare padded with unpadded. Greedy outputs of
both are compared token by token (padding changes no row's arithmetic in exact arithmetic; oneDNN may
pick another kernel for another row count, so a rare last-bit difference can flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import harness
from distserve.cli.arg_types import positive_int


def anon_mb() -> float:
    """This process's anonymous resident memory (heap and stacks), MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


def measure(model: str, num_requests: int, max_tokens: int, padded: bool, seed: int) -> dict[str, Any]:
    """One run of the workload in this process (``--child``)."""
    import torch

    from distserve.config import CacheConfig, SamplingParams
    from distserve.engine import model as model_mod
    from distserve.engine.llm_engine import LLMEngine
    from distserve.engine.weights import load_model

    shapes: set[int] = set()
    pad = model_mod.padded_rows if padded else (lambda t: t)

    def seen(t: int) -> int:
        rows = pad(t)
        shapes.add(rows)
        return rows

    model_mod.padded_rows = seen
    torch.manual_seed(seed)
    engine = LLMEngine(load_model(model, "float32"), cache_config=CacheConfig(kv_cache_memory_gb=0.25))
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(8, 300))] for _ in range(num_requests)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    order = [engine.add_request(prompts[i], sp) for i in range(min(4, num_requests))]
    next_i, half_mb = len(order), None
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step_or_recover():
            if out.finished:
                outputs[out.request_id] = list(out.token_ids)
        # A few arrivals per step: the batch's row count changes from step to step.
        for _ in range(rng.randint(0, 2)):
            if next_i < num_requests:
                order.append(engine.add_request(prompts[next_i], sp))
                next_i += 1
        if half_mb is None and len(outputs) >= num_requests // 2:
            half_mb = anon_mb()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(outputs[r]) for r in order)
    return {"wall_s": wall, "cpu_s": cpu, "tok_s": tokens / wall, "anon_mb_half": half_mb, "anon_mb_end": anon_mb(),
            "row_counts": len(shapes), "token_ids": [outputs[r] for r in order]}


def run_child(args: argparse.Namespace, padded: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--num-requests", str(args.num_requests),
           "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)] + (["--padded"] if padded else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = harness.parser(__doc__, "tiny model, 24 requests, one repeat")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=positive_int, default=400)
    ap.add_argument("--max-tokens", type=positive_int, default=16)
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--padded", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.num_requests, args.max_tokens, args.padded, args.seed)))
        return
    if args.quick:
        args.model, args.num_requests, args.max_tokens, args.repeats = "tiny", 24, 4, 1
    if args.num_requests < 2:
        ap.error(f"--num-requests must be >= 2, got {args.num_requests}")
    runs: dict[str, list[dict[str, Any]]] = {"unpadded": [], "padded": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(run_child(args, name == "padded"))
    keys = ("wall_s", "cpu_s", "tok_s", "anon_mb_half", "anon_mb_end", "row_counts")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    for m in med.values():
        m["anon_mb_growth_second_half"] = m["anon_mb_end"] - m["anon_mb_half"]
    same = sum(a == b for a, b in zip(runs["padded"][0]["token_ids"], runs["unpadded"][0]["token_ids"]))
    figures = {
        "model": args.model, "num_requests": args.num_requests, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "padded": med["padded"], "unpadded": med["unpadded"],
        "tok_s_ratio": med["padded"]["tok_s"] / med["unpadded"]["tok_s"],
        "cpu_s_ratio": med["padded"]["cpu_s"] / med["unpadded"]["cpu_s"],
        "anon_mb_end_ratio": med["padded"]["anon_mb_end"] / med["unpadded"]["anon_mb_end"],
        "identical_outputs": same, "outputs": args.num_requests,
    }
    rows = [[name, f"{m['tok_s']:.1f}", f"{m['cpu_s']:.1f}", f"{m['anon_mb_half']:.0f}", f"{m['anon_mb_end']:.0f}",
             f"{m['anon_mb_growth_second_half']:+.0f}", str(int(m["row_counts"]))] for name, m in med.items()]
    cols = ["rows", "tokens/s", "CPU s", "heap MB at half", "heap MB at end", "growth, 2nd half", "row counts met"]
    harness.rich_table("Prepacked linears: padded vs unpadded rows", cols, rows)
    out = harness.Outputs.for_run(args, "bench_row_padding")
    out.json({**figures, "runs": {k: [{kk: vv for kk, vv in r.items() if kk != "token_ids"} for r in rs] for k, rs in runs.items()}})
    out.markdown([f"# Prepacked linears: padded vs unpadded rows ({args.model}, {args.num_requests} requests x "
                  f"{args.max_tokens} tokens, median of {args.repeats})", "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + ["| " + " | ".join(r) + " |" for r in rows] +
                 ["", f"Padded / unpadded: tokens/s {figures['tok_s_ratio']:.2f}x, CPU {figures['cpu_s_ratio']:.2f}x, "
                  f"heap at end {figures['anon_mb_end_ratio']:.2f}x; identical greedy outputs {same}/{args.num_requests}."])
    harness.finish(figures)


if __name__ == "__main__":
    main()
