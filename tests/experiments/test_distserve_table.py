"""``experiments/distserve_table.py --quick``: DistServe's reproduction table, two rows. The figures must be
consistent with each other and with the script's own rows (published ratios, layouts), whatever they are:
ratios are the quotients of the goodputs, "reproduced" follows the ±30% rule, the SLO-scale curves
re-scored from one run rise with the scale and cross the target at their reported minimum scale."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from experiment_modules import load_experiment
from script_runner import run_script

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


_load = load_experiment


for _shared in ("harness", "sweep_systems", "sweeper", "distserve_setting", "distserve_systems", "distserve_table_report"):
    _load(_shared)
setting = _load("distserve_setting")
systems = _load("distserve_systems")
report = _load("distserve_table_report")
table = _load("distserve_table")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("distserve_table")
    proc = run_script([sys.executable, str(ROOT / "experiments" / "distserve_table.py"), "--quick", "--out-dir", str(out)],
                      cwd=ROOT, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = json.loads((out / "distserve_table_quick.json").read_text())
    return figures, saved, out


def test_rows_and_ratios(quick: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    figures, saved, out = quick
    rows = {r.key: r for r in setting.ROWS}
    assert list(figures["rows"]) == list(table.QUICK_ROWS)
    assert figures["ablations"] == list(table.QUICK_ABLATIONS) and figures["mode"] == setting.MODE == "joint"  # DistServe's _plot.py
    for key, f in figures["rows"].items():
        row = rows[key]
        assert f["published"] == list(row.published)
        g = f["per_gpu"]
        assert set(g) == {"distserve", "planner-disagg", "vllm-2023", "colocated-mixed"}
        assert all(x >= 0 and math.isfinite(x) for x in g.values())
        assert g["distserve"] > 0 and g["vllm-2023"] > 0  # a trickle meets these SLOs on every layout
        assert f["ratio"] == pytest.approx(g["distserve"] / g["vllm-2023"], abs=1e-3)
        assert f["reproduced"] == report.within(f["ratio"], row.published)
        assert f["same_direction"] == (f["ratio"] > 1)
        assert f["ablation_ratios"]["baseline"] == f["ratio"]
        assert set(f["reproduced_by"]) <= set(f["ablation_ratios"])
        assert " + " in f["planner_disagg"] and "colocated" in f["planner_colocated"]
    assert figures["num_reproduced"] == sum(f["reproduced"] for f in figures["rows"].values())
    assert (out / "distserve_table_quick.md").read_text().count("| OPT-") == len(figures["rows"])
    assert (out / "distserve_table_quick.png").stat().st_size > 0 and (out / "distserve_table_quick_slo_scale.png").stat().st_size > 0


def test_layouts_and_engines(quick: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    """DistServe's layout and vLLM's TP are the launch script's; OPT-66B's vllm-steps ran on vLLM's own fit."""
    _, saved, _ = quick
    for r in saved["rows"]:
        vllm_tp, layout = setting.PARALLEL_PARAMS[r["model"]]
        assert r["vllm_tp"] == vllm_tp and r["distserve_layout"] == list(layout)
        assert r["num_gpus"]["distserve"] == layout[0] * layout[1] + layout[2] * layout[3]
        assert r["num_gpus"]["vllm-2023"] == vllm_tp
        assert r["plan"]["cluster"].startswith(f"{next(x for x in setting.ROWS if x.key == r['key']).plan_nodes} x 8")
        assert r["ablations"]["vllm-steps"]["vllm_engine"] == "vllm"  # both quick rows' models have vLLM coefficients
        assert "Fitted" in r["latency_model"]


