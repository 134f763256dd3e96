"""Decode-attention backends by name: the one place that lists them and picks the device's default.

* ``padded`` / ``exact``: per-sequence paged decode (``kernels.decode_attention``).
* ``cascade``: shared prefixes read once per group, in torch (``kernels.cascade_attention``); the CPU
  default — a step with no shared prefix that pays (its ``CascadeRule``) runs ``exact`` unchanged.
* ``triton``: the same cascade as ``@triton.jit`` kernels (``kernels.triton_attention``); on CPU only
  under ``TRITON_INTERPRET=1`` (the tests), on CUDA natively (untested here: no GPU).
* ``flashinfer``: FlashInfer's ``MultiLevelCascadeAttentionWrapper`` (``kernels.flashinfer_attention``),
  an optional extra for CUDA (untested here: no GPU).

Backends are built on first use and shared: a backend holds no per-step state (its plan does).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from distserve.errors import InvalidConfigError
from kernels.decode_attention import DecodeAttention

# name -> "module:class"; imported on first use, so optional backends cost nothing until chosen.
DECODE_ATTENTION_BACKENDS: dict[str, str] = {
    "padded": "kernels.decode_attention:PaddedDecodeAttention",
    "exact": "kernels.decode_attention:ExactDecodeAttention",
    "cascade": "kernels.cascade_attention:CascadeDecodeAttention",
    "triton": "kernels.triton_attention:TritonCascadeDecodeAttention",
    "flashinfer": "kernels.flashinfer_attention:FlashInferCascadeDecodeAttention",
}
_BUILT: dict[str, DecodeAttention] = {}


def default_decode_attention(device: torch.device | str = "cpu") -> str:
    """``cascade`` on CPU (torch; its log-sum-exp comes from the CPU flash kernel); on CUDA
    ``flashinfer`` when installed, else ``triton`` when installed, else ``padded``."""
    if torch.device(device).type == "cpu":
        return "cascade"
    for name, module in (("flashinfer", "flashinfer"), ("triton", "triton")):
        if importlib.util.find_spec(module) is not None:
            return name
    return "padded"


def get_decode_attention(name: str) -> DecodeAttention:
    """The backend called ``name``. Raises ``InvalidConfigError`` (a ValueError naming
    ``decode_attention``) for an unknown name or one whose library is missing (naming what to install)."""
    backend = _BUILT.get(name)
    if backend is not None:
        return backend
    target = DECODE_ATTENTION_BACKENDS.get(name)
    if target is None:
        raise InvalidConfigError(f"unknown decode attention {name!r}; choose one of {sorted(DECODE_ATTENTION_BACKENDS)}", "decode_attention")
    module_name, cls_name = target.split(":")
    try:
        backend = getattr(importlib.import_module(module_name), cls_name)()
    except ImportError as exc:  # the module's library, or one its constructor needs
        raise InvalidConfigError(f"decode attention {name!r} needs a library that is not installed: {exc}", "decode_attention") from exc
    _BUILT[name] = backend
    return backend


def available_decode_attentions(device: torch.device | str = "cpu") -> list[str]:
    """The backends that run on ``device`` in this process: ``triton`` on CPU only under
    ``TRITON_INTERPRET=1``, ``flashinfer`` only on CUDA; each only if its library imports."""
    cuda = torch.device(device).type == "cuda"
    names = ["padded", "exact", "cascade"]
    if importlib.util.find_spec("triton") is not None and (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        names.append("triton")
    if cuda and importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    return names


def register_decode_attention(name: str, backend: DecodeAttention) -> None:
    """Make ``backend`` selectable as ``name`` (a plug-in, or a variant with other settings)."""
    DECODE_ATTENTION_BACKENDS[name] = f"{type(backend).__module__}:{type(backend).__qualname__}"
    _BUILT[name] = backend


def unregister_decode_attention(name: str) -> None:
    DECODE_ATTENTION_BACKENDS.pop(name, None)
    _BUILT.pop(name, None)


# Built-in backends bound to a device (``available_decode_attentions`` says where each runs).
_DEVICE_BOUND = {
    "triton": "runs on CUDA, or on CPU only under TRITON_INTERPRET=1 (Triton's interpreter, for tests)",
    "flashinfer": "runs on CUDA only",
}


def decode_attention_for(name: str, device: torch.device | str) -> DecodeAttention:
    """``get_decode_attention(name)``, refused up front (``InvalidConfigError``) where a built-in
    backend cannot run on ``device`` — rather than failing every step."""
    backend = get_decode_attention(name)
    if name in _DEVICE_BOUND and name not in available_decode_attentions(device):
        raise InvalidConfigError(
            f"decode attention {name!r} {_DEVICE_BOUND[name]}; on {torch.device(device).type} use 'cascade' (the default)",
            "decode_attention",
        )
    return backend
