"""Class pools of decode instances: the Placement fields, routing by class (``decode_order``) and the
migration queue's per-pool lanes."""

from __future__ import annotations

import asyncio
import json

import pytest

from distserve.cluster.classes import LATENCY, THROUGHPUT, RequestClass
from distserve.cluster.migration_queue import MigrationQueue
from distserve.cluster.routing import RouteState, decode_lane, decode_order
from distserve.config import SchedulerConfig
from distserve.errors import InvalidConfigError
from distserve.placement import InstanceSpec, Placement

LAT, THR = RequestClass(LATENCY), RequestClass(THROUGHPUT)


def test_pool_and_batch_cap_round_trip_through_json() -> None:
    p = Placement(prefill=(InstanceSpec(threads=2),),
                  decode=(InstanceSpec(pool="latency", max_num_seqs=8), InstanceSpec(pool="throughput", max_num_seqs=128), InstanceSpec()))
    data = json.loads(p.to_json())
    assert data["decode"][0]["pool"] == "latency" and data["decode"][0]["max_num_seqs"] == 8
    assert "pool" not in data["decode"][2] and "max_num_seqs" not in data["prefill"][0]  # unset fields are not written
    back = Placement.from_dict(data)
    assert back == p and back.pools == {"latency": 1, "throughput": 1, None: 1}
    assert p.decode[0].scheduler_config(SchedulerConfig()).max_num_seqs == 8
    assert p.decode[2].scheduler_config(SchedulerConfig(max_num_seqs=33)).max_num_seqs == 33


@pytest.mark.parametrize("item, param", [
    ({"tp": 1, "pool": "fast"}, "pool"),
    ({"tp": 1, "pool": 3}, "pool"),
    ({"tp": 1, "max_num_seqs": 0}, "max_num_seqs"),
    ({"tp": 1, "max_num_seqs": 2.5}, "max_num_seqs"),
    ({"tp": 1, "max_num_seqs": True}, "max_num_seqs"),
])
def test_a_bad_pool_or_cap_is_refused_naming_the_field(item: dict, param: str) -> None:
    with pytest.raises(InvalidConfigError, match=r"decode\[0\]") as exc:
        Placement.from_dict({"prefill": [{"tp": 1}], "decode": [item]})
    assert exc.value.param == param


def test_only_decode_instances_have_a_pool() -> None:
    with pytest.raises(InvalidConfigError, match="only decode") as exc:
        Placement.from_dict({"prefill": [{"tp": 1, "pool": "latency"}], "decode": [{"tp": 1}]})
    assert exc.value.param == "pool"


def test_a_request_goes_to_its_pool_then_shared_never_to_another_pool_while_those_exist() -> None:
    lat, thr, shared = RouteState(pool="latency"), RouteState(pool="throughput"), RouteState()
    insts = [thr, shared, lat]
    assert decode_order(insts, lambda s: s, LAT) == [lat, shared]
    assert decode_order(insts, lambda s: s, THR) == [thr, shared]
    assert decode_order(insts, lambda s: s, None) == [shared]  # a default request: the shared pool
    # Its own pool first however loaded it is; the shared pool next.
    for i in range(20):
        lat.assign(f"l{i}", LAT)
    assert decode_order(insts, lambda s: s, LAT) == [lat, shared]
    # Without its pool or a shared one (e.g. they died): the other pools, so it is never stranded.
    assert decode_order([thr], lambda s: s, LAT) == [thr]
    assert set(decode_order([thr, lat], lambda s: s, None)) == {thr, lat}
    # Without pools: exactly the order of before (fewest assigned first).
    a, b = RouteState(), RouteState()
    a.assign("x")
    assert decode_order([a, b], lambda s: s, LAT) == [b, a]


def test_decode_lanes_keep_one_pool_from_blocking_another() -> None:
    pools = {"latency", "throughput"}
    assert decode_lane(LAT, pools) == "latency" and decode_lane(THR, pools) == "throughput"
    assert decode_lane(None, pools) is None and decode_lane(LAT, {None}) is None
    # The latency pool is full: its head waits, the throughput request behind it moves on.
    q: MigrationQueue[tuple[str, str]] = MigrationQueue()
    for entry in [("a", "latency"), ("b", "throughput"), ("c", "latency"), ("d", "throughput")]:
        q.push(entry)
    moved: list[str] = []

    def move(entry: tuple[str, str]) -> bool:
        if entry[1] == "latency":
            return False
        moved.append(entry[0])
        return True

    q.drain(move, lambda e: e[1])
    assert moved == ["b", "d"] and [e[0] for e in q] == ["a", "c"]
    # One lane: nobody overtakes (FCFS, as before).
    q.push(("e", "throughput"))
    q.drain(move)
    assert [e[0] for e in q] == ["a", "c", "e"]

    async def amove(entry: tuple[str, str]) -> bool:
        return move(entry)

    asyncio.run(q.drain_async(amove, lambda e: e[1]))
    assert moved == ["b", "d", "e"] and [e[0] for e in q] == ["a", "c"]


