"""Command line: argument handling only; every subcommand calls into the packages."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence as Seq

from distserve.errors import DistServeError


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
