"""``PrepackedLinear``: oneDNN's prepacked weight, inputs padded to few row counts (``padded_rows``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distserve.engine import model as model_mod
from distserve.engine.model import PrepackedLinear, padded_rows, prepack_linears


def test_padded_rows_are_few_never_fewer_than_asked_and_pad_less_than_an_eighth_above_64() -> None:
    sizes = [padded_rows(t) for t in range(1, 2049)]
    assert all(p >= t for t, p in zip(range(1, 2049), sizes))
    assert sizes == sorted(sizes)  # monotone: a larger batch never gets fewer rows
    assert len(set(sizes)) <= 56
    assert all(padded_rows(p) == p for p in set(sizes))  # a padded size pads to itself
    assert all(padded_rows(t) - t < max(4, t / 8) for t in range(1, 8192))
    assert [padded_rows(t) for t in (1, 3, 4, 5, 16, 17, 33, 65, 129, 1000)] == [4, 4, 4, 8, 16, 20, 36, 72, 144, 1024]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 19, 70, 300])
def test_padded_output_is_the_linear_of_the_rows_given(dtype: torch.dtype, rows: int) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not available")
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).to(dtype)
    packed = PrepackedLinear(linear)
    x = torch.randn(rows, 64).to(dtype)  # [rows, 64]
    with torch.no_grad():
        out = packed(x)
        ref = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert out.shape == (rows, 96) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_onednn_sees_only_padded_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not available")
    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __getattr__(self, name: str):  # the rest of torch.ops.mkldnn as it is
            return getattr(torch.ops.mkldnn, name)

        @staticmethod
        def _linear_pointwise(x: torch.Tensor, *args):  # noqa: ANN205
            seen.append(x.shape[0])
            return real(x, *args)

    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32))
    assert prepack_linears(model) == 2
    monkeypatch.setattr(model_mod.torch.ops, "mkldnn", Spy(), raising=False)
    with torch.no_grad():
        for rows in range(3, 400):
            assert model(torch.randn(rows, 32)).shape == (rows, 32)
    assert set(seen) == {padded_rows(t) for t in range(3, 400)}
    assert len(set(seen)) <= 37  # ~400 row counts given, 37 shapes met
