"""Latency profile files: ``TpCoefficients`` (DistServe's fitted form, per tp) read from DistServe's
published file or from ours (``distserve-profile/1``, written by ``simulator.fitting.build_profile``),
and written back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distserve.errors import InvalidConfigError, ModelNotFoundError
from simulator.hardware import HardwareSpec
from simulator.models import ModelSpec, get_model_spec, known_model

PROFILE_FORMAT = "distserve-profile/1"
DECODE_ATTENTION_READS = ("sum", "padded", "cascade")  # meta.decode_attention: what the profiled backend read
DEFAULT_HARDWARE = "a100-80g"  # DistServe's published coefficients were measured on A100-80G


@dataclass(frozen=True)
class TpCoefficients:
    """DistServe's fitted coefficients for one tp, in milliseconds.

    Prefill: ``a + b·Σl + c·Σl²``; decode: ``a + b·Σctx + c·batch``, with ``decode_small`` for
    batch sizes <= ``decode_threshold`` and ``decode_large`` above.
    """

    prefill: tuple[float, float, float]  # ms
    decode_small: tuple[float, float, float]  # ms
    decode_large: tuple[float, float, float]  # ms
    decode_threshold: int  # batch sizes <= threshold use decode_small
    fit_error: dict[str, float] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode_small", "decode_large"):
            values = getattr(self, name)
            if len(values) != 3:
                raise InvalidConfigError(f"{name} needs 3 coefficients (a, b, c), got {values!r}")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if self.decode_threshold < 0:
            raise InvalidConfigError(f"decode_threshold must be >= 0, got {self.decode_threshold}")


@dataclass(frozen=True)
class ProfileContents:
    """What a profile says: a ``FittedLatencyModel``'s constructor arguments."""

    model: ModelSpec
    coeffs: dict[int, TpCoefficients]
    hardware: HardwareSpec | str
    source: str
    decode_attention: str = "sum"  # what the profiled backend reads: "sum" | "padded" | "cascade"
    threads: int | None = None
    cascade_node_ms: float = 0.0  # per kept shared-prefix node of a cascade step (meta.cascade_node_ms)
    cascade_shared_fraction: float = 0.0  # a shared token's cost per further member (meta.cascade_shared_fraction)


