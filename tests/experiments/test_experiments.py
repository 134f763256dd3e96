"""Every script under experiments/ runs with --quick and ends with one JSON object of figures;
the modules they share (no ``__main__``) are imported, never run, and a quick run without
--out-dir leaves experiments/results/ alone."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from script_runner import run_script

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration  # runs each script as a process

MODULES = sorted((ROOT / "experiments").glob("*.py"))
SCRIPTS = [p for p in MODULES if 'if __name__ == "__main__":' in p.read_text()]
SHARED = {p.stem for p in MODULES} - {p.stem for p in SCRIPTS}
# Scripts whose quick run has a test of its own (with every check of the generic one): run once, there.
OWN_TEST = {"validate_cascade_latency", "distserve_table", "validate_simulator", "validate_planner"}
GENERIC = [p for p in SCRIPTS if p.stem not in OWN_TEST]

# Figures a quick run must get right regardless of machine speed.
CHECKS = {
    # Both decode-attention backends timed on the same batch and agreeing; exact reads no more than
    # padded; whole-model steps at three context mixes give the same greedy tokens either way. Cascade
    # timed against exact and padded on every grid batch (one-level and a two-level tree), agreeing with
    # exact and reading less KV, each batch marked with the derived rule's decision; the exact/cascade
    # whole-model step gives the same greedy tokens as exact.
    "bench_attention": lambda f: f["padded_ms"] > 0 and f["exact_ms"] > 0 and f["max_abs_diff"] < 1e-2
    and 1.0 <= f["bytes_ratio_exact"] <= f["bytes_ratio_padded"] and f["default_decode_attention"] == "cascade"
    and f["cascade_ms_headline"] > 0 and f["exact_ms_headline"] > 0 and f["cascade_speedup_headline"] > 0
    and f["cascade_kv_read_ratio_headline"] > 1 and f["cascade_speedup_tree"] > 0 and f["cascade_max_abs_diff"] < 1e-2
    and len(f["cascade_grid"]) == 10 and all(g["rule"] in ("cascade", "exact") and g["kv_read_ratio"] > 1
                                             for g in f["cascade_grid"].values())
    and f["cascade_rule_min_saved_tokens"] > 0 and 0 <= f["cascade_rule_right"] <= 1 and f["step_speedup_cascade"] > 0 and f["step_cascade_planned"]
    and len(f["model_step"]) == 4 and all(r["greedy_same"] == 1.0 for r in f["model_step"].values()),
    # Issue 20: every request of every row accounted for: none lost or hung, no KV block left in use; each fault's wave
    # completed with the greedy reference and new requests succeeded after it (a killed controller is redeployed and
    # its requests re-run); prompts over the cache preempt and still complete identical; the oversized prompt is a 400;
    # the storm's clients all left; overload's refusals are 429s with Retry-After; shutdown refused new connections and
    # left no process.
    "chaos": lambda f: f["quick"] and f["total_lost"] == 0 and f["total_hung"] == 0 and f["total_blocks_leaked"] == 0
    and all((r := f["rows"][k])["identical"] == r["sent"] and r["new_requests_ok"]
            for k in ("fault-free", "kill decode-worker", "kill controller", "KV exhaustion: prompts together > cache", "soak 70%"))
    and f["rows"]["kill controller"]["recovery_s"] > 0 and f["rows"]["KV exhaustion: one prompt > cache"]["refused_at_admission"]
    and f["rows"]["KV exhaustion: prompts together > cache"]["preemptions"] > 0
    and f["rows"]["disconnect storm"]["disconnected"] == f["rows"]["disconnect storm"]["sent"] > 0
    and (o := f["rows"]["overload 10x"])["admitted"] + o["rejected_429"] + o["programs_refused"] == o["sent"]
    and o["rejected_with_retry_after"] == o["rejected_429"] and all(r["processes_left"] == 0 for r in f["restarts"])
    and (g := f["rows"]["graceful shutdown"])["processes_left"] == 0 and g["new_request_refused"] and g["exit_code"] == 0,
    # Both connection modes measured on the same server, every figure positive, the server stopped with nothing left.
    "bench_keepalive": lambda f: f["quick"] and f["processes_left"] == 0
    and all(f["p50_s"][m][k] > 0 for m in ("fresh", "keep-alive") for k in ("ttft_s", "non_stream_s"))
    and set(f["keepalive_over_fresh"]) == {"ttft_s", "max_gap_s", "non_stream_s"},
    # Both detokenizers timed on the tiny tokenizer (each checked against decode() by the script).
    "bench_detokenizer": lambda f: f["quick"] and all(r["decode_stream"] > 0 and r["window"] > 0 and r["num_tokens"] > 0
                                                      for r in f["tokenizers"].values()) and "tiny" in f["tokenizers"],
    "bench_engine": lambda f: f["greedy_same_as_hf_float32"] == 1.0 and f["ours_tok_s_batch_float32"] > 0,
    # Both grammar backends compiled and replayed every case and ran the real engine to the same token count;
    # every answer of the default backend (llguidance) under a bounded schema parsed and validated (the tiny
    # model's noise: xgrammar lets raw control characters into its JSON strings, which JSON forbids).
    "bench_structured_output": lambda f: f["backends"] == ["llguidance", "xgrammar"] and f["default_backend"] == "llguidance"
    and all(len(f[f"{b}_compile_ms"]) == 9 and all(v > 0 for v in f[f"{b}_mask_us_mean"].values()) and f[f"{b}_setup_s"] > 0
            and 0 <= f[f"e2e_{b}_num_valid"] <= f["e2e_num_prompts"] and f[f"e2e_{b}_tok_s"] > 0
            and f[f"e2e_{b}_num_tokens"] == f["e2e_unconstrained_num_tokens"] for b in f["backends"])
    and f["e2e_llguidance_num_valid"] == f["e2e_num_prompts"] and f["e2e_unconstrained_tok_s"] > 0,
    # Every deployment simulated every request to the end and measured a speed; the JSON says which latency model.
    "bench_simulator": lambda f: f["target_requests_per_s"] == 10_000 and all(
        f[f"{d}_num_completed"] == f[f"{d}_num_requests"] == f["num_requests"]
        and f[f"{d}_num_token_steps"] >= f["num_requests"] and f[f"{d}_requests_per_s"] > 0
        and f[f"{d}_parallel_jobs"] == 2 and f[f"{d}_parallel_requests_per_s"] > 0
        for d in ("1p1d", "4p2d", "colocated1")
    ) and f["latency_model"].startswith("FittedLatencyModel" if f["profile_used"] else "RooflineLatencyModel"),
    # Both servers answered every request with exactly output_len tokens, and left no process (Ray's included).
    "bench_disagg": lambda f: f["ttft_slo_s"] > 0 and f["tpot_slo_s"] > 0 and all(
        f[f"{s}_num_completed"] == f[f"{s}_num_requests"] == f["num_requests"] * len(f["rates"])
        and f[f"{s}_num_errors"] == 0
        and f[f"{s}_mean_output_tokens"] == f["output_len"]
        and f[f"{s}_processes_left"] == 0
        and f[f"{s}_single_ttft_s"] > 0 and f[f"{s}_single_tpot_s"] > 0
        and 0.0 <= f[f"{s}_max_attainment"] <= 1.0 and f[f"{s}_goodput_rps"] >= 0.0
        for s in ("colocated", "disagg")
    ),
    # Quick: our colocated server only (vLLM needs `make peers` and SmolLM2): both workloads searched,
    # every request answered in full, its single-stream latency measured, and no process left behind.
    "bench_serving": lambda f: f["quick"] and set(f["servers"]) == {"colocated"} and f["num_errors"] == 0
    and f["servers"]["colocated"]["processes_left"] == 0 and "skipped" in f["crosscheck"]
    and all(
        (g := f["servers"]["colocated"]["goodput"][w])["num_probes"] >= 1 and g["goodput_rps"] >= 0
        and g["num_completed"] + g["num_cancelled"] == g["num_requests"]
        and g["min_mean_output_tokens"] == g["max_mean_output_tokens"] == spec["output_len"]
        and f["servers"]["colocated"]["single"][w]["tpot_s"] > 0
        for w, spec in f["workloads"].items()
    ) and set(f["workloads"]) == {"short", "long"},
    # Every app ran both ways at both delays, each with a latency and a ratio; the prefill counters are
    # numbers or, where the server does not export them, null; no server process left behind.
    "bench_apps": lambda f: f["quick"] and f["processes_left"] == 0 and f["delays_ms"] == [0, 250]
    and set(f["apps"]) == {"chain", "map_reduce", "multi_agent", "copilot", "mixed"} and all(
        set(by_delay) == {"0", "250"} and all(
            c["ratio"] > 0 and all(c[w]["latency_s"] > 0 and c[w]["num_runs"] == 1 for w in ("request_centric", "dataflow"))
            and all(c[w][k] is None or c[w][k] >= 0 for w in ("request_centric", "dataflow")
                    for k in ("prefill_computed", "prefix_reused"))
            for c in by_delay.values())
        for by_delay in f["apps"].values()
    ) and f["apps"]["chain"]["250"]["request_centric"]["latency_s"] >= 0.25 * 3,
    # Both systems at three rates, every latency measured and predicted, errors computed.
    "validate_simulator": lambda f: len(f["rows"]) == 6
    and all(r[f"{w}_{k}"] > 0 for r in f["rows"] for w in ("measured", "predicted") for k in ("ttft_p90_s", "tpot_p90_s"))
    and 0 <= f["max_abs_p90_error"] < 100 and set(f["runtime_overhead_s_per_step"]) == {"colocated", "1p1d"},
    # Both kinds found a goodput, DistServe's layout was simulated at 3 and 4 GPUs, and the JSON
    # says which latency model was used (the roofline when /work/shared is absent).
    "reproduce_distserve": lambda f: f["num_candidates"] >= 3 and f["distserve_reported_per_gpu"] == 1.56
    and f["best_disagg"]["per_gpu"] > 0 and f["best_colocated"]["per_gpu"] > 0 and f["ratio"] > 0
    and [f["ours_for_distserve_placement"][k]["num_gpus"] for k in ("distserve_3gpu", "distserve_4gpu")] == [3, 4]
    and f["latency_model"].startswith("FittedLatencyModel" if f["profile_used"] else "RooflineLatencyModel"),
    # Siblings submitted together computed their shared prefix once with sharing on, more often with
    # it off, and produced the same greedy tokens either way, in both engines at every budget.
    "bench_prefix_sharing": lambda f: f["budgets"] and all(
        f[f"{c}_on_prefill_tokens_computed"] == f["prefix_len"] + f["num_siblings"] * f["suffix_len"]
        and f[f"{c}_on_prefix_cache_hit_tokens"] == (f["num_siblings"] - 1) * f["prefix_len"]
        and f[f"{c}_off_prefill_tokens_computed"] >= f[f"{c}_on_prefill_tokens_computed"] + f["prefix_len"]
        and f[f"{c}_greedy_same"] and f[f"{c}_on_all_prefills_s"] > 0 and f[f"{c}_off_all_prefills_s"] > 0
        for c in (f"{e}_b{b}" for e in ("colocated", "disagg") for b in f["budgets"])
    ),
    # Every scenario ran against both policies' servers with no failed request, every ratio was
    # measured, the simulator predicted both flood scenarios, and no server process was left.
    "bench_fairness": lambda f: f["quick"] and f["num_errors"] == 0 and f["processes_left"] == 0
    and all(f[k] is not None and f[k] > 0 for k in ("light_fcfs_over_alone", "light_fair_over_alone", "throughput_fair_over_fcfs",
                                                    "interactive_with_batch_over_alone"))
    and f["sim_light_p99_ttft_fcfs_s"] > 0 and f["sim_light_p99_ttft_fair_s"] > 0,
    # Both simulated targets found a goodput in each attainment mode with a binding SLO; the SLO-scale
    # sweep ran at the lowest joint goodput per GPU and found each a tightest scale; ratios are to the first.
    "slo_sweep": lambda f: f["sweeps"] == ["rate", "slo-scale"] and f["modes"] == ["joint", "separate"]
    and set(f["systems"]) == {"colocated", "1p1d"} and all(
        s["kind"] == "simulated" and s["num_gpus"] == 2 and all(s["per_gpu"][m] > 0 and s["binding"][m] in ("ttft", "tpot", "both")
                                                                and 0 < s["min_slo_scale"][m] < 4 for m in f["modes"])
        and s["scale_rate_per_gpu"] == min(x["per_gpu"]["joint"] for x in f["systems"].values())
        for s in f["systems"].values()
    ) and f["vs_first"]["first"] == "colocated" and f["vs_first"]["colocated"]["joint"] == 1.0
    and f["latency_model"].startswith("FittedLatencyModel" if f["profile"] else "RooflineLatencyModel"),
    # Quick: our colocated and in-process 1P1D servers (vLLM stays out of the suite) on the tiny model; the
    # planner's verdict from this machine's profile; each server searched a goodput, then ran once more at it
    # with every request of that run in its --request-log, whose breakdown adds up to E2E (1P1D with a KV
    # migration, colocated without); no server process left behind.
    "slo_sweep_real": lambda f: f["quick"] and f["systems"] == ["colocated", "1p1d"] and f["num_processes_left"] == 0
    and all(w["plan"]["predicted_winner"] in ("colocated", "disaggregated") and w["plan"]["colocated"]["predicted_rps"] > 0
            and w["plan"]["disaggregated"]["predicted_rps"] > 0 and w["measured_winner"] in ("colocated", "disaggregated", "tie")
            for w in f["workloads"].values())
    and all((r := f["results"][s][w])["goodput_rps"] > 0 and (b := r["breakdown"])["num_requests"] == f["probe_requests"][w]
            and abs(sum(b[p] or 0.0 for p in ("queue_s", "prefill_s", "migration_queue_s", "migration_s", "decode_s")) - b["e2e_s"]) < 1e-3
            and b["prefill_s"] > 0 and b["decode_s"] > 0 and (b["migration_s"] is None) == (s == "colocated")
            for s in f["systems"] for w in f["workloads"]),
    # Hostile input (issue 20): every route family got its generated requests with no 5xx and no hang, every limit
    # probe was answered as expected while a plain client kept being served, and afterwards the server served, was
    # healthy and, idle, held no request and no KV block; no server process left.
    "fuzz_report": lambda f: f["quick"] and len(f["families"]) == 6 and f["min_family_requests"] >= f["per_family"]
    and f["total_5xx"] == 0 and f["total_hangs"] == 0 and f["num_probes_ok"] == f["num_probes"] == 10
    and f["plain_failed_during_probes"] == 0 and f["served_after"] and f["healthy_after"] and f["idle_all_free"]
    and f["processes_left"] == 0,
    # Each system's best fit replays its traces at least as well as the best with the profile's prompt steps unscaled
    # (a grid point of the same search), and better than no overhead at all.
    "align_real_traces": lambda f: f["quick"] and set(f["systems"]) == {"vllm", "distserve"} and all(
        r["best_prefill_scale"] in (0.8, 1.0) and r["best_error"] <= r["unscaled"]["error"] <= r["error_at_0"] and r["best"]
        for r in f["systems"].values()),
    # Every run chose a plan, and every enumerated candidate was either simulated or pruned; 2 workers searched as 1.
    # Candidate order never changes the plan; with the best candidates first (the oracle) fewer probes.
    # The fit meets vLLM PR #2221's ShareGPT figures it was fitted to (both forms), is checked on the other benchmark
    # both ways, and names the form that checks better.
    "fit_ray_control_plane": lambda f: f["quick"] and f["tp"] == 8 and all(
        abs(f["checks"]["sharegpt"][k] / f["checks"]["sharegpt"][p] - 1) < 0.1
        for k, p in (("after", "published_after"), ("before (per step)", "published_before"), ("before (per sequence)", "published_before"),
                     ("before (measured shape)", "published_before")))
    and set(f["checks"]) == {"sharegpt", "fixed/512-prompts", "fixed/512-seqs"} and f["better_form"] in f["validation_error"]
    and f["ray_step_ms_per_worker"] > 0 and f["ray_seq_ms_per_worker"] > 0 and f["engine_seq_ms"] > 0,
    # v0.2.3's step over real Ray actors: the driver's median step time grows with the sequences (16 vs 1) at each
    # worker count and with the workers (2 vs 1) at each batch; the fixed cost per call is positive; no Ray process left.
    "bench_ray_step_calls": lambda f: f["quick"] and f["ray_processes_left"] == 0 and f["a_ms"] > 0
    and all((m := f["median_ms"])[f"W{w} N16 L200"] > m[f"W{w} N1 L200"] for w in (1, 2))
    and all(m[f"W2 N{n} L200"] > m[f"W1 N{n} L200"] for n in (1, 16)) and all(t["k"] > 0 for t in f["translation"].values()),
    "planner_order": lambda f: f["all_same_plan"] and all(r["best_first_probes"] < r["bound_order_probes"] for r in f["rows"]),
    "bench_planner": lambda f: f["wall_s"] > 0 and f["num_simulated"] > 0 and f["best"] is not None and f["identical_across_workers"] and all(
        r["num_enumerated"] == r["num_candidates_simulated"] + r["num_pruned_by_bound"] + r["num_pruned_by_floor"]
        and r["best"] is not None for r in f["runs"]
    ),
    # A plan was deployed and measured at >= 3 rates, every request answered; both overheads calibrated.
    "validate_planner": lambda f: f["feasible"] and f["predicted_goodput_rps"] > 0 and f["measured_goodput_rps"] > 0
    and len(f["rows"]) >= 3 and all(r["num_requests"] == f["num_requests_per_rate"] and 0 <= r["measured_attainment"] <= 1
                                    for r in f["rows"])
    and set(f["runtime_overhead_s_per_step"]) == {"colocated", "disaggregated"},
}


def test_there_are_experiments() -> None:
    assert SCRIPTS and "harness" in SHARED


@pytest.mark.parametrize("module", MODULES, ids=[p.stem for p in MODULES])
def test_imports_only_shared_modules(module: Path) -> None:
    """No ``sys.path`` edits, and no script imports another script (only the shared modules)."""
    scripts = {p.stem for p in SCRIPTS}
    for node in ast.walk(ast.parse(module.read_text())):
        assert not (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"), f"{module.name} uses sys.path"
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not scripts & {n.split(".")[0] for n in names}, f"{module.name} imports a script: {names}"


def _harness() -> ModuleType:
    """experiments/harness.py, imported by path (the scripts import it from their own folder)."""
    spec = importlib.util.spec_from_file_location("experiments_harness", ROOT / "experiments" / "harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_to_a_temporary_directory(tmp_path: Path) -> None:
    harness = _harness()
    quick = harness.Outputs.for_run(argparse.Namespace(quick=True, out_dir=None), "bench_x")
    assert quick.out_dir.is_dir() and harness.RESULTS_DIR not in (quick.out_dir, *quick.out_dir.parents)
    assert quick.path(".json").name == "bench_x_quick.json"
    quick.out_dir.rmdir()
    given = harness.Outputs.for_run(argparse.Namespace(quick=True, out_dir=str(tmp_path / "o")), "bench_x")
    assert given.out_dir == tmp_path / "o" and given.out_dir.is_dir()
    full = harness.Outputs.for_run(argparse.Namespace(quick=False, out_dir=None), "bench_x")  # creates nothing: results/ exists
    assert full.path(".md") == ROOT / "experiments" / "results" / "bench_x.md"
    tagged = harness.Outputs.for_run(argparse.Namespace(quick=False, out_dir=str(tmp_path)), "bench_x", tag="t")
    assert tagged.path(".png") == tmp_path / "bench_x_t.png"


def quick_run(script: Path, out_dir: Path, *extra: str) -> dict[str, Any]:
    """Run ``script --quick --out-dir out_dir [extra]`` (a process forked from the warm ``script_runner``); it must exit 0
    and end with one non-empty JSON object."""
    proc = run_script([sys.executable, str(script), "--quick", "--out-dir", str(out_dir), *extra], cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict) and figures
    return figures  # type: ignore[no-any-return]


def test_bench_apps_figures_quick(tmp_path: Path) -> None:
    """Parrot's figures (``bench_apps.py --figures``): every point of each sweep measured both ways
    with its ratio, the PNG written; ``slo_sweep.py --render-apps`` redraws it from the JSON."""
    f = quick_run(ROOT / "experiments" / "bench_apps.py", tmp_path, "--figures")
    assert f["processes_left"] == 0 and set(f["figures"]) == {"chain", "multi_agent", "copilot"}
    assert {app: list(fig["points"]) for app, fig in f["figures"].items()} == {"chain": ["4", "8"], "multi_agent": ["1", "2"], "copilot": ["2", "4"]}
    for fig in f["figures"].values():
        for c in fig["points"].values():
            assert c["request_centric"] > 0 and c["dataflow"] > 0 and c["ratio"] == pytest.approx(c["request_centric"] / c["dataflow"], abs=1e-3)
    rows = json.loads((tmp_path / "bench_apps_figures_quick.json").read_text())["rows"]
    agents = [r for r in rows if r["app"] == "multi_agent"]
    assert [r["num_outputs"] for r in agents] == [1, 1, 2, 2]  # one review per program at once, both ways
    png = tmp_path / "bench_apps_figures_quick.png"
    png.unlink()
    drawn = run_script([sys.executable, str(ROOT / "experiments" / "slo_sweep.py"), "--render-apps", str(png.with_suffix(".json"))],
                       cwd=ROOT, timeout=120)
    assert drawn.returncode == 0 and png.stat().st_size > 0, drawn.stderr[-2000:]


def test_every_script_has_a_quick_run_test() -> None:
    assert OWN_TEST <= {p.stem for p in SCRIPTS} and "test_validate_cascade_latency_quick" in globals()
    assert "test_validations_quick_share_one_profile" in globals()
    assert (ROOT / "tests" / "experiments" / "test_distserve_table.py").exists()  # its quick run, JSON last line included


# A bad number per kind of check: the flag's type (``distserve.cli.arg_types``, also in ``harness.add_quiet_args``
# and ``validation.add_profile_args``) or the script's own check of flags that must relate.
BAD_NUMBERS = [
    ("bench_engine", ["--num-prompts", "-5"], r"argument --num-prompts: must be >= 1"),
    ("bench_detokenizer", ["--repeats", "0"], r"argument --repeats: must be >= 1"),
    ("bench_fairness", ["--duration", "nan"], r"argument --duration: must be a finite number > 0"),
    ("bench_kv_migration", ["--chunk-mb", "-1"], r"argument --chunk-mb: must be a finite number >= 0"),
    ("bench_prefix_sharing", ["--retries", "-1"], r"argument --retries: must be >= 0"),
    ("bench_row_padding", ["--num-requests", "1"], r"--num-requests must be >= 2"),
    ("bench_attention", ["--min-ctx", "500", "--max-ctx", "100"], r"--max-ctx must be >= --min-ctx"),
    ("bench_apps", ["--delays-ms", "0,-5"], r"--delays-ms: each delay must be a finite number >= 0"),
    ("chaos", ["--tpot-share", "1.5"], r"argument --tpot-share: must be in \(0, 1\]"),
    ("chaos", ["--queue-share", "1"], r"--queue-share must be in \(0, 1\)"),
    ("fuzz_report", ["--per-family", "0"], r"argument --per-family: must be >= 1"),
    ("validate_simulator", ["--concurrent-slowdown", "0.5"], r"argument --concurrent-slowdown: must be a finite number >= 1"),
]


@pytest.mark.parametrize(("script", "argv", "message"), BAD_NUMBERS, ids=[f"{s}{a[-2]}" for s, a, _ in BAD_NUMBERS])
def test_bad_numbers_exit_2_naming_the_flag(script: str, argv: list[str], message: str, tmp_path: Path) -> None:
    """A bad number is refused before anything runs: exit 2, argparse's message naming the flag, nothing written."""
    proc = run_script([sys.executable, str(ROOT / "experiments" / f"{script}.py"), "--out-dir", str(tmp_path / "out"), *argv],
                      cwd=ROOT, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(f"{script}.py: error: {message}", proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", GENERIC, ids=[s.stem for s in GENERIC])
def test_quick_run_prints_json_last(script: Path, tmp_path: Path) -> None:
    figures = quick_run(script, tmp_path)
    check = CHECKS.get(script.stem)
    assert check is None or check(figures), json.dumps(figures)[:6000]  # in full: a flaky failure must say what it saw


def test_validations_quick_share_one_profile(tmp_path: Path) -> None:
    """``validate_simulator.py --quick``, then ``validate_planner.py --quick`` on the profile it measured and saved
    (``--profile``): both validations of the real engine, the engine profiled once (the same ``make_profile``)."""
    simulator = quick_run(ROOT / "experiments" / "validate_simulator.py", tmp_path / "simulator")
    assert CHECKS["validate_simulator"](simulator), simulator
    profile = tmp_path / "simulator" / "validate_simulator_quick_profile.json"
    assert json.loads(profile.read_text())["meta"]["quick"]
    planner = quick_run(ROOT / "experiments" / "validate_planner.py", tmp_path / "planner", "--profile", str(profile))
    assert CHECKS["validate_planner"](planner), planner


def test_validate_cascade_latency_quick(tmp_path: Path) -> None:
    """Measured cascade and exact steps of shared-prefix batches, each with a prediction with and
    without the shared term; the term removes the KV a cascade does not read, so it predicts less."""
    f = quick_run(ROOT / "experiments" / "validate_cascade_latency.py", tmp_path)
    assert f["cases"] == [[4, 1024], [8, 1024]] and f["profile_decode_attention"] == "sum"
    for key in ("cascade_error_with_term", "cascade_error_without_term", "cascade_error_with_fitted_fraction", "exact_error"):
        assert 0 <= f[key]["median"] <= f[key]["max"], key
    assert 0 <= f["cascade_shared_fraction_fit"] <= 1 and all(s > 0 for s in f["speedup"].values())
    rows = json.loads((tmp_path / "validate_cascade_latency_quick.json").read_text())["rows"]
    assert len(rows) == 2 and all(
        r["shared_saved"] == (r["num_requests"] - 1) * r["prefix_len"] and r["shared_nodes"] == 1
        and r["predicted_cascade_ms"] < r["predicted_sum_ms"] and r["cascade_ms"] > 0 and r["exact_ms"] > 0
        for r in rows
    )
