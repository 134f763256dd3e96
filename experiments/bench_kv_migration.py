"""KV migration bandwidth: ``send_kv``/``recv_kv`` over gloo vs raw ``dist.send``/``recv`` of the same bytes.

SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64, block_size 16, fp32; 46 KB per token)
for requests of 1k-16k tokens with scattered block ids on both sides. Two cases, each in its own
process group on 127.0.0.1: prefill tp1pp1 → decode tp1pp1 (2 processes) and prefill tp1pp1 →
decode tp1pp2 (3 processes, resharding by layer). In the same run and interleaved, it times
  * migration with the default layer chunking (big slices pipelined in pieces),
  * migration with exactly one message per slice (``chunk_bytes=None``),
  * the raw baseline: one contiguous tensor per (sender, receiver) pair holding exactly that
    pair's bytes, sent with ``dist.isend``/``irecv`` (no gather, no scatter).
Each figure is the median over --repeats of the time from a common barrier to the slowest rank's
finish. It also times one decode-only step (batch 16) of a real ``LLMEngine`` to express migration
in decode steps. Writes JSON + markdown + PNG under --out-dir; the last stdout line is the JSON.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import harness
from distserve.cli.arg_types import non_negative_float, positive_int
from distserve.kvtransfer import KVLayout, StagingBuffers, TorchDistTransport, init_process_group, recv_kv, send_kv
from distserve.kvtransfer.migration import DEFAULT_CHUNK_BYTES, messages
from distserve.kvtransfer.plan import reshard_plan
from harness import Outputs

SMOLLM2_KV: dict[str, Any] = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
CASES = {"tp1pp1_to_tp1pp1": (1, 1, 1, 1), "tp1pp1_to_tp1pp2": (1, 1, 1, 2)}  # src tp, pp; dst tp, pp
MODES = ("chunked", "one_msg_per_slice", "raw")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(fn: Callable[[], None]) -> float:
    """Seconds from a common barrier until the slowest rank finishes ``fn``."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def worker(
    rank: int, world_size: int, port: int, case: str, lengths: list[int], repeats: int, threads: int,
    chunk_bytes: int | None, results: Any,
) -> None:
    torch.set_num_threads(threads)
    init_process_group(rank, world_size, f"tcp://127.0.0.1:{port}", backend="gloo")
    transport = TorchDistTransport()
    stp, spp, dtp, dpp = CASES[case]
    src = KVLayout(tp=stp, pp=spp, **SMOLLM2_KV)
    dst = KVLayout(tp=dtp, pp=dpp, **SMOLLM2_KV)
    is_src = rank < src.world_size
    layout, local_rank = (src, rank) if is_src else (dst, rank - src.world_size)
    tp_rank, pp_rank = layout.coords(local_rank)
    src_to_global = list(range(src.world_size))
    dst_to_global = [src.world_size + r for r in range(dst.world_size)]
    plan = reshard_plan(src, dst)
    mine = [s for s in plan if (s.src_rank if is_src else s.dst_rank) == local_rank]
    gen = torch.Generator().manual_seed(1234 + rank)
    staging = StagingBuffers()  # a worker keeps one across requests
    max_blocks = -(-max(lengths) // src.block_size)
    num_cache_blocks = max_blocks + max_blocks // 4 + 8  # slack, so the ids are scattered
    cache = torch.randn(layout.local_shape(num_cache_blocks, pp_rank, tp_rank), generator=gen)
    rows: list[dict[str, Any]] = []
    for num_tokens in lengths:
        num_blocks = -(-num_tokens // src.block_size)
        block_ids = torch.randperm(num_cache_blocks, generator=gen)[:num_blocks].tolist()
        raw_bufs = [torch.ones(s.nbytes(num_blocks, src) // 4) for s in mine]

        def migrate(chunk: int | None) -> None:
            if is_src:
                send_kv(transport, cache, src, dst, local_rank, block_ids, dst_to_global, 0, staging=staging,
                        chunk_bytes=chunk)
            else:
                recv_kv(transport, cache, src, dst, local_rank, block_ids, src_to_global, 0, staging=staging,
                        chunk_bytes=chunk)

        def raw() -> None:
            if is_src:
                works = [dist.isend(b, dst=dst_to_global[s.dst_rank], tag=1) for s, b in zip(mine, raw_bufs)]
            else:
                works = [dist.irecv(b, src=src_to_global[s.src_rank], tag=1) for s, b in zip(mine, raw_bufs)]
            for w in works:
                assert w is not None
                w.wait()

        runs: dict[str, Callable[[], None]] = {
            "chunked": lambda: migrate(chunk_bytes), "one_msg_per_slice": lambda: migrate(None), "raw": raw,
        }
        for fn in runs.values():  # warm up connections and staging buffers
            fn()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(repeats):  # interleaved, so all modes see the same machine state
            for mode, fn in runs.items():
                times[mode].append(timed(fn))
        row: dict[str, Any] = {
            "case": case, "num_tokens": num_tokens, "num_bytes": sum(s.nbytes(num_blocks, src) for s in plan),
            "num_slices": len(plan), "num_messages_chunked": len(messages(plan, num_blocks, src, chunk_bytes)),
        }
        row.update({f"{m}_s": statistics.median(t) for m, t in times.items()})
        rows.append(row)
        raw_bufs.clear()  # free before the next length allocates
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run_case(
    case: str, lengths: list[int], repeats: int, threads: int, chunk_bytes: int | None
) -> list[dict[str, Any]]:
    stp, spp, dtp, dpp = CASES[case]
    world_size = stp * spp + dtp * dpp
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        worker, args=(world_size, free_port(), case, lengths, repeats, threads, chunk_bytes, results),
        nprocs=world_size, join=True, start_method="spawn",
    )
    return results.get()  # type: ignore[no-any-return]


def decode_step_ms(model: str, batch: int, prompt_len: int, num_steps: int) -> float:
    """Median wall time of a decode-only ``engine.step()`` with ``batch`` requests in flight."""
    from distserve.config import SamplingParams
    from distserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(model, dtype="float32")
    gen = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    ids = {
        engine.add_request(torch.randint(10, engine.model_config.vocab_size, (prompt_len,), generator=gen).tolist(), sp)
        for _ in range(batch)
    }
    started: set[str] = set()
    while started != ids:  # prefill every request first, so the timed steps are decode-only
        started.update(out.request_id for out in engine.step() if out.token_ids)
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == batch, "a timed step was not a full decode batch"
    return statistics.median(times) * 1e3


def write_outputs(out: Outputs, rows: list[dict[str, Any]], figures: dict[str, Any]) -> None:
    out.json({"figures": figures, "rows": rows})
    md = [
        f"KV migration over gloo on 127.0.0.1, SmolLM2-135M KV shape (fp32), {figures['threads']} torch thread(s) "
        f"per process, median of {figures['repeats']}. Chunked = slices of >= 2 x {figures['chunk_mb']:g} MiB sent "
        "as layer pieces; ratio = raw time / migration time.",
        "",
        "| case | tokens | MB | msgs (chunked) | chunked ms | 1 msg/slice ms | raw ms | chunked GB/s | raw GB/s "
        "| ratio chunked | ratio 1 msg/slice | chunked / decode step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['case']} | {r['num_tokens']} | {r['num_bytes'] / 1e6:.1f} | {r['num_messages_chunked']} | "
        f"{r['chunked_s'] * 1e3:.1f} | {r['one_msg_per_slice_s'] * 1e3:.1f} | {r['raw_s'] * 1e3:.1f} | "
        f"{r['chunked_gbps']:.2f} | {r['raw_gbps']:.2f} | {r['ratio_chunked']:.2f} | "
        f"{r['ratio_one_msg_per_slice']:.2f} | {r['migration_over_decode_step']:.2f} |"
        for r in rows
    ]
    md.append("\nCores kept busy by other processes meanwhile: " + ", ".join(
        f"{k.removeprefix('other_processes_busy_cores_')} {v}" for k, v in figures.items()
        if k.startswith("other_processes_busy_cores_")))
    md.append(f"\nOne decode step ({figures['decode_model']}, batch {figures['decode_batch']}, prompt "
              f"{figures['decode_prompt_len']} tokens): {figures['decode_step_ms']:.1f} ms")
    out.markdown(md)

    fig, ax = harness.pyplot().subplots(figsize=(8, 4.8))
    styles = {"chunked": "o-", "one_msg_per_slice": "^:", "raw": "s--"}
    for i, case in enumerate(CASES):
        case_rows = [r for r in rows if r["case"] == case]
        if not case_rows:
            continue
        x = [r["num_tokens"] for r in case_rows]
        for mode, style in styles.items():
            label = {"chunked": "send_kv/recv_kv", "one_msg_per_slice": "send_kv/recv_kv, 1 msg/slice",
                     "raw": "raw dist.send/recv"}[mode]
            ax.plot(x, [r[f"{mode}_gbps"] for r in case_rows], style, color=f"C{i}", label=f"{label} ({case})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request length (tokens)")
    ax.set_ylabel("GB/s")
    ax.set_title("KV migration over gloo, 127.0.0.1 (SmolLM2-135M KV shape, fp32)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.png(fig)


def main() -> None:
    ap = harness.parser(__doc__, "lengths 256 and 1024, tiny model, 3 repeats")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="request lengths in tokens")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--repeats", type=positive_int, default=7)
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads per transfer process")
    ap.add_argument("--chunk-mb", type=non_negative_float, default=DEFAULT_CHUNK_BYTES / (1 << 20),
                    help="layer-piece size for big slices in MiB (0: one message per slice)")
    ap.add_argument("--model", default="smollm2-135m", help="engine for the decode-step timing")
    ap.add_argument("--decode-batch", type=positive_int, default=16)
    ap.add_argument("--decode-prompt-len", type=positive_int, default=256)
    ap.add_argument("--decode-steps", type=positive_int, default=10)
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.repeats, args.model, args.decode_prompt_len, args.decode_steps = "256,1024", 3, "tiny", 64, 5
    lengths = [int(x) for x in args.lengths.split(",") if x]
    chunk_bytes = int(args.chunk_mb * (1 << 20)) or None

    rows: list[dict[str, Any]] = []
    other_cores: dict[str, float] = {}
    for case in args.cases.split(","):
        if case not in CASES:
            ap.error(f"unknown case {case!r}; choose from {', '.join(CASES)}")
        # Others' cores: a noise indicator (loopback traffic's kernel time outside our processes counts too: ~0.2 idle).
        case_rows, other_cores[case] = harness.watched(lambda: run_case(case, lengths, args.repeats, args.threads, chunk_bytes))
        rows += case_rows
    step_ms = decode_step_ms(args.model, args.decode_batch, args.decode_prompt_len, args.decode_steps)
    for r in rows:
        for mode in MODES:
            r[f"{mode}_gbps"] = r["num_bytes"] / r[f"{mode}_s"] / 1e9
        r["ratio_chunked"] = r["raw_s"] / r["chunked_s"]
        r["ratio_one_msg_per_slice"] = r["raw_s"] / r["one_msg_per_slice_s"]
        r["migration_over_decode_step"] = r["chunked_s"] * 1e3 / step_ms

    figures: dict[str, Any] = {
        "kv_shape": SMOLLM2_KV, "lengths": lengths, "repeats": args.repeats, "threads": args.threads,
        "chunk_mb": args.chunk_mb, "decode_model": args.model, "decode_batch": args.decode_batch,
        "decode_prompt_len": args.decode_prompt_len, "decode_step_ms": round(step_ms, 2),
        "num_cpus": os.cpu_count(),
    }
    for case, cores in other_cores.items():  # > 0.3 means another job shared the cores: ratios are pessimistic
        figures[f"other_processes_busy_cores_{case}"] = round(cores, 2)
    for r in rows:
        key = f"{r['case']}_{r['num_tokens']}"
        figures[f"migration_ms_{key}"] = round(r["chunked_s"] * 1e3, 2)
        figures[f"migration_gbps_{key}"] = round(r["chunked_gbps"], 3)
        figures[f"raw_gbps_{key}"] = round(r["raw_gbps"], 3)
        figures[f"ratio_{key}"] = round(r["ratio_chunked"], 3)
        figures[f"ratio_one_msg_per_slice_{key}"] = round(r["ratio_one_msg_per_slice"], 3)
        figures[f"migration_over_decode_step_{key}"] = round(r["migration_over_decode_step"], 3)
    figures["median_ratio"] = round(statistics.median(r["ratio_chunked"] for r in rows), 3)
    figures["min_ratio"] = round(min(r["ratio_chunked"] for r in rows), 3)
    figures["median_ratio_one_msg_per_slice"] = round(statistics.median(r["ratio_one_msg_per_slice"] for r in rows), 3)

    print(f"{'case':<17} {'tokens':>6} {'MB':>6} {'msgs':>4} {'chunk ms':>8} {'1msg ms':>8} {'raw ms':>7} "
          f"{'GB/s':>5} {'raw GB/s':>8} {'ratio':>5} {'1msg':>5} {'/decode':>7}")
    for r in rows:
        print(f"{r['case']:<17} {r['num_tokens']:>6} {r['num_bytes'] / 1e6:>6.1f} {r['num_messages_chunked']:>4} "
              f"{r['chunked_s'] * 1e3:>8.1f} {r['one_msg_per_slice_s'] * 1e3:>8.1f} {r['raw_s'] * 1e3:>7.1f} "
              f"{r['chunked_gbps']:>5.2f} {r['raw_gbps']:>8.2f} {r['ratio_chunked']:>5.2f} "
              f"{r['ratio_one_msg_per_slice']:>5.2f} {r['migration_over_decode_step']:>7.2f}")
    print("cores kept busy by other processes during the transfers:", other_cores)
    print(f"decode step ({args.model}, batch {args.decode_batch}, prompt {args.decode_prompt_len}): {step_ms:.1f} ms")
    write_outputs(Outputs.for_run(args, "bench_kv_migration"), rows, figures)
    harness.finish(figures)


if __name__ == "__main__":
    main()
