"""Scheduling classes (``distserve.cluster.classes``): validation, routing preferences, group
stickiness, and the same class behaviour from ``LocalDisaggEngine`` and the simulator.

The behaviour tests run ``drivers_util.class_workload`` (throughput prompts queueing on two prefill
instances, latency requests arriving behind them, a task group arriving over three rounds) through
both drivers and check, on each driver's own trace: latency requests finish their prefill before
earlier-arriving throughput requests still queued; a task group's members are prefilled one after
the other on one prefill instance and decoded on one decode instance; latency and throughput
requests never share a decode step; a default request is kept off the latency instance at its cap.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from distserve.cluster.classes import (
    DEFAULT_CLASS, MAX_GROUP_CHARS, MAX_REMEMBERED_GROUPS, InvalidRequestClassError, RequestClass, check_request_class,
    decode_preference,
)
from distserve.cluster.routing import RouteState, decode_order, pick_entry
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import LoadedModel, load_model
from distserve.placement import Placement
from distserve.slo import SLO, attainment, slo_for_objective
from distserve.cluster.admission import AT_ONCE
from drivers_util import CLASS_SETUP, GROUP, LATENCY, THROUGHPUT, Arrival, Trace, class_workload, run_engine, run_simulator
from simulator.latency import get_latency_model
from simulator.metrics import RequestRecord
from simulator.simulation import SimConfig, simulate
from simulator.workload import Request, load_trace, write_trace


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


# ---- the class itself -----------------------------------------------------------------------
def test_a_request_class_is_validated_naming_the_field() -> None:
    assert RequestClass() == DEFAULT_CLASS and DEFAULT_CLASS.rank == 1 and LATENCY.rank == 0 and THROUGHPUT.rank == 2
    for kwargs, param in (({"objective": "fast"}, "objective"), ({"objective": None}, "objective"),
                          ({"group": ""}, "group"), ({"group": 7}, "group"), ({"group": "g" * (MAX_GROUP_CHARS + 1)}, "group")):
        with pytest.raises(InvalidRequestClassError) as err:
            RequestClass(**kwargs)  # type: ignore[arg-type]
        assert err.value.param == param
    assert check_request_class(None) is DEFAULT_CLASS and check_request_class(LATENCY) is LATENCY
    with pytest.raises(InvalidRequestClassError) as err:
        check_request_class("latency")
    assert err.value.param == "request_class"


def test_the_dataflow_call_shape_reaches_the_sequence(tiny: LoadedModel) -> None:
    """What the dataflow executor passes (``RequestClass(objective=node.objective or "default", group=node.task_group)``)."""
    engine = LLMEngine(tiny, cache_config=CacheConfig(num_blocks=64, block_size=4))
    objective, task_group = None, "call-3"
    rid = engine.add_request("hi", SamplingParams(max_tokens=2), request_class=RequestClass(objective=objective or "default", group=task_group))
    assert engine._seqs[rid].request_class == RequestClass("default", "call-3")
    with pytest.raises(InvalidRequestClassError):
        engine.add_request("hi", SamplingParams(max_tokens=2), request_class="latency")  # type: ignore[arg-type]
    assert engine.num_requests == 1  # refused before anything was queued


# ---- routing --------------------------------------------------------------------------------
def states(n: int) -> list[RouteState]:
    return [RouteState() for _ in range(n)]


def test_decode_preference_tiers() -> None:
    cap = 4
    # (num_latency, num_throughput, num_assigned) of an instance -> preference (0 best)
    idle, latency_room, latency_full, throughput, mixed = (0, 0, 0), (1, 0, 2), (2, 0, 4), (0, 3, 3), (1, 1, 2)
    expect = {
        "latency": {latency_room: 0, idle: 1, latency_full: 1, throughput: 2, mixed: 2},
        "throughput": {idle: 0, throughput: 0, latency_room: 1, latency_full: 1, mixed: 1},
        "default": {idle: 0, throughput: 0, latency_room: 0, mixed: 0, latency_full: 1},
    }
    for objective, tiers in expect.items():
        for (num_latency, num_throughput, num_assigned), pref in tiers.items():
            assert decode_preference(objective, num_latency, num_throughput, num_assigned, cap) == pref, (objective, num_latency)


def test_decode_order_keeps_latency_and_throughput_apart_when_there_is_a_choice() -> None:
    d = states(3)
    d[0].assign("t", THROUGHPUT)
    d[1].assign("l", LATENCY)
    d[1].assign("x", DEFAULT_CLASS)  # d2: idle
    ident = lambda s: s  # noqa: E731
    # Latency: join the latency instance below its cap, then no throughput work, then fewest assigned.
    assert decode_order(d, ident, LATENCY) == [d[1], d[2], d[0]]
    assert decode_order(d, ident, THROUGHPUT) == [d[2], d[0], d[1]]
    assert decode_order(d, ident, DEFAULT_CLASS) == decode_order(d, ident) == [d[2], d[0], d[1]]
    # At its cap (2 requests here) the latency instance is left alone while another has room.
    assert decode_order(d, ident, LATENCY, latency_cap=2) == [d[2], d[1], d[0]]
    assert decode_order(d, ident, DEFAULT_CLASS, latency_cap=2) == [d[2], d[0], d[1]]
    e = states(2)
    e[0].assign("l", LATENCY)
    for rid in ("a", "b", "c"):
        e[0 if rid == "a" else 1].assign(rid)
    assert decode_order(e, ident, DEFAULT_CLASS, latency_cap=2) == [e[1], e[0]]
    assert decode_order(e, ident, DEFAULT_CLASS, latency_cap=3) == [e[0], e[1]]  # equal load: the earlier
    d[2].assign("t2", THROUGHPUT)
    d[2].assign("t3", THROUGHPUT)
    assert decode_order(d, ident, LATENCY)[0] is d[1]  # the only instance without throughput work
    d[1].release("l")
    assert (d[1].num_latency, d[1].num_assigned) == (0, 1)
    assert decode_order(d, ident, THROUGHPUT)[0] is d[0]  # d1 no longer holds latency work, but d0 has fewer
    d[1].release("unknown")  # an id it never had: counts floor at zero, classes untouched
    assert (d[1].num_assigned, d[1].num_latency, d[1].num_throughput) == (0, 0, 0)


def test_a_task_group_sticks_to_its_entry_and_decode_instances() -> None:
    p, ident = states(2), (lambda s: s)
    first = pick_entry(p, ident, request_id="a", request_class=GROUP)
    assert first is p[0]
    for i in range(5):  # load the group's instance well past the other
        pick_entry([p[0]], ident, request_id=f"x{i}")
    assert pick_entry(p, ident, request_id="b", request_class=GROUP) is p[0]
    assert pick_entry(p, ident, request_id="c", request_class=THROUGHPUT) is p[1]  # no group: least loaded
    d = states(2)
    d[1].assign("a", GROUP)
    for i in range(3):
        d[1].assign(f"y{i}")
    assert decode_order(d, ident, GROUP)[0] is d[1]  # the group's decode instance, though busier
    assert decode_order(d, ident, THROUGHPUT)[0] is d[0]


def test_route_state_group_memory_is_bounded() -> None:
    s = RouteState()
    for i in range(MAX_REMEMBERED_GROUPS + 5):
        s.assign(str(i), RequestClass("throughput", f"g{i}"))
    assert len(s.recent_groups) == MAX_REMEMBERED_GROUPS
    assert "g0" not in s.recent_groups and f"g{MAX_REMEMBERED_GROUPS + 4}" in s.recent_groups
    for i in range(MAX_REMEMBERED_GROUPS + 5):
        s.release(str(i))
    assert not s.classed and s.num_throughput == 0  # per-request class state goes with the request


# ---- the same behaviour from both drivers ---------------------------------------------------
def prefill_completions(trace: Trace) -> dict[str, list[str]]:
    """Per prefill instance, its requests in the order their prompts completed (one per plan index)."""
    done: dict[str, list[str]] = {}
    for inst, plans in trace.steps.items():
        if inst.startswith("prefill"):
            done[inst] = [sid for plan in plans for sid, _ in plan]  # no chunking: a chunk is a whole prompt
    return done


def check_class_behaviour(trace: Trace, arrivals: list[Arrival]) -> None:
    cls = {str(i): a.request_class for i, a in enumerate(arrivals)}
    arrival = {str(i): a.round for i, a in enumerate(arrivals)}
    # Latency requests overtake queued throughput prompts. Each prefill instance has prompts queued
    # from round 0 until it is done, so its k-th plan is round k's step (in both drivers).
    overtaken = 0
    for inst, order in prefill_completions(trace).items():
        assert all(len(plan) == 1 for plan in trace.steps[inst])  # budget 24: one prompt per step
        for k, sid in enumerate(order):
            if cls[sid].objective != "latency":
                continue
            assert k == arrival[sid] + sum(cls[o].objective == "latency" and arrival[o] == arrival[sid] for o in order[:k]), sid
            overtaken += sum(cls[t].objective == "throughput" and arrival[t] < arrival[sid] for t in order[k + 1:])
        # A task group is prefilled back to back (requests of a higher class may cut in).
        members = [k for k, sid in enumerate(order) if cls[sid].group is not None]
        if members:
            between = order[members[0] : members[-1] + 1]
            group_rank = cls[order[members[0]]].rank
            assert all(cls[s].group is not None or cls[s].rank < group_rank for s in between), between
    assert overtaken >= 3
    # The group lands on one prefill/decode pair.
    pairs = {(src, dst) for sid, src, dst in trace.migrations if cls[sid].group is not None}
    assert len(pairs) == 1, pairs
    # Latency and throughput requests never share a decode step (two decode instances: a choice).
    latency_instances, throughput_instances = set(), set()
    for inst, plans in trace.steps.items():
        if not inst.startswith("decode"):
            continue
        for plan in plans:
            objectives = [cls[sid].objective for sid, _ in plan]
            assert not ("latency" in objectives and "throughput" in objectives), plan
            if "latency" in objectives:
                latency_instances.add(inst)
            if "throughput" in objectives:
                throughput_instances.add(inst)
    assert len(latency_instances) == len(throughput_instances) == 1 and latency_instances != throughput_instances


def test_local_engine_and_simulator_show_the_same_class_behaviour(tiny: LoadedModel) -> None:
    arrivals = class_workload()
    engine_trace, engine = run_engine(tiny, CLASS_SETUP, arrivals)
    sim_trace = run_simulator(engine, CLASS_SETUP, arrivals)
    for trace in (engine_trace, sim_trace):
        check_class_behaviour(trace, arrivals)
        # The default request (11) found the latency instance at its cap of 2: it went to the other.
        latency_instance = next(dst for sid, _, dst in trace.migrations if sid == "0")
        assert next(dst for sid, _, dst in trace.migrations if sid == "11") != latency_instance
    # The rules can fail: with a cap of 16 the default request joins the latency instance (the
    # two hold as many requests; the first wins; without backpressure every request reaches the
    # prefill queues on arrival), and without the group a member enters on the other prefill instance.
    uncapped = replace(CLASS_SETUP, decode=replace(CLASS_SETUP.decode, latency_max_num_seqs=16))
    at_once = AT_ONCE
    for trace in (run_engine(tiny, uncapped, arrivals, admission=at_once)[0], run_simulator(engine, uncapped, arrivals, admission=at_once)):
        assert next(dst for sid, _, dst in trace.migrations if sid == "11") == next(dst for sid, _, dst in trace.migrations if sid == "0")
    ungrouped = [replace(a, request_class=THROUGHPUT) if a.request_class == GROUP else a for a in arrivals]
    trace, _ = run_engine(tiny, CLASS_SETUP, ungrouped)
    members = [str(i) for i, a in enumerate(arrivals) if a.request_class == GROUP]
    assert len({src for sid, src, _ in trace.migrations if sid in members}) == 2


# ---- latency requests get their first token sooner under contention ----------------------------
def test_latency_requests_get_lower_ttft_than_throughput_ones_on_the_real_engine(tiny: LoadedModel) -> None:
    """The colocated engine, real model, two sequences per batch: latency requests submitted after
    eight throughput requests are all served first."""
    engine = LLMEngine(tiny, cache_config=CacheConfig(num_blocks=128, block_size=4), scheduler_config=SchedulerConfig(max_num_seqs=2))
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    ids = {engine.add_request(f"throughput job {i}", sampling, request_class=THROUGHPUT): "throughput" for i in range(8)}
    ids |= {engine.add_request(f"someone waits {i}", sampling, request_class=LATENCY): "latency" for i in range(3)}
    ttft: dict[str, list[float]] = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ttft[ids[out.request_id]].append(out.metrics.ttft_s)
    assert len(ttft["latency"]) == 3 and len(ttft["throughput"]) == 8
    assert max(ttft["latency"]) < min(ttft["throughput"])


def test_latency_requests_get_lower_ttft_in_the_simulator_and_the_slo_follows_the_class() -> None:
    """1P1D on an A100 (roofline), OPT-13B, a Poisson mix of latency and throughput requests at a
    rate that queues prompts: latency requests' TTFT is far lower; throughput ones are judged on completion."""
    rng = np.random.default_rng(0)
    n = 300
    arrivals = np.cumsum(rng.exponential(1 / 12.0, n))
    objectives = rng.choice(["latency", "throughput"], n, p=[0.3, 0.7])
    requests = [Request(i, float(arrivals[i]), int(rng.integers(400, 1200)), int(rng.integers(16, 64)), objective=str(objectives[i]))
                for i in range(n)]
    result = simulate(Placement.disaggregated(1, 1), get_latency_model("opt-13b", "a100-80g"), requests, SimConfig())
    ttft = {o: [r.ttft_s for r in result.records if r.objective == o] for o in ("latency", "throughput")}
    assert np.mean(ttft["latency"]) * 2 < np.mean(ttft["throughput"])
    assert np.percentile(ttft["latency"], 90) < np.percentile(ttft["throughput"], 90)
    slo = SLO(ttft_s=float(np.percentile(ttft["latency"], 95)), tpot_s=1.0)
    att = attainment(result.records, slo)
    assert att["ttft"] >= 0.95  # throughput requests' TTFT is not checked; latency ones meet the target
    assert slo_for_objective(slo, "throughput") == SLO(attainment=slo.attainment) and slo_for_objective(slo, "latency") is slo
    late = RequestRecord(0, 0.0, 8, 4, objective="throughput", first_token_s=100.0, finish_s=400.0, num_output_tokens=4)
    assert attainment([late], slo)["joint"] == 1.0
    assert attainment([replace(late, objective="default")], slo)["joint"] == 0.0


