"""The cluster core's routing rule and migration queue, on their own."""

from __future__ import annotations

import asyncio

from distserve.cluster.migration_queue import MigrationQueue
import pytest

from distserve.cluster.routing import MAX_AFFINITY_IMBALANCE, ROUTERS, RouteState, check_router, decode_order, pick_entry
from distserve.errors import InvalidConfigError


def states(n: int) -> list[RouteState]:
    return [RouteState() for _ in range(n)]


def test_without_prefixes_the_least_assigned_first_instance_wins() -> None:
    insts = states(3)
    picks = []
    for _ in range(6):
        chosen = pick_entry(insts, lambda s: s)
        picks.append(next(i for i, s in enumerate(insts) if s is chosen))
    assert picks == [0, 1, 2, 0, 1, 2]
    assert [s.num_assigned for s in insts] == [2, 2, 2]
    insts[1].release()
    assert pick_entry(insts, lambda s: s) is insts[1]


def test_prefix_affinity_is_bounded_by_load() -> None:
    insts = states(2)
    hashes = [11, 22, 33]
    first = pick_entry(insts, lambda s: s, hashes)
    assert first is insts[0] and first.cached_blocks(hashes) == 3 and insts[1].cached_blocks(hashes) == 0
    # The same prefix keeps going to the instance that cached it, until it is too far ahead.
    for _ in range(MAX_AFFINITY_IMBALANCE):
        assert pick_entry(insts, lambda s: s, hashes) is insts[0]
    assert insts[0].num_assigned == MAX_AFFINITY_IMBALANCE + 1
    assert pick_entry(insts, lambda s: s, hashes) is insts[1]
    # A longer cached prefix beats a shorter one.
    insts[1].remember([11, 22, 33, 44])
    assert pick_entry(insts, lambda s: s, [11, 22, 33, 44]) is insts[1]


def test_decode_order_is_fewest_assigned_then_earliest() -> None:
    insts = states(3)
    insts[0].num_assigned, insts[1].num_assigned, insts[2].num_assigned = 2, 0, 0
    assert decode_order(insts, lambda s: s) == [insts[1], insts[2], insts[0]]


def test_migration_queue_is_fcfs_and_nobody_overtakes() -> None:
    q: MigrationQueue[str] = MigrationQueue()
    for x in "abcd":
        q.push(x)
    room = {"a": True, "b": False, "c": True, "d": True}
    moved: list[str] = []

    def move(x: str) -> bool:
        if room[x]:
            moved.append(x)
        return room[x]

    q.drain(move)
    assert moved == ["a"] and list(q) == ["b", "c", "d"]  # c would fit, but b waits first
    q.drop(lambda x: x == "b")
    q.drain(move)
    assert moved == ["a", "c", "d"] and not q and len(q) == 0


def test_async_drain_honours_entries_dropped_while_a_move_awaits() -> None:
    q: MigrationQueue[str] = MigrationQueue()
    for x in "abc":
        q.push(x)

    async def move(x: str) -> bool:
        if x == "a":
            q.drop(lambda e: e == "b")  # e.g. aborted while the reservation for "a" was in flight
            q.push("d")
        await asyncio.sleep(0)
        return True

    asyncio.run(q.drain_async(move))
    assert not q


def test_least_loaded_ignores_prefixes_and_unknown_routers_are_refused() -> None:
    insts = states(2)
    hashes = [11, 22, 33]
    picks = [pick_entry(insts, lambda s: s, hashes, "least-loaded") for _ in range(4)]
    assert picks == [insts[0], insts[1], insts[0], insts[1]]  # prefix affinity would have kept them on insts[0]
    assert insts[1].cached_blocks(hashes) == 3  # both remember what they saw: switching routers keeps working
    assert sorted(ROUTERS) == ["least-loaded", "prefix-affinity"]
    with pytest.raises(InvalidConfigError, match="unknown router 'random'"):
        check_router("random")
    with pytest.raises(InvalidConfigError, match="unknown router"):
        pick_entry(insts, lambda s: s, hashes, "random")
