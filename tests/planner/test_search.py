"""The goodput planner: DistServe's published placements, plan CLI, budgets, rates and bad input."""

from __future__ import annotations

import json
import operator
from dataclasses import replace
from pathlib import Path

import pytest

from simulator import DISTSERVE_A100_PROFILE
from distserve.cli import main
from distserve.planner import report as plan_report
from distserve.placement import InstanceSpec, Placement
from distserve.planner.candidates import assign_nodes
from distserve.planner.chains import Chain, FollowUp, best_of, run_chains
from distserve.planner.plan import Candidate, Cluster
from distserve.planner.search import Planner
from simulator.hardware import get_hardware

PROFILE = DISTSERVE_A100_PROFILE
needs_profile = pytest.mark.skipif(not PROFILE.exists(), reason=f"DistServe's profile {PROFILE} is not in this checkout")


def best_phase(candidates: list[Candidate], kind: str) -> Candidate:
    return max((c for c in candidates if c.kind == kind and c.goodput > 0), key=lambda c: c.per_gpu)


def phase_config(c: Candidate, kind: str) -> tuple[int, int]:
    spec = c.placement.prefill[0] if kind == "prefill" else c.placement.decode[0]
    return spec.tp, spec.pp


def their_goodput_per_gpu(candidates: list[Candidate], kind: str, tp: int, pp: int) -> float:
    """Simulated goodput per GPU of DistServe's choice; if pruned, its bound (which caps it); if its
    search stopped because it could not beat the best so far, the rate it was shown to fall below."""
    c = next(c for c in candidates if c.kind == kind and phase_config(c, kind) == (tp, pp))
    if c.skipped is not None:
        return c.bound_rate / c.num_gpus
    return c.per_gpu if c.goodput_below is None else c.goodput_below / c.num_gpus


@needs_profile
@pytest.mark.parametrize(
    "model,ttft,tpot,theirs",
    [
        ("facebook/opt-13b", 0.25, 0.1, {"prefill": (2, 1), "decode": (1, 1)}),
        ("facebook/opt-66b", 2.5, 0.15, {"prefill": (4, 1), "decode": (2, 2)}),
    ],
)
def test_per_phase_choices_match_distserve_or_beat_them(model: str, ttft: float, tpot: float, theirs: dict) -> None:
    args = plan_report.PlanArgs(model=model, gpu="a100-80g", nodes=4, gpus_per_node=8, workload="chatbot",
                                ttft_s=ttft, tpot_s=tpot, attainment=0.9, attainment_mode="separate",
                                profile=str(PROFILE), num_requests=80, affinity="high")
    _, result = plan_report.run_plan(args, show_progress=False)
    assert result.feasible and result.best is not None
    for kind in ("prefill", "decode"):
        ours = best_phase(result.candidates, kind)
        if phase_config(ours, kind) != theirs[kind]:
            # README "Planner vs DistServe" explains each difference.
            assert ours.per_gpu >= their_goodput_per_gpu(result.candidates, kind, *theirs[kind]) - 1e-9
    disagg = next(o for o in result.options if o.name.startswith("disaggregated"))
    assert disagg.placement.prefill and disagg.placement.decode
    assert disagg.num_gpus <= 32 and disagg.predicted["meets_slo"]


