"""Hostile input against a real `distserve serve` (tiny model): property-based fuzzing of every route family, the
request-limit probes, then whether the server still serves and has freed every KV block (issue 20).

Families (``fuzzing.py``): OpenAI completions, chat, the semantic-variable API, structured-output specs, the
operational routes (/tokenize, /detokenize, /v1/models, /health, /metrics, /version, /ping, unknown paths) and odd
headers; each gets at least ``--per-family`` generated requests (2,000; ``--quick``: 20), half of the schema
families' from schemathesis over /openapi.json, the rest from hypothesis strategies for what the schema cannot
describe. Every request has a deadline (``--deadline``); one that outlives it is a hang. The probes
(``hostile_probes.py``) send an oversized body, too many and too large headers, a slowloris head and body, a silent
connection, a lone surrogate and a TLS hello, while a plain client keeps asking. Afterwards: a plain completion
and /health must succeed, and once idle every instance must hold no request and no KV block (/metrics).

Writes ``fuzz_report.json`` and ``fuzz_report.md`` (``experiments/results/`` for a full run).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

import harness
from distserve.cli.arg_types import positive_float, positive_int
from fuzzing import FAMILIES, fuzz_server
from harness import Outputs
from hostile_probes import probes_json, run_probes

READ_TIMEOUT_S = 2.0  # the server's --request-read-timeout: short, so the slow-client probes end soon
KEEP_ALIVE_S = 2.0
MAX_BODY_BYTES = 8 * 1024 * 1024  # the default --max-request-body-bytes
IDLE_TIMEOUT_S = 120.0


def serve_flags(args: Any) -> list[str]:
    # A short context bounds what a generated request may ask for, so thousands of cases stay quick.
    return ["--runtime", args.runtime, "--max-model-len", "64", "--max-num-seqs", "4", "--threads", "1",
            "--request-read-timeout", str(READ_TIMEOUT_S), "--timeout-keep-alive", str(KEEP_ALIVE_S)]


def final_checks(root: str) -> dict[str, Any]:
    """Still serving, and once idle nothing held: no request in any instance, no KV block used."""
    from distserve.measure.benchserve import metric_sums

    with httpx.Client(base_url=root, timeout=60, trust_env=False) as http:
        plain = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        served = plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4
        healthy = http.get("/health").status_code == 200
    t0 = time.monotonic()
    sums: dict[str, float] | None = None
    while time.monotonic() - t0 < IDLE_TIMEOUT_S:
        sums = metric_sums(root, ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
        if sums is not None and sum(sums.values()) == 0:
            break
        time.sleep(0.5)
    return {"served_after": served, "healthy_after": healthy, "idle_all_free": sums is not None and sum(sums.values()) == 0,
            "idle_wait_s": round(time.monotonic() - t0, 1), "idle_metrics": sums}


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [f"Fuzzing `distserve serve --model tiny --runtime {report['runtime']}` (`experiments/fuzz_report.py`"
             f"{' --quick' if report['quick'] else ''}; {report['deadline_s']:g} s deadline per request, seed {report['seed']}).", "",
             "| route family | requests | 2xx | 4xx | 5xx | hangs | other | s |", "|---|---|---|---|---|---|---|---|"]
    for name, f in report["families"].items():
        other = f["num_requests"] - f["num_2xx"] - f["num_4xx"] - f["num_5xx"] - f["num_hangs"]
        lines.append(f"| {name} | {f['num_requests']} | {f['num_2xx']} | {f['num_4xx']} | {f['num_5xx']} | {f['num_hangs']} | {other} | {f['seconds']:.0f} |")
    t = report["totals"]
    lines.append(f"| **all** | {t['num_requests']} | {t['num_2xx']} | {t['num_4xx']} | {t['num_5xx']} | {t['num_hangs']} | | {t['seconds']:.0f} |")
    lines += ["", "| probe | expected | observed | ok | s |", "|---|---|---|---|---|"]
    lines += [f"| {p['name']} | {p['expected']} | {p['observed']} | {'yes' if p['ok'] else '**no**'} | {p['seconds']:.1f} |" for p in report["probes"]]
    d, c = report["during_probes"], report["checks"]
    lines += ["", f"During the probes a plain client got {d['num_plain_requests'] - d['num_plain_failed']}/{d['num_plain_requests']} "
              f"completions (slowest {d['plain_max_s']} s). Afterwards: plain completion {'served' if c['served_after'] else '**failed**'}, "
              f"/health {'200' if c['healthy_after'] else '**not 200**'}, idle with every KV block free: "
              f"{'yes' if c['idle_all_free'] else '**no**'} (after {c['idle_wait_s']} s); server processes left: {report['processes_left']}."]
    examples = [e for f in report["families"].values() for e in f["examples_5xx"]]
    if examples:
        lines += ["", "5xx examples:", *[f"- `{e[:300]}`" for e in examples[:10]]]
    return lines


def main() -> None:
    p = harness.parser(__doc__, "20 requests per family and the probes (about a minute)")
    p.add_argument("--runtime", choices=["local", "ray"], default="local")
    p.add_argument("--per-family", type=positive_int, default=None, help="generated requests per route family (default 2000; --quick 25)")
    p.add_argument("--deadline", type=positive_float, default=30.0, help="seconds a request may take before it counts as a hang")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    per_family = args.per_family or (20 if args.quick else 2000)
    out = Outputs.for_run(args, "fuzz_report", tag="" if args.runtime == "local" else args.runtime)
    from distserve.measure.benchserve import ServerProcess, distserve_serve_argv

    server = ServerProcess(f"distserve-{args.runtime}", distserve_serve_argv("tiny", "float32", serve_flags(args)), startup_timeout_s=300)
    server.start()
    root = server.base_url.removesuffix("/v1")
    try:
        t0 = time.monotonic()
        def progress(stage: str, so_far: dict[str, Any]) -> None:
            partial = {name: t.summary() for name, t in so_far.items()}
            out.json({"partial_after": stage, "families": partial}, suffix="_partial")
            print(f"{time.monotonic() - t0:.0f} s: {stage} done: " + ", ".join(
                f"{n} {f['num_requests']} ({f['num_5xx']} 5xx, {f['num_hangs']} hangs)" for n, f in partial.items()), flush=True)

        tallies = fuzz_server(root, per_family, args.deadline, args.seed, on_progress=progress)
        fuzz_s = time.monotonic() - t0
        probes, during = run_probes(root, MAX_BODY_BYTES, READ_TIMEOUT_S, KEEP_ALIVE_S)
        checks = final_checks(root)
    finally:
        stopped = harness.stop_server(server)
    families = {name: t.summary() for name, t in tallies.items()}
    totals = {k: sum(f[k] for f in families.values()) for k in ("num_requests", "num_2xx", "num_4xx", "num_5xx", "num_hangs")}
    totals["seconds"] = round(fuzz_s, 1)
    report = {"quick": args.quick, "runtime": args.runtime, "per_family": per_family, "deadline_s": args.deadline, "seed": args.seed,
              "families": families, "totals": totals, "probes": probes_json(probes), "during_probes": during, "checks": checks,
              "processes_left": stopped["processes_left"], "server_flags": serve_flags(args)}
    out.json(report)
    out.path("_partial.json").unlink(missing_ok=True)
    out.markdown(markdown(report))
    print("\n".join(markdown(report)), flush=True)
    harness.finish({
        "quick": args.quick, "runtime": args.runtime, "per_family": per_family, "families": sorted(families),
        "min_family_requests": min(f["num_requests"] for f in families.values()), "total_requests": totals["num_requests"],
        "total_5xx": totals["num_5xx"], "total_hangs": totals["num_hangs"], "num_probes": len(probes),
        "num_probes_ok": sum(p.ok for p in probes), "plain_failed_during_probes": during["num_plain_failed"],
        "served_after": checks["served_after"], "healthy_after": checks["healthy_after"], "idle_all_free": checks["idle_all_free"],
        "processes_left": stopped["processes_left"], "fuzz_s": totals["seconds"],
    })


if __name__ == "__main__":
    assert set(FAMILIES) == {"completions", "chat", "semantic", "structured", "ops", "headers"}
    main()