def test_slo_scale_curves(quick: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    """Re-scored curves: attainment never falls as the SLOs loosen, and reaches the target exactly from the minimum scale on."""
    _, saved, _ = quick
    for r in saved["rows"]:
        assert r["scale_rate"] > 0
        for system, curve in r["slo_scale"].items():
            pts = sorted(curve["points"], key=lambda p: p["scale"])
            assert [p["scale"] for p in pts] == saved["figures"]["scales"]
            if not curve["rescored"]:
                continue
            for mode in ("separate", "joint"):
                values = [p[mode] for p in pts]
                assert all(0.0 <= v <= 1.0 for v in values)
                assert values == sorted(values), (r["key"], system, mode)
                m = curve["min_scale"][mode]
                for p in pts:
                    if p["scale"] >= m * (1 + 1e-9):
                        assert p[mode] >= 0.9 - 1e-9
                    elif p["scale"] < m * (1 - 1e-9):
                        assert p[mode] < 0.9
            assert r["min_slo_scale"][system] == curve["min_scale"][setting.MODE]


def test_within_band() -> None:
    assert report.within(2.0, (2.0, 4.6)) and report.within(1.5, (2.0, 4.6)) and report.within(5.9, (2.0, 4.6))
    assert not report.within(1.3, (2.0, 4.6)) and not report.within(6.1, (2.0, 4.6))
    assert report.within(4.0, (5.7, 5.7)) and not report.within(3.9, (5.7, 5.7)) and not report.within(None, (4.3, 4.3))
    assert not report.within(0.9, (0.5, 1.0))  # the wrong direction never counts


def test_short_runs_are_distserve_run_lengths() -> None:
    """``short-runs``: every search of the ablation is one of DistServe's runs (its figures' prompts per GPU), a seed each."""
    common = {"requests_per_gpu": 300, "seed": 7, "rel_tol": 0.03}
    row = next(r for r in setting.ROWS if r.key == "opt-66b-summarisation")
    for name in ("short-runs", "aligned+short-runs"):
        a = next(x for x in table.ABLATIONS if x.name == name)
        runs = table.runs_of(a, row, common)
        assert [n.split(table.RUN_SEP)[0] for n, _ in runs] == [name] * systems.SHORT_RUN_SEEDS
        assert {c["requests_per_gpu"] for _, c in runs} == {row.eval_prompts_per_gpu} and row.eval_prompts_per_gpu < 300
        assert [c["seed"] for _, c in runs] == list(range(7, 7 + systems.SHORT_RUN_SEEDS))
        assert a.changes_distserve  # DistServe's layout is re-measured on the short runs too
    assert table.runs_of(table.ABLATIONS[0], row, common) == [("baseline", common)]
    assert table.mean_or_none([1.0, 3.0]) == 2.0 and table.mean_or_none([1.0, None]) is None


def test_eval_slo_scale_is_the_median_over_runs() -> None:
    """SLO scale at DistServe's figure's rate: each system's median over the aligned+short-runs runs, vllm ÷ DistServe."""
    row = next(r for r in setting.ROWS if r.key == "opt-66b-summarisation")
    found = {(row.key, f"{table.EVAL_SCALE_ABLATIONS[0]}{table.RUN_SEP}{i}", s): {"min_scale": {setting.MODE: x}}
             for i, (d, v) in enumerate([(0.6, 2.0), (0.7, 9.0), (0.8, 4.0)]) for s, x in (("distserve", d), ("vllm-2023", v))}
    e = table.eval_slo_scale(row, found)
    assert e is not None and e["per_gpu"] == row.eval_scale_rate and e["prompts_per_gpu"] == row.eval_prompts_per_gpu
    assert e["median"] == {"distserve": 0.7, "vllm-2023": 4.0} and e["ratio"] == pytest.approx(4.0 / 0.7, abs=1e-3)
    assert sorted(e["runs"]["vllm-2023"]) == [2.0, 4.0, 9.0]
    assert table.eval_slo_scale(row, {k: v for k, v in found.items() if k[2] == "distserve"}) is None
    assert set(table.EVAL_SCALE_ABLATIONS) <= {a.name for a in table.ABLATIONS}


def test_ray_control_plane_is_paid_per_tp_worker_by_vllm_only() -> None:
    """``aligned+ray``: vllm-2023 at TP > 1 pays v0.2.3's Ray call per step per TP worker on top of ``aligned``; at TP1
    (the worker in the driver's process) nothing, and DistServe's layout never."""
    abl = {a.name: a for a in table.ABLATIONS}
    aligned, ray, per_seq = abl["aligned"], abl["aligned+ray"], abl["aligned+ray-per-seq"]
    step_s, seq_s = setting.ALIGNED_OVERHEADS_S["vllm"]
    for row in setting.ROWS:
        base, _ = systems.vllm_config(aligned, row, (1.0, 1.0))
        cfg, _ = systems.vllm_config(ray, row, (1.0, 1.0))
        cfg_seq, _ = systems.vllm_config(per_seq, row, (1.0, 1.0))
        workers = row.vllm_tp if row.vllm_tp > 1 else 0
        assert (base.step_overhead_s, base.seq_overhead_s) == (step_s, seq_s)
        assert cfg.step_overhead_s == pytest.approx(step_s + workers * setting.VLLM_RAY_STEP_S) and cfg.seq_overhead_s == seq_s
        assert cfg_seq.seq_overhead_s == pytest.approx(seq_s + workers * setting.VLLM_RAY_SEQ_S) and cfg_seq.step_overhead_s == step_s
        assert systems.distserve_config(ray) == systems.distserve_config(aligned)
    assert {r.vllm_tp for r in setting.ROWS} == {1, 4, 8}  # both cases are in the table


def test_vllm_prompt_step_scale_applies_only_where_the_traces_measured_it() -> None:
    """``aligned``: vLLM's prompt steps are scaled (``align_real_traces.py``'s fit) on the row whose vLLM the traces measured
    (OPT-13B at TP1) and nowhere else; DistServe's prompt steps as fitted (1.0: its profile needs no correction)."""
    aligned = next(a for a in table.ABLATIONS if a.name == "aligned")
    assert aligned.vllm_prefill_scale == setting.ALIGNED_PREFILL_SCALE["vllm"] != 1.0
    for row in setting.ROWS:
        cfg, engine = systems.vllm_config(aligned, row, (1.0, 1.0))
        fitted = (row.model, row.vllm_tp) == setting.FITTED_VLLM
        assert cfg.prefill_scale == (aligned.vllm_prefill_scale if fitted else 1.0), row.key
        assert fitted == (row.key == "opt-13b-chatbot")
    assert systems.distserve_config(aligned).prefill_scale == setting.ALIGNED_PREFILL_SCALE["distserve"]


def test_distserve_prompts_ablations_run_the_chatbot_rows_on_distserves_own_requests() -> None:
    abl = {a.name: a for a in table.ABLATIONS}
    for name in ("distserve-prompts", "aligned+distserve-prompts", "aligned+ray+distserve-prompts+short-runs"):
        a = abl[name]
        assert a.chatbot_workload == "sharegpt-distserve" and a.changes_distserve
        assert [r.key for r in setting.ROWS if table.applies(a, r)] == [r.key for r in setting.ROWS if r.workload == "sharegpt-multiturn"]
    assert abl["first-turn"].chatbot_workload == "chatbot" and abl["aligned"].chatbot_workload is None