@needs_profile
def test_plan_cli_writes_a_placement_serve_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    code = main(["plan", "--workers", "1", "--model", "facebook/opt-13b", "--gpu", "a100-80g", "--nodes", "1", "--gpus-per-node", "4",
                 "--ttft", "0.25", "--tpot", "0.1", "--profile", str(PROFILE), "--num-requests", "60",
                 "--out", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert code == 0 and "placements for facebook/opt-13b" in text and "best:" in text and "per GPU" in text
    placement = Placement.load(out)
    assert placement.num_workers <= 4 and placement.predicted["goodput_per_gpu"] > 0
    assert png.stat().st_size > 0
    # `distserve serve --placement` parses exactly this file (deployment itself: validate_planner).
    from distserve.cli.args import build_parser, placement_from_args

    args = build_parser().parse_args(["serve", "--placement", str(out)])
    assert placement_from_args(args) == placement
    # It carries the SLO it was planned for; serve keeps decoding steps within its TPOT unless told otherwise.
    from distserve.cli.serve import serve_slo

    assert placement.slo is not None and (placement.slo.ttft_s, placement.slo.tpot_s) == (0.25, 0.1)
    assert serve_slo(args, placement) == placement.slo
    override = build_parser().parse_args(["serve", "--placement", str(out), "--tpot-slo", "0.05"])
    assert serve_slo(override, placement).tpot_s == 0.05  # type: ignore[union-attr]


def test_colocated_candidates_are_weighed_with_the_slo_step_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """Long prompts and a tight TPOT: a colocated instance that chunks prompts to the TPOT SLO (as a
    modern aggregated server does) is the colocated baseline, not one that runs whole prompts."""
    code = main(["plan", "--workers", "1", "--model", "facebook/opt-13b", "--gpu", "a100-80g", "--nodes", "1", "--gpus-per-node", "1",
                 "--workload", "fixed:1024:64", "--ttft", "1.0", "--tpot", "0.03", "--num-requests", "60", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    colocated = next(o for o in out["options"] if o["name"] == "colocated")
    assert colocated["placement"]["predicted"]["step_budget"] == "slo"
    assert colocated["placement"]["slo"] == {"ttft_s": 1.0, "tpot_s": 0.03, "attainment": 0.9}
    # (the plan stops searching the loser once it cannot win; a full search measures both)
    args = plan_report.PlanArgs(model="facebook/opt-13b", gpu="a100-80g", nodes=1, gpus_per_node=1, workload="fixed:1024:64",
                                ttft_s=1.0, tpot_s=0.03, num_requests=60)
    full = Planner(replace(plan_report.build_request(args), stop_losers=False)).plan()
    by_config = {c.label(): c.goodput for c in full.candidates if c.kind == "colocated"}
    assert by_config["1C tp1pp1 (slo budget)"] > 2 * by_config["1C tp1pp1"] > 0
    assert by_config["1C tp1pp1 (slo budget)"] == next(c["goodput"] for c in out["candidates"] if c["configuration"] == "1C tp1pp1 (slo budget)")


def test_target_rate_sizes_replicas_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--workers", "1", "--model", "facebook/opt-13b", "--gpu", "a100-80g", "--nodes", "2", "--gpus-per-node", "8",
                 "--ttft", "1.0", "--tpot", "0.2", "--rate", "4", "--num-requests", "60", "--affinity", "high", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["feasible"]
    for option in out["options"]:
        assert option["rate"] == pytest.approx(4.0)
    assert out["best"]["num_gpus"] <= 16 and out["num_simulated"] >= 1


def test_impossible_slo_names_the_closest_and_binding_slo(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--workers", "1", "--model", "facebook/opt-13b", "--gpu", "a100-80g", "--nodes", "1", "--gpus-per-node", "2",
                 "--ttft", "0.001", "--tpot", "0.1", "--num-requests", "40", "--affinity", "high"])
    err = capsys.readouterr().err
    assert code == 1 and "no placement meets the SLO" in err and "TTFT" in err
    # (not the decode phase, searched alone, whose TPOT it meets: no prefill can meet a 1 ms TTFT even unloaded)
    assert "even unloaded" in err and "TPOT SLO binds" not in err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "facebook/opt-175b", "--nodes", "1", "--gpus-per-node", "1"], "does not fit the cluster"),
        (["--model", "facebook/opt-13b", "--gpu", "tpu-v9"], "tpu-v9"),
        (["--model", "facebook/opt-13b", "--rate", "2", "--gpus", "4"], "not both"),
        (["--model", "facebook/opt-13b", "--gpus", "99"], "--gpus"),
        (["--model", "nobody/unknown-7b"], "nobody/unknown-7b"),
        (["--model", "facebook/opt-13b", "--out", "/nonexistent/dir/p.json"], "--out"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--workers", "1", "--ttft", "1", "--tpot", "1", "--num-requests", "10", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_assign_nodes_first_fit_and_unpinned_multinode_instances() -> None:
    cluster = Cluster(2, 4, get_hardware("a100-80g"))
    placement = Placement(prefill=(InstanceSpec(2, 1), InstanceSpec(2, 1)), decode=(InstanceSpec(4, 1), InstanceSpec(2, 4)))
    pinned = assign_nodes(placement, cluster)
    assert pinned.decode[1].node is None  # 8 GPUs span both nodes
    used = {0: 0, 1: 0}
    for s in pinned.prefill + pinned.decode:
        if s.node is not None:
            used[s.node] += s.num_workers
    assert all(v <= 4 for v in used.values()) and sum(used.values()) == 8


@needs_profile
def test_stopping_losing_searches_early_changes_no_figure() -> None:
    """stop_losers (the default) searches each chain best first and a candidate only until it cannot
    win, and stop_probes ends each probe once its verdict is certain; the plan, every option's rate
    and predicted figures, and every winner's goodput stay the same as with neither."""
    args = plan_report.PlanArgs(model="facebook/opt-13b", gpu="a100-80g", nodes=1, gpus_per_node=8, workload="chatbot",
                                ttft_s=0.25, tpot_s=0.1, profile=str(PROFILE), num_requests=60)
    req = plan_report.build_request(args)
    early, full = Planner(req).plan(), Planner(replace(req, stop_losers=False, stop_probes=False)).plan()
    stopped = [c for c in early.candidates if c.goodput_below is not None]
    assert stopped and any(c.skipped and c.skipped.startswith("bound") for c in early.candidates)
    assert sum(c.num_probes_stopped for c in early.candidates) > 0 == sum(c.num_probes_stopped for c in full.candidates)
    assert sum(len(c.probes) for c in early.candidates) < sum(len(c.probes) for c in full.candidates)
    assert [(o.name, o.rate, o.placement) for o in early.options] == [(o.name, o.rate, o.placement) for o in full.options]
    for e, f in zip(early.candidates, full.candidates):
        assert e.label() == f.label()
        if e.goodput_below is not None:
            assert f.goodput <= e.goodput_below  # it could at most have tied the winner
        elif e.skipped is not None and f.skipped is None:
            assert e.skipped.startswith("bound") and f.goodput <= e.bound_rate
        else:
            assert (e.goodput, e.skipped) == (f.goodput, f.skipped)


@needs_profile
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.integration)])
def test_a_candidate_that_can_only_tie_the_best_stops_and_loses(workers: int) -> None:
    """A candidate whose goodput per GPU could at most equal its chain's best cannot win (``best_of``
    prefers the first of equals in chain order): its search stops once it can at most tie, as it
    would below it. Twins — the same job twice — tie exactly: the second is searched only that far,
    and the full search, which searches both to the end, chooses the same one."""
    args = plan_report.PlanArgs(model="facebook/opt-13b", gpu="a100-80g", nodes=1, gpus_per_node=8, workload="chatbot",
                                ttft_s=0.1, tpot_s=0.1, profile=str(PROFILE), num_requests=60)
    req = plan_report.build_request(args)
    chosen = []
    for stop in (True, False):
        _, chain = Planner(replace(req, stop_losers=stop)).colocated_chain()
        first, job = chain.jobs[0]
        twin = replace(first, probes=[])
        run_chains([Chain("twins", [(first, job), (twin, job)], stop_losers=stop)], workers, lambda *_: None)
        assert 0 < first.goodput < first.bound_rate  # (a search that ends below the bound: the twin is not skipped by it)
        if stop:
            assert twin.goodput == 0 and twin.goodput_below == first.goodput
            assert len(twin.probes) < len(first.probes)
        else:
            assert (twin.goodput, twin.probes) == (first.goodput, first.probes)
        chosen.append(best_of([first, twin]))
        assert chosen[-1] is first