def read_profile(
    profile: str | os.PathLike[str] | dict[str, Any],
    model: str | ModelSpec | None = None,
    hardware: HardwareSpec | str | None = None,
) -> ProfileContents:
    """A profile (a JSON file path or its parsed dict); arguments as ``FittedLatencyModel.from_profile``."""
    if isinstance(profile, dict):
        data: Any = profile
        source = "<dict>"
    else:
        source = os.fspath(profile)
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidConfigError(f"cannot read latency profile {source!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidConfigError(f"latency profile {source!r} is not a JSON object")
    if "format" in data:
        return _from_our_profile(data, source, model, hardware)
    return _from_distserve_profile(data, source, model, hardware)


def _from_our_profile(
    data: dict[str, Any], source: str, model: str | ModelSpec | None, hardware: HardwareSpec | str | None
) -> ProfileContents:
    if data["format"] != PROFILE_FORMAT:
        raise InvalidConfigError(f"profile {source!r}: format {data['format']!r} is not {PROFILE_FORMAT!r}")
    units = data.get("units", "ms")
    if units not in ("ms", "s"):
        raise InvalidConfigError(f"profile {source!r}: key 'units' must be 'ms' or 's', got {units!r}")
    scale = 1000.0 if units == "s" else 1.0
    profiled_model = _profile_key(data, "model", source)
    # The profiler records the architecture at the profiled dtype (KV bytes depend on it).
    arch = (data.get("meta") or {}).get("architecture")
    if model is None:
        model = _spec_from_architecture(arch, source) if arch is not None else str(profiled_model)
    else:
        name = model.name if isinstance(model, ModelSpec) else model
        known_a, known_b = known_model(name), known_model(str(profiled_model))
        if known_a is not None and known_b is not None and known_a is not known_b:
            raise InvalidConfigError(f"profile {source!r} is for model {profiled_model!r}, not {name!r}")
        if arch is not None and isinstance(model, str):
            model = _spec_from_architecture(arch, source)
    if hardware is None:
        hardware = str(_profile_key(data, "hardware", source))
    table = _profile_key(data, "tp", source)
    coeffs = _parse_tp_table(table, f"profile {source!r}", scale)
    attention = (data.get("meta") or {}).get("decode_attention", "sum")
    if attention not in DECODE_ATTENTION_READS:
        raise InvalidConfigError(
            f"profile {source!r}: meta.decode_attention must be one of {', '.join(map(repr, DECODE_ATTENTION_READS))}, got {attention!r}"
        )
    node_ms = _meta_number(data, "cascade_node_ms", source, 0.0, float("inf"))
    shared_fraction = _meta_number(data, "cascade_shared_fraction", source, 0.0, 1.0)
    threads = (data.get("meta") or {}).get("threads")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise InvalidConfigError(f"profile {source!r}: meta.threads must be an integer >= 1, got {threads!r}")
    return ProfileContents(_resolve_model(model, source), coeffs, hardware, source, attention, threads, node_ms, shared_fraction)


def _meta_number(data: dict[str, Any], key: str, source: str, lo: float, hi: float) -> float:
    """``meta[key]`` (0 if absent), a number in [lo, hi]; ``InvalidConfigError`` naming it otherwise."""
    value = (data.get("meta") or {}).get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise InvalidConfigError(f"profile {source!r}: meta.{key} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def _from_distserve_profile(
    data: dict[str, Any], source: str, model: str | ModelSpec | None, hardware: HardwareSpec | str | None
) -> ProfileContents:
    if not data:
        raise InvalidConfigError(f"latency profile {source!r} holds no models")
    if model is None:
        if len(data) != 1:
            raise InvalidConfigError(
                f"latency profile {source!r} holds several models, pass model= one of: {', '.join(data)}"
            )
        key = next(iter(data))
        spec_source: str | ModelSpec = key
    else:
        name = model.name if isinstance(model, ModelSpec) else model
        key = _match_model_key(name, data)
        if key is None:
            raise InvalidConfigError(
                f"model {name!r} is not in latency profile {source!r}; it holds: {', '.join(data)}"
            )
        spec_source = model if isinstance(model, ModelSpec) else key
    coeffs = _parse_tp_table(data[key], f"profile {source!r}, model {key!r}", 1.0)
    return ProfileContents(
        _resolve_model(spec_source, source), coeffs, hardware if hardware is not None else DEFAULT_HARDWARE, source
    )


def profile_json(model: str, hardware: str, source: str, coeffs: dict[int, TpCoefficients]) -> dict[str, Any]:
    """Coefficients in our profile format (no samples)."""
    return {
        "format": PROFILE_FORMAT,
        "model": model,
        "hardware": hardware,
        "units": "ms",
        "meta": {"source": source} if source else {},
        "tp": {str(tp): tp_entry(c) for tp, c in coeffs.items()},
    }


def _spec_from_architecture(arch: Any, source: str) -> ModelSpec:
    if not isinstance(arch, dict):
        raise InvalidConfigError(f"profile {source!r}: key 'meta.architecture' must be an object")
    try:
        return ModelSpec(**arch)
    except TypeError as exc:
        raise InvalidConfigError(f"profile {source!r}: bad 'meta.architecture': {exc}") from exc


def _resolve_model(model: str | ModelSpec, source: str) -> ModelSpec:
    try:
        return model if isinstance(model, ModelSpec) else get_model_spec(model)
    except ModelNotFoundError as exc:
        raise InvalidConfigError(f"latency profile {source!r}: {exc}") from exc


def _match_model_key(name: str, data: dict[str, Any]) -> str | None:
    """The key of ``data`` naming ``name``: exact, case-insensitive, or through a known alias."""
    if name in data:
        return name
    by_lower = {key.lower(): key for key in data}
    key = by_lower.get(name.lower())
    if key is None:
        spec = known_model(name)
        if spec is not None:
            key = by_lower.get(spec.name.lower())
    return key


def _profile_key(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise InvalidConfigError(f"{where}: missing key {key!r}")
    return data[key]


def _triple(entry: dict[str, Any], key: str, where: str, scale: float) -> tuple[float, float, float]:
    values = _profile_key(entry, key, where)
    if not isinstance(values, (list, tuple)) or len(values) != 3:
        raise InvalidConfigError(f"{where}: key {key!r} must be a list of 3 numbers [a, b, c], got {values!r}")
    try:
        a, b, c = (float(v) * scale for v in values)
    except (TypeError, ValueError) as exc:
        raise InvalidConfigError(f"{where}: key {key!r} must hold numbers, got {values!r}") from exc
    return a, b, c


def _parse_tp_table(table: Any, where: str, scale: float) -> dict[int, TpCoefficients]:
    if not isinstance(table, dict) or not table:
        raise InvalidConfigError(f"{where}: expected a non-empty mapping of tp -> coefficients, got {table!r}")
    coeffs: dict[int, TpCoefficients] = {}
    for tp_key, entry in table.items():
        try:
            tp = int(tp_key)
        except (TypeError, ValueError) as exc:
            raise InvalidConfigError(f"{where}: tp key {tp_key!r} is not an integer") from exc
        entry_where = f"{where}, tp {tp_key}"
        if not isinstance(entry, dict):
            raise InvalidConfigError(f"{entry_where}: expected an object, got {entry!r}")
        threshold = _profile_key(entry, "decoding_large_small_bs_threshold", entry_where)
        if not isinstance(threshold, (int, float)) or threshold < 0:
            raise InvalidConfigError(
                f"{entry_where}: key 'decoding_large_small_bs_threshold' must be a number >= 0, got {threshold!r}"
            )
        coeffs[tp] = TpCoefficients(
            prefill=_triple(entry, "prefill", entry_where, scale),
            decode_small=_triple(entry, "decoding_smallbs", entry_where, scale),
            decode_large=_triple(entry, "decoding_largebs", entry_where, scale),
            decode_threshold=int(threshold),
            fit_error=dict(entry.get("fit_error") or {}),
        )
    return coeffs


def tp_entry(c: TpCoefficients) -> dict[str, Any]:
    """One tp's entry of a profile's ``tp`` table."""
    return {
        "prefill": list(c.prefill),
        "decoding_smallbs": list(c.decode_small),
        "decoding_largebs": list(c.decode_large),
        "decoding_large_small_bs_threshold": c.decode_threshold,
        "fit_error": dict(c.fit_error),
    }
