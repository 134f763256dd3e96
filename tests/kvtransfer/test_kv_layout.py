"""Layer stages and KV-head shards: every layer and head is owned as the split promises."""

from __future__ import annotations

import pytest

from distserve.kvtransfer.layout import KVLayout, kv_head_range, layer_range


@pytest.mark.parametrize("num_layers", [1, 6, 7, 30, 32])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_layer_ranges_cover_every_layer_once_in_order(num_layers: int, pp: int) -> None:
    if num_layers < pp:
        with pytest.raises(ValueError):
            layer_range(num_layers, pp, 0)
        return
    ranges = [layer_range(num_layers, pp, r) for r in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_uneven_layers_go_to_earlier_stages() -> None:
    assert [layer_range(30, 4, r) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [layer_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]


def test_layer_range_rejects_bad_ranks() -> None:
    for args in [(6, 0, 0), (6, 2, 2), (6, 2, -1)]:
        with pytest.raises(ValueError):
            layer_range(*args)


@pytest.mark.parametrize("num_kv_heads,tp", [(4, 1), (4, 2), (4, 4), (8, 2), (3, 3), (3, 1)])
def test_even_head_split_partitions_heads(num_kv_heads: int, tp: int) -> None:
    owned = [h for r in range(tp) for h in range(*kv_head_range(num_kv_heads, tp, r))]
    assert owned == list(range(num_kv_heads))


def test_replicated_heads_follow_vllm() -> None:
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, 4, r) for r in range(4)] == [(0, 1)] * 4
    assert [kv_head_range(3, 6, r)[0] for r in range(6)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("num_kv_heads,tp", [(3, 2), (3, 4), (6, 4), (2, 3)])
def test_head_split_errors_when_not_divisible(num_kv_heads: int, tp: int) -> None:
    with pytest.raises(ValueError):
        kv_head_range(num_kv_heads, tp, 0)


def test_layout_helpers() -> None:
    layout = KVLayout(num_layers=7, num_kv_heads=4, head_dim=8, block_size=16, tp=2, pp=3)
    assert layout.world_size == 6
    assert layout.ranks() == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert [layout.rank(*c) for c in layout.ranks()] == list(range(6))
    assert layout.local_layers(2) == (5, 7) and layout.local_heads(1) == (2, 4)
    assert layout.local_shape(10, pp_rank=0, tp_rank=1) == (3, 2, 10, 16, 2, 8)
    with pytest.raises(ValueError):
        layout.coords(6)


@pytest.mark.parametrize(
    "kwargs",
    [dict(tp=2, num_kv_heads=3), dict(pp=8, num_layers=7), dict(dtype="float99"), dict(head_dim=0)],
)
def test_layout_rejects_impossible_splits(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = dict(num_layers=7, num_kv_heads=4, head_dim=8, block_size=16)
    with pytest.raises(ValueError):
        KVLayout(**{**base, **kwargs})  # type: ignore[arg-type]
