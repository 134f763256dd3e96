"""Latency models: DistServe's fitted form (its published profile, our fits) and the roofline."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from distserve.errors import InvalidConfigError
from simulator.hardware import HARDWARE
from simulator.fitting import build_profile, fit_coefficients
from simulator.latency import LATENCY_MODELS, BatchShape, FittedLatencyModel, RooflineLatencyModel, get_latency_model
from simulator.profiles import TpCoefficients
from simulator.models import KNOWN_MODELS

DATA_DIR = Path(__file__).resolve().parents[2] / "simulator" / "data"  # shipped with the package
DISTSERVE_PROFILE = DATA_DIR / "distserve-a100-80g-profile.json"
needs_distserve_profile = pytest.mark.skipif(
    not DISTSERVE_PROFILE.is_file(), reason=f"DistServe's published profile not found at {DISTSERVE_PROFILE}"
)

# Synthetic ground truth (ms), roughly OPT-13B on an A100 at tp 1.
TRUE_PREFILL = (18.0, 0.1, 7e-6)
TRUE_DECODE_SMALL = (20.0, 6e-4, 0.04)
TRUE_DECODE_LARGE = (7.0, 6e-4, 0.16)


def _distserve_entry(model: str, tp: int) -> dict:
    return json.loads(DISTSERVE_PROFILE.read_text())[model][str(tp)]


# --- BatchShape -------------------------------------------------------------------------------------


def test_batch_shape_aggregates() -> None:
    shape = BatchShape.of(prefill_lens=[3, 4], decode_ctx_lens=[10, 20, 30])
    assert shape == BatchShape(num_prefill=2, prefill_tokens=7, prefill_sq=25, num_decode=3, decode_ctx=60, decode_max_ctx=30)
    chunked = BatchShape.of(prefill_lens=[4], prefill_offsets=[6])
    assert chunked.prefill_sq == 10 * 10 - 6 * 6
    assert BatchShape.of() == BatchShape()
    with pytest.raises(InvalidConfigError, match="prefill_offsets"):
        BatchShape.of(prefill_lens=[1, 2], prefill_offsets=[0])


# --- DistServe's published profile ------------------------------------------------------------------


@needs_distserve_profile
def test_distserve_prefill_reproduces_hand_computation() -> None:
    model = FittedLatencyModel.from_profile(DISTSERVE_PROFILE, model="facebook/opt-13b")
    a, b, c = _distserve_entry("facebook/opt-13b", 1)["prefill"]
    expected_ms = a + b * 512 + c * 512**2
    assert model.prefill_time([512], tp=1) == pytest.approx(expected_ms / 1e3, rel=1e-12)
    assert 0.05 < model.prefill_time([512], tp=1) < 0.1  # ~72 ms: sane units
    assert model.hardware is HARDWARE["a100-80g"]
    assert model.model is KNOWN_MODELS["facebook/opt-13b"]


@needs_distserve_profile
def test_distserve_decode_below_and_above_threshold() -> None:
    model = FittedLatencyModel.from_profile(str(DISTSERVE_PROFILE), model="opt-13b")
    entry = _distserve_entry("facebook/opt-13b", 2)
    threshold = entry["decoding_large_small_bs_threshold"]
    for batch, key in ((8, "decoding_smallbs"), (threshold + 5, "decoding_largebs")):
        ctx = [300 + i for i in range(batch)]
        a, b, c = entry[key]
        assert model.decode_time(ctx, tp=2) == pytest.approx((a + b * sum(ctx) + c * batch) / 1e3, rel=1e-12)
    assert model.supports(2, 1) and model.supports(4, 2) and not model.supports(8, 1)


@needs_distserve_profile
def test_distserve_unknown_tp_and_model_are_errors() -> None:
    model = FittedLatencyModel.from_profile(DISTSERVE_PROFILE, model="facebook/opt-13b")
    with pytest.raises(InvalidConfigError, match=r"profiled tps: \[1, 2, 4\]"):
        model.prefill_time([128], tp=8)
    with pytest.raises(InvalidConfigError, match="facebook/opt-66b"):
        FittedLatencyModel.from_profile(DISTSERVE_PROFILE)  # several models, none chosen
    with pytest.raises(InvalidConfigError, match="facebook/opt-13b, facebook/opt-66b"):
        FittedLatencyModel.from_profile(DISTSERVE_PROFILE, model="meta-llama/Llama-3.1-8B")


@needs_distserve_profile
def test_distserve_mixed_batch_and_pipeline() -> None:
    model = FittedLatencyModel.from_profile(DISTSERVE_PROFILE, model="facebook/opt-66b")
    entry = _distserve_entry("facebook/opt-66b", 4)
    pa, pb, pc = entry["prefill"]
    da, db, dc = entry["decoding_smallbs"]
    shape = BatchShape.of(prefill_lens=[256], decode_ctx_lens=[1000, 2000])
    expected_ms = (pa + pb * 256 + pc * 256**2) + (da + db * 3000 + dc * 2) - min(pa, da)
    assert model.step_time(shape, tp=4) == pytest.approx(expected_ms / 1e3)
    staged = FittedLatencyModel(model.model, model.coeffs, pp_stage_overhead_s=0.002)
    assert staged.step_time(shape, tp=4, pp=2) == pytest.approx(expected_ms / 1e3 / 2 + 0.002)
    assert staged.prefill_time([256], tp=4, pp=2) == pytest.approx(2 * ((pa + pb * 256 + pc * 256**2) / 2e3 + 0.002))
    assert model.step_time(BatchShape(), tp=4, pp=2) == 0.0


def test_malformed_distserve_profile_names_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    entry = {"prefill": [1, 2, 3], "decoding_smallbs": [1, 2, 3], "decoding_large_small_bs_threshold": 95}
    path.write_text(json.dumps({"facebook/opt-13b": {"1": entry}}))
    with pytest.raises(InvalidConfigError, match="decoding_largebs") as info:
        FittedLatencyModel.from_profile(path)
    assert str(path) in str(info.value)
    path.write_text(json.dumps({"facebook/opt-13b": {"1": {**entry, "decoding_largebs": [1, 2]}}}))
    with pytest.raises(InvalidConfigError, match="decoding_largebs"):
        FittedLatencyModel.from_profile(path)
    path.write_text("{")
    with pytest.raises(InvalidConfigError, match="profile.json"):
        FittedLatencyModel.from_profile(path)


# --- fitting and our profile format -----------------------------------------------------------------


def _synthetic_samples(rng: np.random.Generator, noise: float) -> dict:
    def jitter(ms: float) -> float:
        return ms * (1 + rng.normal(0, noise)) / 1e3

    prefill = []
    for _ in range(60):
        lens = [int(x) for x in rng.integers(16, 2048, size=int(rng.integers(1, 6)))]
        a, b, c = TRUE_PREFILL
        prefill.append({"lens": lens, "seconds": jitter(a + b * sum(lens) + c * sum(n * n for n in lens))})
    decode = []
    for batch in [*range(1, 95, 3), *range(96, 300, 7)]:
        ctx = [int(x) for x in rng.integers(16, 2048, size=batch)]
        a, b, c = TRUE_DECODE_SMALL if batch <= 95 else TRUE_DECODE_LARGE
        decode.append({"ctx_lens": ctx, "seconds": jitter(a + b * sum(ctx) + c * batch)})
    return {"prefill": prefill, "decode": decode}


def _as_pairs(samples: list[dict], key: str) -> list[tuple[list[int], float]]:
    return [(s[key], s["seconds"]) for s in samples]


def test_fit_recovers_known_coefficients() -> None:
    samples = _synthetic_samples(np.random.default_rng(0), noise=0.02)
    coeffs = fit_coefficients(_as_pairs(samples["prefill"], "lens"), _as_pairs(samples["decode"], "ctx_lens"))
    # The split found is the true one (at 95) up to one sampled batch size either side (the noise).
    assert 91 <= coeffs.decode_threshold <= 103
    fixed = fit_coefficients(_as_pairs(samples["prefill"], "lens"), _as_pairs(samples["decode"], "ctx_lens"), 95)
    assert fixed.decode_threshold == 95 and coeffs.fit_error["decode_mape"] <= fixed.fit_error["decode_mape"]
    assert coeffs.fit_error["prefill_mape"] < 0.03 and coeffs.fit_error["decode_mape"] < 0.03
    for fitted, true in ((coeffs.prefill, TRUE_PREFILL), (coeffs.decode_small, TRUE_DECODE_SMALL),
                         (coeffs.decode_large, TRUE_DECODE_LARGE)):
        assert fitted[0] == pytest.approx(true[0], rel=0.15)  # intercept
        assert fitted[1] == pytest.approx(true[1], rel=0.15) or fitted[2] == pytest.approx(true[2], rel=0.15)
    assert coeffs.prefill[1] == pytest.approx(TRUE_PREFILL[1], rel=0.1)
    assert coeffs.decode_large[2] == pytest.approx(TRUE_DECODE_LARGE[2], rel=0.1)
    assert all(v >= 0 for v in (*coeffs.prefill, *coeffs.decode_small, *coeffs.decode_large))


def test_fit_one_sided_decode_uses_same_coefficients() -> None:
    samples = _synthetic_samples(np.random.default_rng(1), noise=0.0)
    small_only = [s for s in samples["decode"] if len(s["ctx_lens"]) <= 95]
    coeffs = fit_coefficients(_as_pairs(samples["prefill"], "lens"), _as_pairs(small_only, "ctx_lens"))
    assert coeffs.decode_small == coeffs.decode_large
    assert coeffs.decode_small == pytest.approx(TRUE_DECODE_SMALL, rel=1e-3)
    assert coeffs.fit_error["decode_mape"] < 1e-6
    with pytest.raises(InvalidConfigError, match="decode samples"):
        fit_coefficients(_as_pairs(samples["prefill"], "lens"), [])


def test_build_profile_round_trips(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    samples = {1: _synthetic_samples(rng, noise=0.01), 2: _synthetic_samples(rng, noise=0.01)}
    profile = build_profile("smollm2-135m", "cpu", samples, meta={"host": "test"})
    assert profile["format"] == "distserve-profile/1" and profile["units"] == "ms"
    assert set(profile["tp"]) == {"1", "2"} and profile["meta"] == {"host": "test"}
    assert profile["tp"]["1"]["num_samples"] == {"prefill": 60, "decode": len(samples[1]["decode"])}
    assert profile["samples"]["2"]["decode"][0]["ctx_lens"] == samples[2]["decode"][0]["ctx_lens"]

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    loaded = FittedLatencyModel.from_profile(path, hardware="a100-80g")
    assert loaded.model is KNOWN_MODELS["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert loaded.coeffs[1].prefill == pytest.approx(tuple(profile["tp"]["1"]["prefill"]))
    assert loaded.coeffs[2].fit_error == profile["tp"]["2"]["fit_error"]
    assert loaded.prefill_time([1000], tp=1) == pytest.approx(
        (TRUE_PREFILL[0] + TRUE_PREFILL[1] * 1000 + TRUE_PREFILL[2] * 1e6) / 1e3, rel=0.05
    )
    again = FittedLatencyModel.from_profile(loaded.to_profile())
    assert again.coeffs == loaded.coeffs and again.hardware is loaded.hardware
    shape = BatchShape.of([300, 200], [500] * 120)
    assert again.step_time(shape, tp=2) == loaded.step_time(shape, tp=2)


def test_our_profile_errors() -> None:
    coeffs = {1: TpCoefficients((1, 0.1, 0), (2, 0, 0.1), (2, 0, 0.1), 95)}
    profile = FittedLatencyModel("opt-13b", coeffs).to_profile()
    with pytest.raises(InvalidConfigError, match="'tp'"):
        FittedLatencyModel.from_profile({k: v for k, v in profile.items() if k != "tp"})
    with pytest.raises(InvalidConfigError, match="not 'llama-3.1-8b'"):
        FittedLatencyModel.from_profile(profile, model="llama-3.1-8b")
    with pytest.raises(InvalidConfigError, match="format"):
        FittedLatencyModel.from_profile({**profile, "format": "other/2"})
    with pytest.raises(InvalidConfigError, match="ctx_lens"):
        build_profile("opt-13b", "a100-80g", {1: {"prefill": [], "decode": [{"lens": [1], "seconds": 1.0}]}})


# --- roofline ---------------------------------------------------------------------------------------


def test_roofline_prefill_is_compute_bound_and_linear() -> None:
    roof = RooflineLatencyModel("llama-3.1-8b", "a100-80g")
    t4k, t8k, t16k = (roof.prefill_time([512] * n) for n in (8, 16, 32))
    assert t8k / t4k == pytest.approx(2.0, rel=0.1)
    assert t16k / t8k == pytest.approx(2.0, rel=0.05)
    hw, spec = roof.hardware, roof.model
    compute_only = 16384 * spec.layer_flops_per_token / (hw.peak_flops * hw.flops_efficiency)
    assert compute_only < t16k < 1.3 * compute_only


def test_roofline_small_decode_is_memory_bound() -> None:
    roof = RooflineLatencyModel("llama-3.1-8b", "h100-sxm")
    hw = roof.hardware
    weights_s = roof.model.weight_bytes / (hw.mem_bandwidth * hw.bandwidth_efficiency)
    t1 = roof.decode_time([128])
    assert t1 == pytest.approx(weights_s + hw.step_overhead_s, rel=0.02)
    assert roof.decode_time([128] * 8) < 1.05 * t1  # batching is nearly free while memory bound
    assert roof.decode_time([8192] * 64) > 1.5 * t1  # KV reads show up at long contexts


def test_roofline_tensor_and_pipeline_parallel() -> None:
    roof = RooflineLatencyModel("opt-13b", "a100-80g")
    shape = BatchShape.of(prefill_lens=[1024] * 4)
    t1, t2 = roof.step_time(shape, tp=1), roof.step_time(shape, tp=2)
    assert t1 / 2 < t2 < t1
    a100 = HARDWARE["a100-80g"]
    for free_comm in ({"intra_node_bandwidth": 1e30}, {"link_latency_s": 0.0}):  # all-reduce bytes, then latency
        ideal = RooflineLatencyModel(roof.model, dataclasses.replace(a100, **free_comm))
        assert ideal.step_time(shape, tp=2) < t2
        assert ideal.step_time(shape, tp=1) == t1
    pp2 = roof.step_time(shape, pp=2)
    assert pp2 == pytest.approx(t1 / 2, rel=0.1) and pp2 > (t1 - roof.hardware.step_overhead_s) / 2
    assert roof.prefill_time([1024] * 4, pp=2) == pytest.approx(2 * pp2)
    assert roof.supports(8, 4) and not roof.supports(3, 1) and not roof.supports(1, 3)
    with pytest.raises(InvalidConfigError, match="num_heads"):
        roof.step_time(shape, tp=3)
    assert roof.step_time(BatchShape(), tp=2, pp=2) == 0.0


def test_roofline_kv_head_replication() -> None:
    llama = RooflineLatencyModel("llama-3.1-8b", "a100-80g")  # 32 heads, 8 kv heads
    assert llama.supports(8, 1) and llama.supports(16, 1)  # tp 16: each kv head held by 2 devices
    assert llama.kv_bytes_per_token_per_device(16, 1) == llama.kv_bytes_per_token_per_device(8, 1)
    assert llama.kv_bytes_per_token_per_device(4, 1) == 2 * llama.kv_bytes_per_token_per_device(8, 1)
    smol = RooflineLatencyModel("smollm2-135m", "a100-80g")  # 9 heads, 3 kv heads
    assert smol.supports(3, 1) and smol.supports(9, 1)
    assert not smol.supports(2, 1) and not smol.supports(6, 1)  # 6 does not divide 9 heads
    assert smol.supports(1, 5) and not smol.supports(1, 4)  # 30 layers


def test_roofline_memory_capacity() -> None:
    roof = RooflineLatencyModel("opt-66b", "a100-80g")
    with pytest.raises(InvalidConfigError, match="does not fit in memory"):
        roof.max_kv_tokens(1, 1)
    tokens = roof.max_kv_tokens(2, 1)
    assert 2048 <= tokens < 20000  # DistServe's own capacity table says 11600
    assert roof.max_kv_tokens(4, 1) > 5 * tokens
    assert roof.max_kv_tokens(2, 1, mem_utilization=0.95) > tokens
    with pytest.raises(InvalidConfigError, match=r"room for \d{3,4} KV tokens.*= 2048"):
        roof.max_kv_tokens(2, 1, mem_utilization=0.78)  # weights fit, less than one 2048-token sequence does


def test_roofline_hardware_ordering() -> None:
    shapes = [BatchShape.of(prefill_lens=[2048] * 4), BatchShape.of(decode_ctx_lens=[1024] * 32)]
    a100, h100, h200 = (RooflineLatencyModel("llama-3.1-70b", hw) for hw in ("a100-80g", "h100-sxm", "h200"))
    for shape in shapes:
        assert a100.step_time(shape, tp=4) > h100.step_time(shape, tp=4) > 0
        assert h200.step_time(shape, tp=4) <= h100.step_time(shape, tp=4)
    assert h200.step_time(shapes[1], tp=4) < h100.step_time(shapes[1], tp=4)  # decode: 4.8 vs 3.35 TB/s


def test_migration_time() -> None:
    roof = RooflineLatencyModel("opt-13b", "a100-80g")
    hw = roof.hardware
    num_bytes = 512 * roof.model.kv_bytes_per_token
    intra = roof.migration_time(num_bytes)
    assert intra == pytest.approx(hw.link_latency_s + num_bytes / (hw.intra_node_bandwidth * hw.comm_efficiency))
    assert roof.migration_time(num_bytes, same_node=False) > intra
    assert roof.migration_time(num_bytes, num_links=4) < intra
    assert roof.migration_time(0) == 0.0


# --- registry, speed, dependencies ------------------------------------------------------------------


def test_get_latency_model() -> None:
    assert set(LATENCY_MODELS) == {"roofline", "fitted"}
    roof = get_latency_model("opt-13b")
    assert isinstance(roof, RooflineLatencyModel) and roof.hardware.name == "a100-80g"
    assert get_latency_model(KNOWN_MODELS["opt-13b"], "h100-sxm").hardware.name == "h100-sxm"
    profile = FittedLatencyModel("opt-13b", {1: TpCoefficients((1, 0.1, 0), (2, 0, 0.1), (2, 0, 0.1), 95)},
                                 hardware="l40s").to_profile()
    fitted = get_latency_model("opt-13b", profile=profile)
    assert isinstance(fitted, FittedLatencyModel) and fitted.hardware.name == "l40s"


def test_step_time_is_cheap() -> None:
    shape = BatchShape.of(prefill_lens=[512, 300], decode_ctx_lens=[1000] * 40)
    fitted = FittedLatencyModel("opt-13b", {1: TpCoefficients((1, 0.1, 0), (2, 0, 0.1), (2, 0, 0.1), 95)})
    for model in (RooflineLatencyModel("opt-13b", "a100-80g"), fitted):
        model.step_time(shape)
        start = time.perf_counter()
        for _ in range(20000):
            model.step_time(shape)
        assert (time.perf_counter() - start) / 20000 < 50e-6  # ~1 µs on a laptop; generous for a busy CI box


@pytest.mark.integration  # a fresh interpreter
def test_simulator_does_not_import_torch_or_ray() -> None:
    code = (
        "import sys, simulator.latency, simulator.models, simulator.hardware; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'ray') or m.startswith('distserve.engine')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_padded_decode_attention_reads_batch_times_longest_context(tmp_path) -> None:  # noqa: ANN001
    """An engine that pads decodes to the longest context: the decode term uses batch x max ctx;
    uniform contexts cost the same either way; the profile's meta selects it; bad values are refused."""

    from distserve.errors import InvalidConfigError
    from simulator.latency import FittedLatencyModel
    from simulator.profiles import TpCoefficients
    from simulator.sim_instance import batch_shape
    from distserve.engine.step_plan import ScheduledChunk, StepPlan
    from distserve.config import SamplingParams

    coeffs = {1: TpCoefficients((10.0, 0.1, 0.0), (5.0, 0.01, 1.0), (5.0, 0.01, 1.0), 95)}
    plain = FittedLatencyModel("facebook/opt-13b", coeffs)
    padded = FittedLatencyModel("facebook/opt-13b", coeffs, decode_attention="padded")
    mixed, uniform = BatchShape.of(decode_ctx_lens=[100, 1000]), BatchShape.of(decode_ctx_lens=[500, 500])
    assert plain.step_time(mixed) == pytest.approx((5.0 + 0.01 * 1100 + 2.0) / 1e3)
    assert padded.step_time(mixed) == pytest.approx((5.0 + 0.01 * 2000 + 2.0) / 1e3)
    assert padded.step_time(uniform) == pytest.approx(plain.step_time(uniform))
    # The simulator's shapes carry the longest context.
    sp = SamplingParams(max_tokens=8)
    plan = StepPlan([ScheduledChunk("a", [1], 99, [0], True, sp, 0), ScheduledChunk("b", [1], 999, [1], True, sp, 0)])
    assert batch_shape(plan) == mixed
    profile = {"format": "distserve-profile/1", "model": "facebook/opt-13b", "hardware": "a100-80g", "units": "ms",
               "meta": {"decode_attention": "padded"},
               "tp": {"1": {"prefill": [10.0, 0.1, 0.0], "decoding_smallbs": [5.0, 0.01, 1.0], "decoding_largebs": [5.0, 0.01, 1.0],
                            "decoding_large_small_bs_threshold": 95}}}
    assert FittedLatencyModel.from_profile(profile).step_time(mixed) == pytest.approx(padded.step_time(mixed))
    profile["meta"]["decode_attention"] = "sideways"
    with pytest.raises(InvalidConfigError, match="decode_attention"):
        FittedLatencyModel.from_profile(profile)


def test_profile_threads_are_kept_and_checked() -> None:
    from distserve.errors import InvalidConfigError
    from simulator.latency import FittedLatencyModel

    profile = {"format": "distserve-profile/1", "model": "facebook/opt-13b", "hardware": "a100-80g", "units": "ms",
               "meta": {"threads": 2},
               "tp": {"1": {"prefill": [10.0, 0.1, 0.0], "decoding_smallbs": [5.0, 0.01, 1.0], "decoding_largebs": [5.0, 0.01, 1.0],
                            "decoding_large_small_bs_threshold": 95}}}
    assert FittedLatencyModel.from_profile(profile).threads == 2
    profile["meta"]["threads"] = "many"
    with pytest.raises(InvalidConfigError, match="meta.threads"):
        FittedLatencyModel.from_profile(profile)
    del profile["meta"]["threads"]
    assert FittedLatencyModel.from_profile(profile).threads is None
