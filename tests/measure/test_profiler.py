"""`distserve profile`: real step timings fit the simulator's latency model; tp=2 over gloo; clear errors."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from distserve.cli import main
from distserve.errors import InvalidConfigError
from distserve.engine.tiny_model import build_tiny_hf_model
from distserve.measure.profiler import profile_engine
from simulator.latency import FittedLatencyModel
from simulator.models import model_spec_from_hf_config


@pytest.fixture(scope="module")
def tiny_profile() -> dict[str, Any]:
    return profile_engine("tiny", quick=True, repeats=5)


def _predict_ms(coeffs: list[float], features: tuple[float, float, float]) -> float:
    return sum(c * f for c, f in zip(coeffs, features))


def test_fit_predicts_measured_samples(tiny_profile: dict[str, Any]) -> None:
    assert tiny_profile["format"] == "distserve-profile/1" and tiny_profile["hardware"] == "cpu"
    fit = tiny_profile["tp"]["1"]
    for key in ("prefill", "decoding_smallbs", "decoding_largebs"):
        assert len(fit[key]) == 3 and all(c >= 0 for c in fit[key]), (key, fit[key])
    assert fit["fit_error"]["prefill_mape"] < 0.5 and fit["fit_error"]["decode_mape"] < 0.5, fit["fit_error"]

    samples = tiny_profile["samples"]["1"]
    assert len(samples["prefill"]) >= 6 and len(samples["decode"]) >= 6
    assert {len(s["lens"]) for s in samples["prefill"]} == {1, 2}
    assert {len(s["ctx_lens"]) for s in samples["decode"]} == {1, 4, 16, 32}
    assert all(s["seconds"] > 0 for s in samples["prefill"] + samples["decode"])

    # Prefill time grows with tokens, both measured and fitted.
    by_tokens = sorted(samples["prefill"], key=lambda s: sum(s["lens"]))
    assert by_tokens[-1]["seconds"] > 2 * by_tokens[0]["seconds"]
    small, large = _predict_ms(fit["prefill"], (1, 16, 16**2)), _predict_ms(fit["prefill"], (1, 1024, 1024**2))
    assert large > 2 * small

    meta = tiny_profile["meta"]
    # The default decode attention (kernels.backends "cascade") reads Σctx less what shared prefixes
    # save; the simulator is told so (the profile's batches share nothing: they time exact steps).
    assert meta["decode_attention_backend"] == "cascade" and meta["decode_attention"] == "cascade"
    assert meta["threads"] == 1 and meta["quick"] is True and meta["block_size"] == 16 and meta["dtype"] == "float32"
    assert meta["torch"] and meta["cpu"] and meta["date"]
    assert isinstance(meta["prefill_first_use_extra_s"]["1"], float) and 0 <= meta["cpu_steal_fraction"] <= 1
    assert "quiet_guard" not in meta and "concurrent_slowdown" not in meta  # both opt-in


@pytest.mark.integration  # the busy neighbour is a process
def test_quiet_guard_and_concurrent_slowdown_are_recorded(tmp_path: pathlib.Path) -> None:
    """The opt-in measurements (CLI flags): the guard's counts (no waiting here) and the slowdown next to a busy worker."""
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "tiny", "--quick", "--repeats", "1", "--quiet", "--concurrency",
                 "--max-quiet-wait-s", "0", "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    guard = profile["meta"]["quiet_guard"]["1"]
    assert guard["waited_s"] == 0.0 and guard["num_steps_retimed"] >= 0 and guard["num_steps_kept_disturbed"] >= 0
    slowdown = profile["meta"]["concurrent_slowdown"]
    assert set(slowdown["probes"]) == {"prefill 1x128", "decode 8x128"}
    assert slowdown["factor"] > 0.5 and all(v > 0 for v in slowdown["probes"].values())
    assert profile["tp"]["1"]["num_samples"]["prefill"] >= 6


