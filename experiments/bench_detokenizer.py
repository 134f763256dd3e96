"""Per-token cost of incremental detokenization: the tokenizers library's ``DecodeStream`` (what fast
tokenizers use) against the windowed ``decode`` detokenizer (kept for slow tokenizers).

Each detokenizer turns the same output (mixed scripts, emoji, multi-byte characters) into text after a
prompt; both must produce exactly ``decode(output)``. Reported: the best of ``--repeats`` runs, in
microseconds per token.

    python experiments/bench_detokenizer.py            # tiny and SmolLM2-135M tokenizers
    python experiments/bench_detokenizer.py --quick    # the tiny tokenizer, a short text
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import harness
from distserve.cli.arg_types import positive_int

from distserve.engine.detokenizer import DecodeStreamDetokenizer, Detokenizer, WindowDetokenizer
from distserve.engine.tokenizer import Tokenizer
from distserve.engine.tiny_model import build_tiny_tokenizer
from distserve.engine.weights import resolve_model_dir

TEXT = "Hello wörld! 日本語のテキスト 🎉🚀 Ελληνικά — naïve café. The quick brown fox jumps over the lazy dog. "
KINDS: dict[str, type[Detokenizer]] = {"decode_stream": DecodeStreamDetokenizer, "window": WindowDetokenizer}


def us_per_token(kind: type[Detokenizer], tokenizer: Tokenizer, prompt: list[int], output: list[int], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        detok = kind(tokenizer, prompt)
        t0 = time.perf_counter()
        for token in output:
            detok.push(token)
        detok.flush()
        best = min(best, (time.perf_counter() - t0) / len(output))
        if detok.text != tokenizer.decode(output):
            raise SystemExit(f"{kind.__name__} produced different text than decode()")
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--copies", type=positive_int, default=40, help="copies of the sample text in the output")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.copies = 2, 4
    out = harness.Outputs.for_run(args, "bench_detokenizer")
    tokenizers = {"tiny": build_tiny_tokenizer()}
    model_dir = None if args.quick else resolve_model_dir("smollm2-135m")
    if model_dir is not None:
        tokenizers["smollm2-135m"] = Tokenizer.from_pretrained(model_dir)
    figures: dict[str, Any] = {"quick": args.quick, "repeats": args.repeats, "tokenizers": {}}
    rows = []
    for name, tokenizer in tokenizers.items():
        output = tokenizer.encode(TEXT * args.copies, add_special_tokens=False)
        prompt = tokenizer.encode("a prompt to continue " * 10)
        res = {kind: round(us_per_token(cls, tokenizer, prompt, output, args.repeats), 3) for kind, cls in KINDS.items()}
        res["num_tokens"] = len(output)
        res["speedup"] = round(res["window"] / res["decode_stream"], 2)
        figures["tokenizers"][name] = res
        rows.append([name, str(len(output)), f"{res['window']:.2f}", f"{res['decode_stream']:.2f}", f"{res['speedup']:.1f}x"])
    columns = ["tokenizer", "tokens", "window (us/token)", "DecodeStream (us/token)", "speedup"]
    harness.rich_table("incremental detokenization, best of runs", columns, rows, left=("tokenizer",))
    out.json(figures)
    out.markdown(["# Incremental detokenization per token", "", "| " + " | ".join(columns) + " |",
                  "|" + "---|" * len(columns), *("| " + " | ".join(r) + " |" for r in rows)])
    harness.finish(figures)


if __name__ == "__main__":
    main()
