"""The resharding plan covers every (layer, KV head) of every decode worker exactly once."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from distserve.kvtransfer.layout import KVLayout
from distserve.kvtransfer.plan import TransferSlice, reshard_plan

SPLITS = list(itertools.product([1, 2, 4], [1, 2, 3]))  # (tp, pp)


def layout(tp: int, pp: int, num_kv_heads: int = 4, **kw: object) -> KVLayout:
    base: dict[str, object] = dict(num_layers=6, num_kv_heads=num_kv_heads, head_dim=8, block_size=4, tp=tp, pp=pp)
    return KVLayout(**{**base, **kw})  # type: ignore[arg-type]


def owned(lay: KVLayout, rank: int) -> set[tuple[int, int]]:
    tp_rank, pp_rank = lay.coords(rank)
    return {(l, h) for l in range(*lay.local_layers(pp_rank)) for h in range(*lay.local_heads(tp_rank))}


def check_plan(src: KVLayout, dst: KVLayout, plan: list[TransferSlice]) -> None:
    received: dict[int, Counter[tuple[int, int]]] = {r: Counter() for r in range(dst.world_size)}
    for s in plan:
        cells = {(l, h) for l in range(*s.layers) for h in range(*s.kv_heads)}
        assert cells, s
        assert cells <= owned(src, s.src_rank), f"{s}: source rank does not hold these"
        received[s.dst_rank].update(cells)
    for r in range(dst.world_size):
        assert set(received[r]) == owned(dst, r), f"dst rank {r} gets the wrong cells"
        assert max(received[r].values()) == 1, f"dst rank {r} gets a cell twice"


@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("src_split", SPLITS, ids=lambda s: f"src_tp{s[0]}pp{s[1]}")
@pytest.mark.parametrize("dst_split", SPLITS, ids=lambda s: f"dst_tp{s[0]}pp{s[1]}")
def test_every_dst_cell_covered_once_by_a_holder(
    num_kv_heads: int, src_split: tuple[int, int], dst_split: tuple[int, int]
) -> None:
    src, dst = layout(*src_split, num_kv_heads=num_kv_heads), layout(*dst_split, num_kv_heads=num_kv_heads)
    check_plan(src, dst, reshard_plan(src, dst))


def test_plan_order_is_deterministic_and_sorted_by_destination() -> None:
    src, dst = layout(2, 3), layout(4, 2)
    plan = reshard_plan(src, dst)
    assert plan == reshard_plan(layout(2, 3), layout(4, 2))
    assert [s.dst_rank for s in plan] == sorted(s.dst_rank for s in plan)


def test_same_layout_is_rank_to_rank() -> None:
    lay = layout(2, 3)
    plan = reshard_plan(lay, lay)
    assert [(s.src_rank, s.dst_rank) for s in plan] == [(r, r) for r in range(6)]


def test_replicated_source_heads_spread_over_holders() -> None:
    src, dst = layout(4, 1, num_kv_heads=2), layout(4, 1, num_kv_heads=2)
    # Each head is held by two source ranks and needed by two destination ranks: one each.
    assert sorted(s.src_rank for s in reshard_plan(src, dst)) == [0, 1, 2, 3]
    src, dst = layout(4, 1, num_kv_heads=2), layout(1, 3, num_kv_heads=2)
    assert len({s.src_rank for s in reshard_plan(src, dst)}) == 4


def test_plan_is_cached_and_callers_cannot_corrupt_it() -> None:
    src, dst = layout(1, 2), layout(2, 1)
    first = reshard_plan(src, dst)
    first.clear()
    hits = reshard_plan.cache_info().hits  # type: ignore[attr-defined]
    again = reshard_plan(src, dst)
    assert again and reshard_plan.cache_info().hits == hits + 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "change", [dict(num_layers=7), dict(num_kv_heads=8), dict(head_dim=16), dict(block_size=8), dict(dtype="bfloat16")]
)
def test_mismatched_models_rejected(change: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="different KV caches"):
        reshard_plan(layout(1, 1), layout(1, 1, **change))  # type: ignore[arg-type]


def test_slice_nbytes() -> None:
    lay = layout(1, 1)
    s = TransferSlice(0, 0, (1, 4), (0, 2))
    assert s.shape(5, lay) == (3, 2, 5, 4, 2, 8)
    assert s.nbytes(5, lay) == 3 * 2 * 5 * 4 * 2 * 8 * 4