def test_local_engine_decodes_each_class_on_its_pool_with_its_cap() -> None:
    from distserve.config import CacheConfig, SamplingParams
    from distserve.engine.weights import load_model
    from distserve.runtime.local_disagg import LocalDisaggEngine

    placement = Placement(prefill=(InstanceSpec(),),
                          decode=(InstanceSpec(pool="throughput", max_num_seqs=6), InstanceSpec(), InstanceSpec(pool="latency", max_num_seqs=2)))
    e = LocalDisaggEngine(load_model("tiny"), cache_config=CacheConfig(num_blocks=256, block_size=4), placement=placement)
    assert [d.core.scheduler.max_running for d in e.decode] == [6, 64, 2]
    assert [d.route.pool for d in e.decode] == ["throughput", None, "latency"]
    decoded_on: dict[str, str] = {}
    e.on_migration = lambda rid, src, dst: decoded_on.__setitem__(rid, dst)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(4):
        e.add_request([1, 2, 3, 4 + i], sp, request_id=f"lat-{i}", request_class=LAT)
        e.add_request([5, 6, 7, 8 + i], sp, request_id=f"thr-{i}", request_class=THR)
        e.add_request([9, 10, 11, 12 + i], sp, request_id=f"def-{i}")
    while e.has_unfinished_requests():
        e.step()
    assert {rid: dst for rid, dst in decoded_on.items() if rid.startswith("thr")} == {f"thr-{i}": "decode-0" for i in range(4)}
    assert {rid: dst for rid, dst in decoded_on.items() if rid.startswith("def")} == {f"def-{i}": "decode-1" for i in range(4)}
    # Latency requests: their pool first; when its cap of 2 is full, the shared instance, never the throughput pool.
    lat = {dst for rid, dst in decoded_on.items() if rid.startswith("lat")}
    assert "decode-2" in lat and "decode-0" not in lat
    with pytest.raises(InvalidConfigError, match="TP/PP"):
        LocalDisaggEngine(load_model("tiny"), placement=Placement.disaggregated(1, 1, decode_tp=2))


def test_ray_deployment_decodes_each_class_on_its_pool_with_its_cap(ray_cluster: object) -> None:
    """``serve --placement`` on Ray: each decode instance's scheduler gets its spec's cap, its
    RouteState its pool, and the controller's migrations route by class."""
    from serving_util import ControllerRuntime

    from distserve.config import CacheConfig, SamplingParams
    from distserve.runtime.controller import StepEvent

    placement = Placement(prefill=(InstanceSpec(),), decode=(InstanceSpec(pool="throughput", max_num_seqs=3), InstanceSpec(pool="latency", max_num_seqs=2)))
    rt = ControllerRuntime(placement, CacheConfig(num_blocks=128, block_size=4), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    try:
        decodes = [i for i in rt.controller.instances if i.phase == "decode"]
        assert [(i.spec.scheduler.max_num_seqs, i.route.pool) for i in decodes] == [(3, "throughput"), (2, "latency")]
        decoded_on: dict[str, str] = {}

        def listen(event: StepEvent) -> None:
            for rid in event.result.received:
                decoded_on[rid] = event.instance_id

        rt.controller.add_step_listener(listen)

        async def one(request_id: str, request_class: RequestClass) -> None:
            async for _ in rt.controller.generate([1, 2, 3, len(decoded_on) + 4], rt.sampling, request_id, request_class=request_class):
                pass

        async def all_of() -> None:
            await asyncio.gather(*(one(f"{kind}-{i}", cls) for i in range(3) for kind, cls in (("lat", LAT), ("thr", THR))))

        rt.run(all_of(), timeout_s=120.0)
        assert decoded_on == {**{f"lat-{i}": "decode-1" for i in range(3)}, **{f"thr-{i}": "decode-0" for i in range(3)}}
    finally:
        rt.close()
