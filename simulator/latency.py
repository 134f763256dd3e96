"""Step-time models of one LLM on one device type: an analytical roofline and DistServe's fitted form.

The simulator calls ``step_time`` once per simulated step, so it is plain arithmetic on the few
aggregates a ``BatchShape`` carries, with everything that depends only on (tp, pp) precomputed.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from distserve.errors import InvalidConfigError, ModelNotFoundError
from simulator.hardware import HardwareSpec, get_hardware
from simulator.models import ModelSpec, get_model_spec, known_model

PROFILE_FORMAT = "distserve-profile/1"
DEFAULT_HARDWARE = "a100-80g"  # DistServe's published coefficients were measured on A100-80G
_MIN_FIT_SAMPLES = 3  # three coefficients per phase


@dataclass(frozen=True, slots=True)
class BatchShape:
    """Aggregates of one batch; cheap to build (the simulator builds one per step, keep it light)."""

    num_prefill: int = 0
    prefill_tokens: int = 0  # Σ l over prefill chunks (new tokens)
    prefill_sq: int = 0  # Σ ((s + l)^2 - s^2): causal work of l new tokens after s cached ones (l^2 for a prompt)
    num_decode: int = 0
    decode_ctx: int = 0  # Σ context length of decodes (including the new token)
    decode_max_ctx: int = 0  # the longest of them (a kernel that pads every decode to it reads num_decode × this)

    @classmethod
    def of(
        cls,
        prefill_lens: Sequence[int] = (),
        decode_ctx_lens: Sequence[int] = (),
        prefill_offsets: Sequence[int] | None = None,
    ) -> BatchShape:
        """Shape of prefill chunks of ``prefill_lens`` new tokens (after ``prefill_offsets`` cached
        ones, default 0) and decodes whose contexts are ``decode_ctx_lens`` long."""
        if prefill_offsets is None:
            prefill_sq = sum(n * n for n in prefill_lens)
        else:
            if len(prefill_offsets) != len(prefill_lens):
                raise InvalidConfigError(
                    f"prefill_offsets has {len(prefill_offsets)} entries but prefill_lens has {len(prefill_lens)}"
                )
            prefill_sq = sum((s + n) * (s + n) - s * s for n, s in zip(prefill_lens, prefill_offsets))
        return cls(len(prefill_lens), sum(prefill_lens), prefill_sq, len(decode_ctx_lens), sum(decode_ctx_lens),
                   max(decode_ctx_lens, default=0))


class LatencyModel(ABC):
    """Step times of one model on one hardware type, for any (tp, pp) it supports."""

    model: ModelSpec
    hardware: HardwareSpec
    # Torch threads per worker the step times were measured with (profiles of a CPU); None otherwise.
    threads: int | None = None

    @abstractmethod
    def step_time(self, shape: BatchShape, tp: int = 1, pp: int = 1) -> float:
        """Seconds ONE pipeline stage spends on the batch (with pp == 1: the whole step).

        A batch crosses pp stages in ``pp * step_time`` (stage-to-stage activation sends included in
        ``step_time``). An empty batch takes 0.0.

        Raises:
            InvalidConfigError: the model does not support (tp, pp).
        """

    @abstractmethod
    def supports(self, tp: int, pp: int) -> bool:
        """Whether ``step_time`` can answer for this parallel layout."""

    def prefill_time(self, prompt_lens: Sequence[int], tp: int = 1, pp: int = 1) -> float:
        """Whole-model latency (all pp stages) of one prefill batch of whole prompts."""
        return pp * self.step_time(BatchShape.of(prefill_lens=prompt_lens), tp, pp)

    def decode_time(self, ctx_lens: Sequence[int], tp: int = 1, pp: int = 1) -> float:
        """Whole-model latency (all pp stages) of one decode step of requests with these contexts."""
        return pp * self.step_time(BatchShape.of(decode_ctx_lens=ctx_lens), tp, pp)

    def migration_time(self, num_bytes: int, same_node: bool = True, num_links: int = 1) -> float:
        """Seconds to move ``num_bytes`` (e.g. KV) over ``num_links`` parallel device links."""
        if num_bytes < 0 or num_links < 1:
            raise InvalidConfigError(f"migration needs num_bytes >= 0 and num_links >= 1, got {num_bytes}, {num_links}")
        if num_bytes == 0:
            return 0.0
        hw = self.hardware
        bandwidth = hw.intra_node_bandwidth if same_node else hw.inter_node_bandwidth
        return hw.link_latency_s + num_bytes / (bandwidth * hw.comm_efficiency * num_links)

    def kv_bytes_per_token_per_device(self, tp: int, pp: int) -> int:
        """KV bytes one token occupies on each device: the largest stage's layers, this device's kv heads.

        With tp > num_kv_heads the kv heads are replicated (one per device), as vLLM does.
        """
        model = self.model
        layers = -(-model.num_layers // pp)
        kv_heads = -(-model.num_kv_heads // tp)
        return 2 * layers * kv_heads * model.head_dim * model.dtype_bytes

    def max_kv_tokens(self, tp: int, pp: int, mem_utilization: float = 0.9) -> int:
        """KV tokens an instance of tp*pp devices holds after weights.

        Each device may use ``mem_utilization`` of its memory; weights are spread evenly over the
        tp*pp devices (activation workspace is not modelled).

        Raises:
            InvalidConfigError: '... does not fit in memory ...' when, after the weights, there is no
                room for one sequence of min(max_position_embeddings, 2048) tokens: a full-length
                request of short-context models, and a usable context (like vLLM's max_model_len)
                for long-context ones whose 128k maximum would rule out most layouts.
        """
        if not 0 < mem_utilization <= 1:
            raise InvalidConfigError(f"mem_utilization must be in (0, 1], got {mem_utilization}")
        if tp < 1 or pp < 1:
            raise InvalidConfigError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
        model, hw = self.model, self.hardware
        usable = hw.mem_bytes * mem_utilization
        weights = model.weight_bytes / (tp * pp)
        num_tokens = max(0, int((usable - weights) // self.kv_bytes_per_token_per_device(tp, pp)))
        required = min(model.max_position_embeddings, 2048)
        if num_tokens < required:
            raise InvalidConfigError(
                f"{model.name} with tp={tp}, pp={pp} does not fit in memory of {hw.name}: weights take "
                f"{weights / 2**30:.1f} GiB of the {usable / 2**30:.1f} GiB usable per device "
                f"(mem_utilization={mem_utilization}), leaving room for {num_tokens} KV tokens; at least "
                f"min(max_position_embeddings, 2048) = {required} are needed"
            )
        return num_tokens


def _as_model(model: ModelSpec | str) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else get_model_spec(model)


def _as_hardware(hardware: HardwareSpec | str) -> HardwareSpec:
    return hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)


class RooflineLatencyModel(LatencyModel):
    """Analytical step times from a ``ModelSpec`` and a ``HardwareSpec``.

    Per stage: max(compute, memory) of the linear layers, attention, weight and KV traffic, plus TP
    all-reduces (2 per layer, ring), the PP activation send to the next stage and a fixed step
    overhead. Logits are computed for one token per sequence (the one that is sampled).
    """

    def __init__(self, model: ModelSpec | str, hardware: HardwareSpec | str, pp_same_node: bool = True) -> None:
        """``pp_same_node``: whether pipeline stages send activations over the intra-node link."""
        self.model = _as_model(model)
        self.hardware = _as_hardware(hardware)
        self.pp_same_node = pp_same_node
        self._constants: dict[tuple[int, int], tuple[float, ...]] = {}

    def __repr__(self) -> str:
        return f"RooflineLatencyModel({self.model.name!r}, {self.hardware.name!r})"

    def unsupported_reason(self, tp: int, pp: int) -> str | None:
        """Why (tp, pp) cannot shard this model, or None if it can."""
        model = self.model
        if tp < 1 or pp < 1:
            return f"tp and pp must be >= 1, got tp={tp}, pp={pp}"
        if model.num_heads % tp:
            return f"tp={tp} does not divide num_heads={model.num_heads}"
        if model.num_kv_heads % tp and tp % model.num_kv_heads:
            return f"tp={tp} and num_kv_heads={model.num_kv_heads}: neither divides the other"
        if model.num_layers % pp:
            return f"pp={pp} does not divide num_layers={model.num_layers}"
        return None

    def supports(self, tp: int, pp: int) -> bool:
        return self.unsupported_reason(tp, pp) is None

    def _build_constants(self, tp: int, pp: int) -> tuple[float, ...]:
        reason = self.unsupported_reason(tp, pp)
        if reason is not None:
            raise InvalidConfigError(f"{self.model.name}: {reason}")
        model, hw = self.model, self.hardware
        devices = tp * pp
        inv_flops = 1.0 / (hw.peak_flops * hw.flops_efficiency)
        inv_bandwidth = 1.0 / (hw.mem_bandwidth * hw.bandwidth_efficiency)
        activation_bytes = model.hidden_size * model.dtype_bytes  # per token
        comm_per_token = 0.0
        fixed = hw.step_overhead_s
        if tp > 1:
            num_allreduce = 2 * model.num_layers // pp
            ring_bytes = 2 * (tp - 1) / tp * activation_bytes
            comm_per_token += num_allreduce * ring_bytes / (hw.intra_node_bandwidth * hw.comm_efficiency)
            fixed += num_allreduce * hw.link_latency_s
        if pp > 1:
            link = hw.intra_node_bandwidth if self.pp_same_node else hw.inter_node_bandwidth
            comm_per_token += activation_bytes / (link * hw.comm_efficiency)
            fixed += hw.link_latency_s
        return (
            model.layer_flops_per_token / devices * inv_flops,  # s per token
            model.lm_head_flops_per_token / devices * inv_flops,  # s per sequence
            model.attention_flops_per_pair / 2 / devices * inv_flops,  # s per unit of prefill_sq (causal: half)
            model.attention_flops_per_pair / devices * inv_flops,  # s per decode context token
            model.weight_bytes / devices * inv_bandwidth,  # s of weight reads
            self.kv_bytes_per_token_per_device(tp, pp) * inv_bandwidth,  # s per KV token read or written
            comm_per_token,
            fixed,
        )

    def step_time(self, shape: BatchShape, tp: int = 1, pp: int = 1) -> float:
        num_tokens = shape.prefill_tokens + shape.num_decode
        if num_tokens == 0:
            return 0.0
        constants = self._constants.get((tp, pp))
        if constants is None:
            constants = self._constants[(tp, pp)] = self._build_constants(tp, pp)
        per_token, per_seq, per_sq, per_ctx, weights, per_kv, comm_per_token, fixed = constants
        compute = (
            num_tokens * per_token
            + (shape.num_prefill + shape.num_decode) * per_seq
            + shape.prefill_sq * per_sq
            + shape.decode_ctx * per_ctx
        )
        memory = weights + (shape.decode_ctx + num_tokens) * per_kv
        return (compute if compute > memory else memory) + num_tokens * comm_per_token + fixed


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


class FittedLatencyModel(LatencyModel):
    """DistServe's form, per tp: prefill a + b·Σl + c·Σl²; decode a + b·Σctx + c·batch (separate
    small/large-batch coefficients split at a batch-size threshold). Coefficients in milliseconds,
    as DistServe publishes them.

    With pp > 1 a stage takes the single-device time / pp plus ``pp_stage_overhead_s``, as
    DistServe's simulator does (its published overhead is 0). Chunked prefills use Σ((s+l)² - s²)
    in place of Σl².

    ``decode_attention="padded"``: the decode term reads ``batch × max ctx`` in place of Σctx, for
    an engine whose decode attention pads every sequence of the batch to the longest context (the
    ``padded`` backend of ``kernels.decode_attention`` does, and was our default until the
    ``exact`` split-K backend, which reads Σctx). A profile of uniform contexts fits the same
    coefficients either way; with padding, batches of mixed contexts cost up to several times
    Σctx (median 2.8× in a loaded SmolLM2 run here). Our profiler records what its backend reads
    in the profile's ``meta.decode_attention``.
    """

    def __init__(
        self,
        model: ModelSpec | str,
        coeffs: dict[int, TpCoefficients],
        hardware: HardwareSpec | str | None = None,
        pp_stage_overhead_s: float = 0.0,
        source: str = "",
        decode_attention: str = "sum",
        threads: int | None = None,
    ) -> None:
        """``hardware`` (default a100-80g) is used for memory capacity and migration times only;
        ``threads``: torch threads per worker of the profiled runs (the profile's ``meta.threads``)."""
        if decode_attention not in ("sum", "padded"):
            raise InvalidConfigError(f"decode_attention must be 'sum' or 'padded', got {decode_attention!r}")
        self.padded_decode = decode_attention == "padded"
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise InvalidConfigError(f"threads must be an integer >= 1, got {threads!r}")
        self.threads = threads
        if not coeffs:
            raise InvalidConfigError(f"fitted latency model for {model!r} needs coefficients for at least one tp")
        if pp_stage_overhead_s < 0:
            raise InvalidConfigError(f"pp_stage_overhead_s must be >= 0, got {pp_stage_overhead_s}")
        self.model = _as_model(model)
        self.hardware = _as_hardware(hardware if hardware is not None else DEFAULT_HARDWARE)
        self.coeffs = {int(tp): c for tp, c in sorted(coeffs.items())}
        self.pp_stage_overhead_s = pp_stage_overhead_s
        self.source = source
        # Seconds, flattened per tp so step_time is one dict lookup and arithmetic.
        self._by_tp: dict[int, tuple[float, ...]] = {
            tp: (*(v / 1e3 for v in c.prefill), *(v / 1e3 for v in c.decode_small),
                 *(v / 1e3 for v in c.decode_large), float(c.decode_threshold))
            for tp, c in self.coeffs.items()
        }

    def __repr__(self) -> str:
        return f"FittedLatencyModel({self.model.name!r}, tps={list(self.coeffs)}, source={self.source!r})"

    def supports(self, tp: int, pp: int) -> bool:
        return tp in self.coeffs and pp >= 1 and self.model.num_layers % pp == 0

    def step_time(self, shape: BatchShape, tp: int = 1, pp: int = 1) -> float:
        c = self._by_tp.get(tp)
        if c is None:
            raise InvalidConfigError(
                f"{self.model.name}: tp={tp} was not profiled{f' in {self.source}' if self.source else ''}; "
                f"profiled tps: {list(self.coeffs)}"
            )
        time_s = 0.0
        prefill_a = 0.0
        if shape.num_prefill:
            prefill_a = c[0]
            time_s = prefill_a + c[1] * shape.prefill_tokens + c[2] * shape.prefill_sq
        batch = shape.num_decode
        if batch:
            if batch <= c[9]:
                decode_a, b, k = c[3], c[4], c[5]
            else:
                decode_a, b, k = c[6], c[7], c[8]
            ctx = batch * shape.decode_max_ctx if self.padded_decode and shape.decode_max_ctx else shape.decode_ctx
            time_s += decode_a + b * ctx + k * batch
            if shape.num_prefill:  # one launch overhead for a mixed batch, not two
                time_s -= prefill_a if prefill_a < decode_a else decode_a
        elif not shape.num_prefill:
            return 0.0
        if pp != 1:
            return time_s / pp + self.pp_stage_overhead_s
        return time_s

    @classmethod
    def from_profile(
        cls,
        profile: str | os.PathLike[str] | dict[str, Any],
        model: str | ModelSpec | None = None,
        hardware: HardwareSpec | str | None = None,
    ) -> FittedLatencyModel:
        """Load DistServe's profile file (``{model_id: {tp: {...}}}``, ms) or ours (``build_profile``).

        Args:
            profile: a JSON file path or its parsed dict.
            model: which model of a DistServe file (needed if it holds several); for our format it
                overrides the profile's ``model`` for the architecture numbers.
            hardware: defaults to a100-80g for DistServe's file and to the profile's ``hardware`` for ours.

        Raises:
            InvalidConfigError: unreadable or malformed profile (the message names the key and file),
                or ``model`` not in it.
        """
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
            return cls._from_our_profile(data, source, model, hardware)
        return cls._from_distserve_profile(data, source, model, hardware)

    @classmethod
    def _from_our_profile(
        cls, data: dict[str, Any], source: str, model: str | ModelSpec | None, hardware: HardwareSpec | str | None
    ) -> FittedLatencyModel:
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
        if attention not in ("sum", "padded"):
            raise InvalidConfigError(f"profile {source!r}: meta.decode_attention must be 'sum' or 'padded', got {attention!r}")
        threads = (data.get("meta") or {}).get("threads")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise InvalidConfigError(f"profile {source!r}: meta.threads must be an integer >= 1, got {threads!r}")
        return cls(_resolve_model(model, source), coeffs, hardware=hardware, source=source, decode_attention=attention,
                   threads=threads)

    @classmethod
    def _from_distserve_profile(
        cls, data: dict[str, Any], source: str, model: str | ModelSpec | None, hardware: HardwareSpec | str | None
    ) -> FittedLatencyModel:
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
        return cls(
            _resolve_model(spec_source, source), coeffs,
            hardware=hardware if hardware is not None else DEFAULT_HARDWARE, source=source,
        )

    def to_profile(self) -> dict[str, Any]:
        """This model's coefficients in our profile format (no samples)."""
        return {
            "format": PROFILE_FORMAT,
            "model": self.model.name,
            "hardware": self.hardware.name,
            "units": "ms",
            "meta": {"source": self.source} if self.source else {},
            "tp": {str(tp): _tp_entry(c) for tp, c in self.coeffs.items()},
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
        return _as_model(model)
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


def _tp_entry(c: TpCoefficients) -> dict[str, Any]:
    return {
        "prefill": list(c.prefill),
        "decoding_smallbs": list(c.decode_small),
        "decoding_largebs": list(c.decode_large),
        "decoding_large_small_bs_threshold": c.decode_threshold,
        "fit_error": dict(c.fit_error),
    }


def _fit_relative(features: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float]:
    """Non-negative coefficients (ms) minimising the squared relative error of ``features @ coef``."""
    target_ms = seconds * 1e3
    weighted = features / target_ms[:, None]  # row i / y_i: residuals become relative errors
    scale = weighted.max(axis=0)
    scale[scale == 0] = 1.0  # columns differ by ~1e6 (Σl vs Σl²); nnls is better conditioned scaled
    solution, _ = nnls(weighted / scale, np.ones(len(target_ms)))
    a, b, c = (float(v) for v in solution / scale)
    return a, b, c


def _mape(predicted_ms: np.ndarray, seconds: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted_ms - seconds * 1e3) / (seconds * 1e3)))