def test_traces_carry_the_class(tmp_path: object) -> None:
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "t.jsonl"
    reqs = [Request(0, 0.0, 8, 4, objective="latency"), Request(1, 1.0, 8, 4, objective="throughput", group="g"), Request(2, 2.0, 8, 4)]
    write_trace(path, reqs)
    assert load_trace(path) == reqs
    path.write_text('{"arrival_s": 0, "prompt_len": 4, "output_len": 2, "objective": "urgent"}\n')
    with pytest.raises(Exception, match=r"t.jsonl:1: objective must be one of") as err:
        load_trace(path)
    assert getattr(err.value, "param", None) == "objective"


def test_serving_metrics_judge_a_request_by_its_class() -> None:
    """``/metrics``: a slow throughput request still meets the SLO (completion alone), a slow default
    one does not; the counter is labelled by objective (three values at most)."""
    from distserve.engine.outputs import RequestMetrics, RequestOutput
    from distserve.serving.metrics import ServingMetrics

    metrics = ServingMetrics(slo=SLO(ttft_s=1e-9, tpot_s=1e-9))
    for objective in ("throughput", "default"):
        timer = metrics.request_timer(objective)
        for i in range(3):
            timer.observe(RequestOutput(f"r-{objective}", [1], list(range(i + 1)), "", [i], "", i == 2, "length" if i == 2 else None,
                                        RequestMetrics(0.0, None, None, 1, 0, i + 1)))
    text = metrics.render().decode()
    assert 'distserve:request_slo_total{met="true",model_name="",objective="throughput"} 1.0' in text
    assert 'distserve:request_slo_total{met="false",model_name="",objective="default"} 1.0' in text
    with pytest.raises(ValueError, match="objective"):
        metrics.request_timer("urgent")
