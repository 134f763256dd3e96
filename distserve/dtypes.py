"""The dtypes models, KV caches and profiles run in, by name, and the one ``auto`` resolves to; without importing
torch, so that processes which only route requests (the controller, the API server of the Ray runtime) never load it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Bytes per element of each dtype distserve runs in (the names are torch's).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name of ``DTYPE_BYTES`` (KeyError for any other)."""
    if name not in DTYPE_BYTES:
        raise KeyError(name)
    import torch

    return getattr(torch, name)  # type: ignore[no-any-return]


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AMX or AVX512-BF16), where bf16 runs ~2x fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """``auto`` picks bfloat16 on CUDA and on CPUs with native bf16, float32 otherwise."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda") or cpu_has_fast_bf16():
        return "bfloat16"
    return "float32"