def _samples_to_arrays(
    samples: Sequence[tuple[Sequence[int], float]], phase: str
) -> tuple[list[Sequence[int]], np.ndarray]:
    if len(samples) < _MIN_FIT_SAMPLES:
        raise InvalidConfigError(f"need at least {_MIN_FIT_SAMPLES} {phase} samples to fit, got {len(samples)}")
    lens = [list(lengths) for lengths, _ in samples]
    seconds = np.array([float(s) for _, s in samples])
    if any(not row for row in lens):
        raise InvalidConfigError(f"{phase} sample with an empty batch")
    if not np.all(np.isfinite(seconds)) or np.any(seconds <= 0):
        raise InvalidConfigError(f"{phase} sample times must be finite and > 0 seconds")
    return lens, seconds


def fit_coefficients(
    prefill_samples: Sequence[tuple[Sequence[int], float]],
    decode_samples: Sequence[tuple[Sequence[int], float]],
    decode_threshold: int | None = None,
) -> TpCoefficients:
    """Fit DistServe's form with scipy (non-negative least squares, scipy.optimize.nnls, on relative
    error weighting so short steps matter) from (prompt_lens, seconds) and (ctx_lens, seconds) samples.

    MAPE per phase is recorded in ``fit_error`` (``prefill_mape``, ``decode_mape``). A decode side of
    the threshold with fewer than 3 samples (e.g. none) cannot be fitted on its own: both sides then
    use the coefficients fitted on all decode samples. ``decode_threshold`` None (our profiles)
    picks the split between small and large decode batches that fits best: one batch size of the
    samples, or no split. On this machine's SmolLM2 profile a batch of one or two costs a fixed
    ~30 ms (weights dominate) while larger batches grow with their context — the split at 8 fits
    with 5.6% MAPE where DistServe's 95 (no split here) gave 9.4%.

    Raises:
        InvalidConfigError: fewer than 3 samples in a phase, an empty batch, or a time <= 0.
    """
    prefill_lens, prefill_s = _samples_to_arrays(prefill_samples, "prefill")
    decode_lens, decode_s = _samples_to_arrays(decode_samples, "decode")
    prefill_x = np.array([[1.0, sum(lens), sum(n * n for n in lens)] for lens in prefill_lens])
    decode_x = np.array([[1.0, sum(ctx), len(ctx)] for ctx in decode_lens])
    prefill = _fit_relative(prefill_x, prefill_s)

    def fit_decode(threshold: int) -> tuple[tuple[float, float, float], tuple[float, float, float], float]:
        small = decode_x[:, 2] <= threshold
        if small.sum() >= _MIN_FIT_SAMPLES and (~small).sum() >= _MIN_FIT_SAMPLES:
            lo, hi = _fit_relative(decode_x[small], decode_s[small]), _fit_relative(decode_x[~small], decode_s[~small])
        else:
            lo = hi = _fit_relative(decode_x, decode_s)
        pred = np.where(small, decode_x @ np.array(lo), decode_x @ np.array(hi))
        return lo, hi, _mape(pred, decode_s)

    if decode_threshold is None:
        candidates = sorted({int(b) for b in decode_x[:, 2]})
        fits = {t: fit_decode(t) for t in candidates}
        decode_threshold = min(fits, key=lambda t: (round(fits[t][2], 6), -t))  # ties: the larger (fewer splits)
        decode_small, decode_large, decode_mape = fits[decode_threshold]
    else:
        decode_small, decode_large, decode_mape = fit_decode(decode_threshold)
    return TpCoefficients(
        prefill=prefill,
        decode_small=decode_small,
        decode_large=decode_large,
        decode_threshold=decode_threshold,
        fit_error={"prefill_mape": _mape(prefill_x @ np.array(prefill), prefill_s), "decode_mape": decode_mape},
    )