@pytest.mark.integration  # tp=2 runs as processes over gloo
def test_cli_writes_loadable_profile_with_tp1_and_tp2(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tmp" / "p.json"
    out.parent.mkdir()
    code = main(["profile", "--model", "tiny", "--quick", "--tp", "1", "--tp", "2", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.read_text())
    assert sorted(data["tp"]) == ["1", "2"] and sorted(data["samples"]) == ["1", "2"]
    for fit in data["tp"].values():
        assert all(c >= 0 for c in fit["prefill"] + fit["decoding_smallbs"])
        assert fit["num_samples"]["prefill"] >= 6 and fit["num_samples"]["decode"] >= 6
    assert str(out) in stdout and "prefill" in stdout

    # The simulator's registry does not know the in-process tiny model: the profile carries its architecture.
    model = FittedLatencyModel.from_profile(out)
    hf_config = build_tiny_hf_model()[0].config.to_dict()
    expected = model_spec_from_hf_config(hf_config, name="tiny")
    assert model.model.num_layers == expected.num_layers and model.model.hidden_size == expected.hidden_size
    itemsize = 4 if data["meta"]["dtype"] == "float32" else 2  # KV bytes follow the profiled dtype
    assert model.model.kv_bytes_per_token == expected.kv_bytes_per_token // expected.dtype_bytes * itemsize
    assert model.supports(1, 1) and model.supports(2, 1)
    assert model.prefill_time([512], tp=1) > model.prefill_time([16], tp=1) > 0
    assert model.decode_time([64] * 8, tp=2) > 0


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--model", "no-such-model"], "--model"),
        (["--model", "tiny", "--tp", "3"], "--tp"),  # tiny has 4 heads
        (["--model", "tiny", "--out", "/no/such/dir/p.json"], "--out"),
        (["--model", "tiny", "--quiet", "--max-quiet-wait-s", "-1"], "--max-quiet-wait-s"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> None:
    code = main(["profile", "--quick", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert flag in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--tp", "0"], ["--repeats", "0"], ["--threads", "-1"]])
def test_bad_counts_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--model", "tiny", "--quick", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_api_rejects_bad_tp() -> None:
    with pytest.raises(InvalidConfigError, match="tp"):
        profile_engine("tiny", tps=[0], quick=True)
    with pytest.raises(InvalidConfigError, match="tp=3"):
        profile_engine("tiny", tps=[1, 3], quick=True)


def test_profiled_instances_share_one_kv_cache_without_sharing_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement drives one InstanceCore per instance over one runner: the decode batches of a
    context, live at once, never touch each other's blocks, and every block id fits the cache."""
    from distserve.engine.model_runner import ModelRunner
    from distserve.measure.step_times import MeasureJob, ProfileGrid, measure_in_process

    plans: list[tuple[frozenset[str], set[int]]] = []
    num_blocks: list[int] = []
    real = ModelRunner.execute

    def execute(self: ModelRunner, plan: Any) -> Any:
        num_blocks.append(self.num_blocks)
        if plan.chunks and all(c.is_decode for c in plan.chunks):
            plans.append((frozenset(c.seq_id for c in plan.chunks), {b for c in plan.chunks for b in c.block_table}))
        return real(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    grid = ProfileGrid((1, 2), (16,), (1, 4), (16, 40), max_prefill_tokens=64, max_decode_kv_tokens=512)
    samples = measure_in_process(MeasureJob("tiny", "float32", 1, 1, 2, 8, grid, "exact"))
    assert [s["lens"] for s in samples["prefill"]] == [[16], [16, 16]]
    assert [len(s["ctx_lens"]) for s in samples["decode"]] == [1, 4, 1, 4]
    assert all(b < num_blocks[0] for _, blocks in plans for b in blocks)
    batches: dict[frozenset[str], tuple[int, int, set[int]]] = {}  # seq ids -> (first plan, last plan, blocks)
    for i, (ids, blocks) in enumerate(plans):
        first, _, seen = batches.get(ids, (i, i, set()))
        batches[ids] = (first, i, seen | blocks)
    assert len(batches) == 4
    for a, (a0, a1, a_blocks) in batches.items():
        for b, (b0, b1, b_blocks) in batches.items():
            if a != b and a0 < b1 and b0 < a1:  # live at the same time
                assert not a_blocks & b_blocks
