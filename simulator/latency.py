"""Step-time models of one LLM on one device type: an analytical roofline and DistServe's fitted form.

Profile files (reading and writing ``TpCoefficients``) are ``simulator.profiles``' job, fitting
them to measurements ``simulator.fitting``'s.

The simulator calls ``step_time`` once per simulated step, so it is plain arithmetic on the few
aggregates a ``BatchShape`` carries, with everything that depends only on (tp, pp) precomputed.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from distserve.errors import InvalidConfigError
from simulator.hardware import HardwareSpec, get_hardware
from simulator.models import ModelSpec, get_model_spec
from simulator.profiles import DECODE_ATTENTION_READS, DEFAULT_HARDWARE, TpCoefficients, profile_json, read_profile


@dataclass(frozen=True, slots=True)
class BatchShape:
    """Aggregates of one batch; cheap to build (the simulator builds one per step, keep it light)."""

    num_prefill: int = 0
    prefill_tokens: int = 0  # Σ l over prefill chunks (new tokens)
    prefill_sq: int = 0  # Σ ((s + l)^2 - s^2): causal work of l new tokens after s cached ones (l^2 for a prompt)
    num_decode: int = 0
    decode_ctx: int = 0  # Σ context length of decodes (including the new token)
    decode_max_ctx: int = 0  # the longest of them (a kernel that pads every decode to it reads num_decode × this)
    # Cascade attention (``kernels.cascade_attention``) reads each kept shared-prefix node once for its
    # members: the KV tokens it does NOT read, Σ over kept nodes of (members - 1) × node tokens, and
    # the number of kept nodes (``simulator.sim_instance.batch_shape`` with a ``CascadeRule``).
    decode_shared_saved: int = 0
    decode_shared_nodes: int = 0

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


def check_decode_attention(value: object, where: str = "decode_attention") -> str:
    """``value`` if it names what a decode backend reads (``kv_read``), else ``InvalidConfigError``."""
    if value not in DECODE_ATTENTION_READS:
        raise InvalidConfigError(f"{where} must be one of {', '.join(map(repr, DECODE_ATTENTION_READS))}, got {value!r}")
    return value  # type: ignore[return-value]


class LatencyModel(ABC):
    """Step times of one model on one hardware type, for any (tp, pp) it supports."""

    model: ModelSpec
    hardware: HardwareSpec
    # What the modelled decode attention reads (``DecodeAttention.kv_read``): "sum" (Σctx),
    # "padded" (batch × max ctx) or "cascade" (Σctx less what shared prefixes save: the simulator
    # then computes ``BatchShape.decode_shared_saved`` from each plan's block tables).
    decode_attention: str = "sum"
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

    def decode_step_fn(self, tp: int, pp: int, scale: float = 1.0, overhead_s: float = 0.0) -> Callable[[int, int, int], float]:
        """``scale * step_time + overhead_s`` of a decode-only batch as a function of (num_decode,
        decode_ctx, decode_max_ctx): the same float as from that ``BatchShape`` (``scale`` 1: no
        product; the simulator's fast-forward calls it once per step it skips)."""
        step_time = self.step_time
        if scale == 1.0:
            return lambda n, ctx, max_ctx: step_time(BatchShape(0, 0, 0, n, ctx, max_ctx), tp, pp) + overhead_s
        return lambda n, ctx, max_ctx: scale * step_time(BatchShape(0, 0, 0, n, ctx, max_ctx), tp, pp) + overhead_s

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

    def __init__(
        self, model: ModelSpec | str, hardware: HardwareSpec | str, pp_same_node: bool = True, decode_attention: str = "sum"
    ) -> None:
        """``pp_same_node``: whether pipeline stages send activations over the intra-node link;
        ``decode_attention`` "cascade": KV memory traffic leaves out ``decode_shared_saved`` tokens
        (attention FLOPs stay: every query still meets every key)."""
        self.decode_attention = check_decode_attention(decode_attention)
        self._cascade = decode_attention == "cascade"
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
        kv_read = shape.decode_ctx - shape.decode_shared_saved if self._cascade else shape.decode_ctx
        memory = weights + (kv_read + num_tokens) * per_kv
        return (compute if compute > memory else memory) + num_tokens * comm_per_token + fixed


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

    ``decode_attention="cascade"``: the decode term reads ``Σctx - (1 - f) · decode_shared_saved``
    (each kept shared prefix once for its members; ``f = cascade_shared_fraction`` is what a shared
    token still costs each further member, relative to reading it: the group's queries still meet
    every key) plus ``cascade_node_ms`` per kept node (one more attention call and merge part).
    ``experiments/validate_cascade_latency.py`` measures both. Without sharing it is the "sum"
    model, so a profile of uniform, unshared contexts fits the same coefficients for both.
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
        cascade_node_ms: float = 0.0,
        cascade_shared_fraction: float = 0.0,
    ) -> None:
        """``hardware`` (default a100-80g) is used for memory capacity and migration times only;
        ``threads``: torch threads per worker of the profiled runs (the profile's ``meta.threads``)."""
        self.decode_attention = check_decode_attention(decode_attention)
        self.padded_decode = decode_attention == "padded"
        self.cascade_decode = decode_attention == "cascade"
        if not cascade_node_ms >= 0:
            raise InvalidConfigError(f"cascade_node_ms must be >= 0, got {cascade_node_ms!r}")
        self.cascade_node_s = cascade_node_ms / 1e3
        if not 0 <= cascade_shared_fraction <= 1:
            raise InvalidConfigError(f"cascade_shared_fraction must be in [0, 1], got {cascade_shared_fraction!r}")
        self.cascade_unread = 1.0 - cascade_shared_fraction  # of a saved token's read cost
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
            if self.cascade_decode:
                time_s += decode_a + b * (shape.decode_ctx - self.cascade_unread * shape.decode_shared_saved) + k * batch \
                    + self.cascade_node_s * shape.decode_shared_nodes
            else:
                ctx = batch * shape.decode_max_ctx if self.padded_decode and shape.decode_max_ctx else shape.decode_ctx
                time_s += decode_a + b * ctx + k * batch
            if shape.num_prefill:  # one launch overhead for a mixed batch, not two
                time_s -= prefill_a if prefill_a < decode_a else decode_a
        elif not shape.num_prefill:
            return 0.0
        if pp != 1:
            return time_s / pp + self.pp_stage_overhead_s
        return time_s

    def decode_step_fn(self, tp: int, pp: int, scale: float = 1.0, overhead_s: float = 0.0) -> Callable[[int, int, int], float]:
        if self.cascade_decode or tp not in self._by_tp or self.padded_decode:
            return super().decode_step_fn(tp, pp, scale, overhead_s)
        c = self._by_tp[tp]
        threshold, small, large = c[9], c[3:6], c[6:9]
        stage_s = self.pp_stage_overhead_s
        unscaled = scale == 1.0

        def decode_step(n: int, ctx: int, max_ctx: int) -> float:  # step_time's arithmetic, in its order
            if not n:
                time_s = 0.0
            else:
                a, b, k = small if n <= threshold else large
                time_s = a + b * ctx + k * n
                if pp != 1:
                    time_s = time_s / pp + stage_s
            return time_s + overhead_s if unscaled else scale * time_s + overhead_s

        return decode_step

    @classmethod
    def from_profile(
        cls,
        profile: str | os.PathLike[str] | dict[str, Any],
        model: str | ModelSpec | None = None,
        hardware: HardwareSpec | str | None = None,
        decode_attention: str | None = None,
    ) -> FittedLatencyModel:
        """Load DistServe's profile file (``{model_id: {tp: {...}}}``, ms) or ours (``build_profile``).

        Args:
            profile: a JSON file path or its parsed dict.
            model: which model of a DistServe file (needed if it holds several); for our format it
                overrides the profile's ``model`` for the architecture numbers.
            hardware: defaults to a100-80g for DistServe's file and to the profile's ``hardware`` for ours.
            decode_attention: what the simulated instances' decode attention reads ("sum", "padded",
                "cascade": a backend's ``kv_read``); default the profile's ``meta.decode_attention``.
                A profile of unshared contexts fits the same coefficients for "sum" and "cascade".

        Raises:
            InvalidConfigError: unreadable or malformed profile (the message names the key and file),
                or ``model`` not in it.
        """
        p = read_profile(profile, model, hardware)
        attention = p.decode_attention if decode_attention is None else decode_attention
        return cls(p.model, p.coeffs, hardware=p.hardware, source=p.source, decode_attention=attention,
                   threads=p.threads, cascade_node_ms=p.cascade_node_ms, cascade_shared_fraction=p.cascade_shared_fraction)

    def to_profile(self) -> dict[str, Any]:
        """This model's coefficients in our profile format (no samples)."""
        return profile_json(self.model.name, self.hardware.name, self.source, self.coeffs)


LATENCY_MODELS: dict[str, type[LatencyModel]] = {
    "roofline": RooflineLatencyModel,
    "fitted": FittedLatencyModel,
}


def get_latency_model(
    model: str | ModelSpec,
    hardware: str | HardwareSpec | None = None,
    profile: str | os.PathLike[str] | dict[str, Any] | None = None,
    decode_attention: str | None = None,
) -> LatencyModel:
    """A fitted model if ``profile`` is given, else the roofline model.

    ``hardware`` defaults to a100-80g for the roofline, and to the profile's own hardware (a100-80g
    for DistServe's file) for a fitted model; ``decode_attention`` (what the decode backend reads)
    to the profile's, "sum" for the roofline.
    """
    if profile is not None:
        return FittedLatencyModel.from_profile(profile, model=model, hardware=hardware, decode_attention=decode_attention)
    return RooflineLatencyModel(model, hardware if hardware is not None else DEFAULT_HARDWARE, decode_attention=decode_attention or "sum")