def exit_at_once(*args: object) -> None:
    """A probe whose worker process dies (``test_a_dead_worker_fails_the_plan_instead_of_hanging``)."""
    import os

    os._exit(3)


@pytest.mark.integration  # (a process pool)
@needs_profile
@pytest.mark.timeout(120)
def test_a_dead_worker_fails_the_plan_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    """``multiprocessing.Pool`` replaces a worker that dies but never reports its task: the search
    raises, naming the exit code, instead of waiting for that probe forever."""
    from distserve.planner import chains

    monkeypatch.setattr(chains, "_probe_in_worker", exit_at_once)
    args = plan_report.PlanArgs(model="facebook/opt-13b", gpu="a100-80g", nodes=1, gpus_per_node=8, workload="chatbot",
                                ttft_s=0.25, tpot_s=0.1, profile=str(PROFILE), num_requests=60)
    req = replace(plan_report.build_request(args), max_workers=2)
    with pytest.raises(chains.WorkerDiedError, match="exit code 3"):
        Planner(req).plan()


@pytest.mark.integration  # (a process pool)
@needs_profile
@pytest.mark.parametrize("stop", [True, False])
def test_workers_give_exactly_the_one_process_plan(stop: bool) -> None:
    """With --workers 2 the chains run in parallel and later candidates speculatively
    (``planner.chains``): every candidate's probes, goodput, binding and skip, and every option, as with one."""
    args = plan_report.PlanArgs(model="facebook/opt-13b", gpu="a100-80g", nodes=1, gpus_per_node=8, workload="chatbot",
                                ttft_s=0.25, tpot_s=0.1, profile=str(PROFILE), num_requests=60)
    req = replace(plan_report.build_request(args), stop_losers=stop, stop_probes=stop)
    one, two = Planner(req).plan(), Planner(replace(req, max_workers=2)).plan()

    def figures(c: Candidate) -> tuple[object, ...]:
        return (c.kind, c.label(), c.goodput, c.binding, c.probes, c.skipped, c.goodput_below, c.num_probes_stopped)

    assert [figures(c) for c in one.candidates] == [figures(c) for c in two.candidates]
    if stop:
        assert any(c.goodput_below is not None for c in one.candidates)  # min_rate mattered: speculation can guess wrong
    assert [(o.name, o.rate, o.placement, o.predicted) for o in one.options] == [(o.name, o.rate, o.placement, o.predicted) for o in two.options]
    assert (one.num_simulated, one.notes) == (two.num_simulated, two.notes)


