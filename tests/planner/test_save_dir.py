"""``distserve plan --save-dir``: the bundle (placement, every candidate, plots, serve command, Ray Serve config) of a quick plan."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shlex
from pathlib import Path

import pytest
import yaml

from distserve.cli import main
from distserve.cli.args import build_parser, placement_from_args
from distserve.placement import Placement

# A quick plan: the roofline model of OPT-13B on two A100s, 40 requests per probe (about a second).
PLAN = ["plan", "--workers", "1", "--model", "facebook/opt-13b", "--gpu", "a100-80g", "--nodes", "1", "--gpus-per-node", "2",
        "--ttft", "250ms", "--tpot", "0.1s", "--num-requests", "40", "--json"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The bundle directory (created by the command) and the plan's --json summary."""
    out = tmp_path_factory.mktemp("plan") / "bundle"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main([*PLAN, "--save-dir", str(out)]) == 0
    return out, json.loads(stdout.getvalue().strip().splitlines()[-1])


def test_bundle_has_every_file(bundle: tuple[Path, dict]) -> None:
    out, _ = bundle
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["placement.json", "candidates.csv", "attainment.png", "goodput.png", "serve_command.txt", "serve_config.yaml"])


def test_placement_is_the_chosen_plan(bundle: tuple[Path, dict]) -> None:
    out, summary = bundle
    placement = Placement.load(out / "placement.json")
    assert placement.to_dict() == summary["best"]["placement"]
    assert placement.slo is not None and (placement.slo.ttft_s, placement.slo.tpot_s) == (0.25, 0.1)  # the units were read


def test_candidates_csv_lists_every_option_and_candidate(bundle: tuple[Path, dict]) -> None:
    out, summary = bundle
    with open(out / "candidates.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    plans = [r for r in rows if r["row"] == "plan"]
    cands = [r for r in rows if r["row"] == "candidate"]
    assert len(plans) == len(summary["options"]) and len(cands) == len(summary["candidates"]) > 0
    chosen = [r for r in plans if r["status"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["kind"] == summary["best"]["name"]
    assert float(chosen[0]["goodput_per_gpu"]) == pytest.approx(summary["best"]["per_gpu"])
    assert {r["status"] for r in cands} <= {"evaluated", "pruned", "skipped"}
    by_config = {(c["kind"], c["configuration"]): c for c in summary["candidates"]}
    for r in cands:
        c = by_config[(r["kind"], r["configuration"])]
        assert float(r["goodput_per_gpu"]) == pytest.approx(c["per_gpu"]) and int(r["num_gpus"]) == c["num_gpus"]
        if r["status"] == "evaluated" and float(r["goodput_rps"]) > 0:
            # the attainment at the probe the goodput stands on meets the target
            assert float(r["attainment_joint"]) >= 0.9 and float(r["probe_rate_rps"]) == pytest.approx(float(r["goodput_rps"]))


def test_plots_are_pngs(bundle: tuple[Path, dict]) -> None:
    import matplotlib.image

    out, _ = bundle
    for name in ("attainment.png", "goodput.png"):
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 100 and image.shape[1] > 100


def test_serve_command_deploys_the_placement(bundle: tuple[Path, dict]) -> None:
    out, _ = bundle
    argv = shlex.split((out / "serve_command.txt").read_text())
    assert argv[:2] == ["distserve", "serve"] and argv[argv.index("--model") + 1] == "facebook/opt-13b"
    args = build_parser().parse_args(argv[1:])
    assert placement_from_args(args) == Placement.load(out / "placement.json")


def test_serve_config_follows_ray_serves_schema(bundle: tuple[Path, dict]) -> None:
    from ray.serve.schema import ServeDeploySchema

    out, _ = bundle
    config = ServeDeploySchema.model_validate(yaml.safe_load((out / "serve_config.yaml").read_text()))
    (app,) = config.applications
    assert app.import_path == "distserve.serving.app:build_app" and app.route_prefix == "/"
    assert app.args["model"] == "facebook/opt-13b"
    assert Placement.load(app.args["placement"]) == Placement.load(out / "placement.json")
    from distserve.serving.app_config import ServeAppConfig

    deployment = ServeAppConfig.from_args(app.args).resolve().deployment  # the app's args as the app reads them
    assert deployment.placement == Placement.load(out / "placement.json") and deployment.model == "facebook/opt-13b"


def test_save_dir_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert main([*PLAN, "--save-dir", str(not_a_dir)]) == 2
    assert "--save-dir" in capsys.readouterr().err


def test_placement_carries_the_batch_caps_it_was_simulated_with(bundle: tuple[Path, dict]) -> None:
    from distserve.config import SchedulerConfig

    out, _ = bundle
    data = json.loads((out / "placement.json").read_text())
    default = SchedulerConfig()
    assert (data["max_num_seqs"], data["max_num_batched_tokens"]) == (default.max_num_seqs, default.max_num_batched_tokens)
    assert "--max-num-seqs" not in (out / "serve_command.txt").read_text()  # the placement carries them
