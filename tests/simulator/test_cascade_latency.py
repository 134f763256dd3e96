"""The shared-prefix (cascade) term of the latency models: what ``batch_shape`` counts from a plan's
block tables, how the fitted and roofline models charge it, profiles that say "cascade", and a
simulation whose latency model reads shared prefixes once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distserve.config import SamplingParams
from distserve.engine.step_plan import ScheduledChunk, StepPlan
from distserve.errors import InvalidConfigError
from distserve.placement import Placement
from kernels.cascade_attention import ALWAYS, CascadeRule
from simulator import DISTSERVE_A100_PROFILE
from simulator.fitting import build_profile
from simulator.latency import BatchShape, FittedLatencyModel, RooflineLatencyModel, get_latency_model
from simulator.profiles import TpCoefficients
from simulator.sim_instance import batch_shape, cascade_rule_of
from simulator.simulation import SimConfig, Simulation
from simulator.workload import Request

ROOT = Path(__file__).resolve().parents[2]
BS = 16
SP = SamplingParams(max_tokens=8)
COEFFS = {1: TpCoefficients((10.0, 0.1, 0.0), (5.0, 0.01, 1.0), (5.0, 0.01, 1.0), 95)}


def decode(sid: str, table: list[int], ctx: int) -> ScheduledChunk:
    return ScheduledChunk(sid, [1], ctx - 1, table, True, SP, 1)


def shared_plan(num_requests: int, prefix_blocks: int, own_tokens: int) -> StepPlan:
    """``num_requests`` decodes on the same ``prefix_blocks`` physical blocks, then blocks of their own."""
    own = -(-own_tokens // BS)
    return StepPlan([
        decode(f"r{i}", list(range(prefix_blocks)) + [1000 + own * i + j for j in range(own)], prefix_blocks * BS + own_tokens)
        for i in range(num_requests)
    ])


def test_batch_shape_counts_what_a_shared_prefix_saves() -> None:
    plan = shared_plan(8, 64, 40)  # 8 requests on a 1024-token prefix
    plain = batch_shape(plan)
    assert (plain.decode_shared_saved, plain.decode_shared_nodes) == (0, 0)
    shape = batch_shape(plan, CascadeRule(), BS)
    assert shape.decode_shared_saved == 7 * 1024 and shape.decode_shared_nodes == 1
    assert shape.decode_ctx == plain.decode_ctx == 8 * (1024 + 40) and shape.num_decode == 8
    # A node the rule does not keep saves nothing: 2 members x 1 block is 16 tokens saved.
    small = shared_plan(2, 1, 5)
    assert batch_shape(small, CascadeRule(), BS).decode_shared_saved == 0
    assert batch_shape(small, ALWAYS, BS).decode_shared_saved == 16
    # No two decodes on one first block: nothing saved, and the same shape as without a rule.
    apart = StepPlan([decode("a", [1, 2], 30), decode("b", [3, 4], 30)])
    assert batch_shape(apart, ALWAYS, BS) == batch_shape(apart)


def test_the_memo_gives_the_tree_of_the_same_batch_as_its_suffixes_grow() -> None:
    memo: dict = {}
    rule = CascadeRule(min_saved_tokens=1024, member_cost_tokens=0)  # every group here pays
    plan = shared_plan(4, 64, 10)
    first = batch_shape(plan, rule, BS, memo)
    grown = StepPlan([decode(c.seq_id, c.block_table + [5000 + i], c.start_pos + 1 + BS) for i, c in enumerate(plan.chunks)])
    assert batch_shape(grown, rule, BS, memo).decode_shared_saved == first.decode_shared_saved == 3 * 1024
    assert batch_shape(grown, rule, BS) == batch_shape(grown, rule, BS, memo) and len(memo) == 1
    other = StepPlan(plan.chunks[:3])  # another batch: its own entry
    assert batch_shape(other, rule, BS, memo).decode_shared_saved == 2 * 1024 and len(memo) == 2


def test_batch_shape_counts_every_level_of_a_tree() -> None:
    """A system prompt of 4 blocks for all 4; a 2-block document for each pair; own suffixes."""
    tables = [[0, 1, 2, 3, 10, 11, 20 + i] for i in range(2)] + [[0, 1, 2, 3, 12, 13, 30 + i] for i in range(2)]
    plan = StepPlan([decode(f"r{i}", t, 6 * BS + 5) for i, t in enumerate(tables)])
    shape = batch_shape(plan, ALWAYS, BS)
    assert shape.decode_shared_nodes == 3
    assert shape.decode_shared_saved == 3 * 4 * BS + 2 * (1 * 2 * BS)
    # A partly filled first block is never shared (still being written).
    assert batch_shape(StepPlan([decode("a", [7], 10), decode("b", [7], 12)]), ALWAYS, BS).decode_shared_nodes == 0


def test_fitted_model_charges_the_kv_a_cascade_reads() -> None:
    plain = FittedLatencyModel("facebook/opt-13b", COEFFS)
    cascade = FittedLatencyModel("facebook/opt-13b", COEFFS, decode_attention="cascade")
    with_nodes = FittedLatencyModel("facebook/opt-13b", COEFFS, decode_attention="cascade", cascade_node_ms=0.5)
    shape = BatchShape(num_decode=8, decode_ctx=8 * 1064, decode_max_ctx=1064, decode_shared_saved=7 * 1024, decode_shared_nodes=1)
    assert plain.step_time(shape) == pytest.approx((5.0 + 0.01 * 8 * 1064 + 8.0) / 1e3)  # "sum" ignores the saving
    assert cascade.step_time(shape) == pytest.approx((5.0 + 0.01 * (8 * 1064 - 7 * 1024) + 8.0) / 1e3)
    assert with_nodes.step_time(shape) == pytest.approx(cascade.step_time(shape) + 0.5e-3)
    costed = FittedLatencyModel("facebook/opt-13b", COEFFS, decode_attention="cascade", cascade_shared_fraction=0.25)
    assert costed.step_time(shape) == pytest.approx((5.0 + 0.01 * (8 * 1064 - 0.75 * 7 * 1024) + 8.0) / 1e3)
    with pytest.raises(InvalidConfigError, match="cascade_shared_fraction"):
        FittedLatencyModel("facebook/opt-13b", COEFFS, decode_attention="cascade", cascade_shared_fraction=1.5)
    unshared = BatchShape.of(prefill_lens=[100], decode_ctx_lens=[300, 500, 700])
    assert cascade.step_time(unshared) == plain.step_time(unshared)  # without sharing: the "sum" model
    with pytest.raises(InvalidConfigError, match="cascade"):
        FittedLatencyModel("facebook/opt-13b", COEFFS, decode_attention="sideways")
    with pytest.raises(InvalidConfigError, match="cascade_node_ms"):
        FittedLatencyModel("facebook/opt-13b", COEFFS, decode_attention="cascade", cascade_node_ms=-1.0)


def test_roofline_reads_fewer_kv_bytes_with_cascade() -> None:
    plain = RooflineLatencyModel("facebook/opt-13b", "a100-80g")
    cascade = RooflineLatencyModel("facebook/opt-13b", "a100-80g", decode_attention="cascade")
    saved = 31 * 4096
    shape = BatchShape(num_decode=32, decode_ctx=32 * 4224, decode_max_ctx=4224, decode_shared_saved=saved, decode_shared_nodes=1)
    per_kv = plain.kv_bytes_per_token_per_device(1, 1) / (plain.hardware.mem_bandwidth * plain.hardware.bandwidth_efficiency)
    assert plain.step_time(shape) - cascade.step_time(shape) == pytest.approx(saved * per_kv)  # memory-bound decode
    unshared = BatchShape.of(decode_ctx_lens=[4224] * 32)
    assert cascade.step_time(unshared) == plain.step_time(unshared)
    with pytest.raises(InvalidConfigError, match="decode_attention"):
        RooflineLatencyModel("facebook/opt-13b", "a100-80g", decode_attention="flat")


def profile_dict(attention: str | None, **meta: object) -> dict:
    if attention is not None:
        meta["decode_attention"] = attention
    return {"format": "distserve-profile/1", "model": "facebook/opt-13b", "hardware": "a100-80g", "units": "ms", "meta": meta,
            "tp": {"1": {"prefill": [10.0, 0.1, 0.0], "decoding_smallbs": [5.0, 0.01, 1.0], "decoding_largebs": [5.0, 0.01, 1.0],
                         "decoding_large_small_bs_threshold": 95}}}


def test_profiles_say_what_their_backend_read() -> None:
    assert FittedLatencyModel.from_profile(profile_dict("cascade")).decode_attention == "cascade"
    assert FittedLatencyModel.from_profile(profile_dict("cascade", cascade_node_ms=0.3)).cascade_node_s == pytest.approx(0.3e-3)
    assert FittedLatencyModel.from_profile(profile_dict("cascade", cascade_shared_fraction=0.1)).cascade_unread == pytest.approx(0.9)
    assert FittedLatencyModel.from_profile(profile_dict(None)).decode_attention == "sum"
    # An instance running another backend than the profiled one: say what it reads.
    assert FittedLatencyModel.from_profile(profile_dict("sum"), decode_attention="cascade").decode_attention == "cascade"
    assert get_latency_model("facebook/opt-13b", decode_attention="cascade").decode_attention == "cascade"
    with pytest.raises(InvalidConfigError, match="decode_attention"):
        get_latency_model("facebook/opt-13b", profile=profile_dict("sum"), decode_attention="wide")
    for bad in ({"decode_attention": "flat"}, {"decode_attention": "cascade", "cascade_node_ms": "x"},
                {"decode_attention": "cascade", "cascade_node_ms": -2}, {"decode_attention": "cascade", "cascade_shared_fraction": 2}):
        with pytest.raises(InvalidConfigError, match="meta"):
            FittedLatencyModel.from_profile(profile_dict(None, **bad))
    # The shipped profiles still load, as what they were measured with.
    shipped = ROOT / "experiments" / "results" / "validate_simulator_profile.json"
    assert FittedLatencyModel.from_profile(shipped).decode_attention == "sum"
    assert FittedLatencyModel.from_profile(DISTSERVE_A100_PROFILE, model="facebook/opt-13b").decode_attention == "sum"


def test_a_fit_without_sharing_is_the_same_for_sum_and_cascade() -> None:
    """The profiler's grid has no shared prefixes, so a cascade run is an exact one: its samples fit the
    same coefficients whichever backend name the meta records, and predict the same unshared steps."""
    samples = json.loads((ROOT / "experiments" / "results" / "validate_simulator_profile.json").read_text())["samples"]
    fits = {a: build_profile("smollm2-135m", "cpu", {1: samples["1"]}, meta={"decode_attention": a}) for a in ("sum", "cascade")}
    assert fits["sum"]["tp"] == fits["cascade"]["tp"]
    models = {a: FittedLatencyModel.from_profile(p) for a, p in fits.items()}
    shape = BatchShape.of(decode_ctx_lens=[512] * 16)
    assert models["cascade"].step_time(shape) == models["sum"].step_time(shape)


def test_the_simulation_charges_shared_prefixes_once_with_a_cascade_model() -> None:
    """16 requests on a 1024-token prompt: with a cascade latency model their decode steps carry
    the saving and take less time; with a "sum" model the simulator never builds a prefix tree."""
    prefix = tuple(range(5000, 5000 + 64 * BS))
    requests = [Request(i, 0.0, len(prefix) + 8, 16, prompt_token_ids=prefix + tuple(100 * i + j for j in range(8))) for i in range(16)]
    config = SimConfig(block_size=BS, num_blocks=4096, enable_prefix_caching=True)
    results, saved = {}, {}
    for attention in ("sum", "cascade"):
        latency = FittedLatencyModel("facebook/opt-13b", COEFFS, decode_attention=attention)
        sim = Simulation(Placement.colocated_instances(1), latency, config)
        shapes: list[BatchShape] = []
        sim.on_plan = lambda _, plan, inst=sim.instances[0]: shapes.append(inst.batch_shape(plan))
        results[attention] = sim.run(requests)
        saved[attention] = max(s.decode_shared_saved for s in shapes)
        assert (sim.instances[0].cascade is None) == (attention == "sum")
    assert saved["sum"] == 0 and saved["cascade"] == 15 * len(prefix)
    assert all(r.completed for r in results["cascade"].records)
    last = {a: max(r.finish_s for r in res.records) for a, res in results.items()}
    assert last["cascade"] < last["sum"]
    assert cascade_rule_of(FittedLatencyModel("facebook/opt-13b", COEFFS, decode_attention="cascade")) == CascadeRule()