@needs_profile
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.integration)])
def test_a_follow_up_is_made_once_its_chains_are_decided_and_its_tasks_run_on_the_pool(workers: int) -> None:
    """``run_chains``' follow-ups (the planner verifies each option this way): made once, when the chains
    they wait for are decided and recorded; with workers, before the search of the other chains has
    ended (their candidates not recorded yet), their tasks run on the pool; results in task order."""
    args = plan_report.PlanArgs(model="facebook/opt-13b", gpu="a100-80g", nodes=1, gpus_per_node=8, workload="chatbot",
                                ttft_s=0.25, tpot_s=0.1, profile=str(PROFILE), num_requests=60)
    planner = Planner(replace(plan_report.build_request(args), max_workers=workers))
    colo, colo_chain = planner.colocated_chain()
    units, unit_chain = planner.unit_chain()
    seen = []

    def make() -> list[tuple[object, tuple[object, ...]]]:
        seen.append((best_of(colo), [bool(c.probes) for c in units]))
        return [(operator.add, (2, 3)), (max, (4, 1))]

    follow_up = FollowUp([colo_chain], make)
    run_chains([colo_chain, unit_chain], workers, lambda *_: None, [follow_up])
    assert len(seen) == 1 and follow_up.results == [5, 4]
    best, units_recorded = seen[0]
    assert best is not None and best is best_of(colo)  # its chain was decided and recorded when it was made
    assert any(c.probes for c in units)
    if workers > 1:
        assert not any(units_recorded)  # the unit chain's search had not ended
    else:
        assert any(units_recorded)  # one process: every chain, then the follow-ups


def test_a_cpu_plan_carries_the_profiled_threads_and_serve_can_override_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile measured with N torch threads per rank plans instances that run with N threads;
    the Placement JSON keeps them; `serve --threads` overrides them; bad values are refused."""
    from distserve.cli.args import build_parser, placement_from_args

    source = Path(__file__).parents[2] / "experiments" / "results" / "validate_simulator_profile.json"
    profile = json.loads(source.read_text())
    profile["meta"]["threads"] = 2
    path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    path.write_text(json.dumps(profile))
    code = main(["plan", "--workers", "1", "--model", "smollm2-135m", "--gpu", "cpu", "--profile", str(path), "--nodes", "1",
                 "--gpus-per-node", "2", "--ttft", "2", "--tpot", "0.15", "--num-requests", "30", "--out", str(out)])
    capsys.readouterr()
    assert code == 0
    placement = Placement.load(out)
    specs = placement.prefill + placement.decode + placement.colocated
    assert specs and all(s.threads == 2 for s in specs)
    assert json.loads(out.read_text())[("colocated" if placement.colocated else "prefill")][0]["threads"] == 2
    args = build_parser().parse_args(["serve", "--placement", str(out)])
    assert placement_from_args(args) == placement
    assert all(s.threads == 1 for s in placement.with_threads(1).decode + placement.with_threads(1).colocated)
    # Without a thread count (GPU plans, older files) the key is absent and the runtime's default applies.
    assert "threads" not in Placement.colocated_instances(1).to_dict()["colocated"][0]
    for bad in (0, "2", True):
        with pytest.raises(ValueError, match="threads"):
            Placement.from_dict({"colocated": [{"tp": 1, "pp": 1, "threads": bad}]})


def _sigterm_is_default() -> bool:
    import signal

    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.integration  # (a process pool)
def test_pool_workers_die_on_sigterm_whatever_the_parent_handles() -> None:
    """A Ray driver's SIGTERM handler raises SystemExit; a forked pool worker that inherited it could
    unwind out of the fork when the pool is terminated and run the caller's code on (seen once: a
    second pytest running the suite). The planner's workers start with the default action; the
    parent keeps its handler."""
    import signal

    from distserve.planner.chains import _pool

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with _pool(2) as pool:
            assert pool.starmap(_sigterm_is_default, [(), ()]) == [True, True]
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