def build_profile(
    model: str,
    hardware: str,
    samples_by_tp: dict[int, dict[str, Any]],
    meta: dict[str, Any] | None = None,
    decode_threshold: int | None = None,
) -> dict[str, Any]:
    """Our profile JSON. samples_by_tp[tp] = {"prefill": [{"lens": [...], "seconds": s}, ...],
    "decode": [{"ctx_lens": [...], "seconds": s}, ...]}. Fits each tp and returns
    {"format": "distserve-profile/1", "model": model, "hardware": hardware, "units": "ms", "meta": meta or {},
     "tp": {"1": {"prefill": [a,b,c], "decoding_smallbs": [...], "decoding_largebs": [...],
                  "decoding_large_small_bs_threshold": N, "fit_error": {...}, "num_samples": {...}}},
     "samples": {"1": samples...}}

    Raises:
        InvalidConfigError: no tp, a missing key in the samples, or too few samples to fit.
    """
    if not samples_by_tp:
        raise InvalidConfigError("build_profile needs samples for at least one tp")
    tp_table: dict[str, Any] = {}
    samples_out: dict[str, Any] = {}
    for tp in sorted(samples_by_tp):
        where = f"samples for tp {tp}"
        samples = samples_by_tp[tp]
        try:
            prefill = [(list(map(int, s["lens"])), float(s["seconds"])) for s in samples["prefill"]]
            decode = [(list(map(int, s["ctx_lens"])), float(s["seconds"])) for s in samples["decode"]]
        except KeyError as exc:
            raise InvalidConfigError(f"{where}: missing key {exc.args[0]!r}") from exc
        try:
            coeffs = fit_coefficients(prefill, decode, decode_threshold)
        except InvalidConfigError as exc:
            raise InvalidConfigError(f"{where}: {exc}") from exc
        entry = _tp_entry(coeffs)
        entry["num_samples"] = {"prefill": len(prefill), "decode": len(decode)}
        tp_table[str(tp)] = entry
        samples_out[str(tp)] = {
            "prefill": [{"lens": lens, "seconds": s} for lens, s in prefill],
            "decode": [{"ctx_lens": ctx, "seconds": s} for ctx, s in decode],
        }
    return {
        "format": PROFILE_FORMAT,
        "model": model,
        "hardware": hardware,
        "units": "ms",
        "meta": dict(meta or {}),
        "tp": tp_table,
        "samples": samples_out,
    }


LATENCY_MODELS: dict[str, type[LatencyModel]] = {
    "roofline": RooflineLatencyModel,
    "fitted": FittedLatencyModel,
}


def get_latency_model(
    model: str | ModelSpec,
    hardware: str | HardwareSpec | None = None,
    profile: str | os.PathLike[str] | dict[str, Any] | None = None,
) -> LatencyModel:
    """A fitted model if ``profile`` is given, else the roofline model.

    ``hardware`` defaults to a100-80g for the roofline, and to the profile's own hardware (a100-80g
    for DistServe's file) for a fitted model.
    """
    if profile is not None:
        return FittedLatencyModel.from_profile(profile, model=model, hardware=hardware)
    return RooflineLatencyModel(model, hardware if hardware is not None else DEFAULT_HARDWARE)
