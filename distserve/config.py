"""Frozen configuration dataclasses shared by every package. They hold no state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from distserve.dtypes import DTYPE_BYTES
from distserve.errors import InvalidConfigError, InvalidSamplingParamsError


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a LLaMA-family decoder, read from an HF ``config.json``.

    ``rope_parameters`` is the HF rope dict (``{"rope_type": "default", "rope_theta": ...}`` or a
    scaling config such as llama3/linear/yarn); it is handed to transformers' rope initialisers.
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any] = field(hash=False, compare=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    path: str | None = None  # folder with config.json + *.safetensors + tokenizer files

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise InvalidConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise InvalidConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], name: str, path: str | None = None, dtype: str = "float32"
    ) -> "ModelConfig":
        """Build from a parsed HF ``config.json`` dict (LLaMA 2/3, SmolLM2, Qwen2, Mistral)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise InvalidConfigError(f"unsupported model_type {model_type!r} (llama, mistral, qwen2)")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling")
        if not rope:
            rope = dict(scaling) if scaling else {}
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
            rope.setdefault("rope_type", "default")
            rope["rope_theta"] = float(hf.get("rope_theta", 10000.0))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            name=name,
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=str(hf.get("hidden_act", "silu")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype,
            path=path,
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens each.

    If ``num_blocks`` is None it is derived from ``kv_cache_memory_gb``. ``decode_attention`` names
    the decode-attention backend that reads the cache (``kernels.backends``: padded, exact, cascade,
    triton, flashinfer); None takes the device's default (``cascade`` on CPU).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    decode_attention: str | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise InvalidConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise InvalidConfigError("kv_cache_memory_gb must be > 0")
        if self.decode_attention is not None:
            from kernels.backends import DECODE_ATTENTION_BACKENDS  # imported only when a backend is named

            if self.decode_attention not in DECODE_ATTENTION_BACKENDS:
                raise InvalidConfigError(
                    f"decode_attention must be one of {sorted(DECODE_ATTENTION_BACKENDS)}, got {self.decode_attention!r}"
                )

    def resolve_num_blocks(self, model: ModelConfig) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        per_block = model.kv_bytes_per_token * self.block_size
        return max(1, int(self.kv_cache_memory_gb * (1 << 30) // per_block))


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the policy (a name from the scheduler policy registry)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    enable_chunked_prefill: bool = False
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # Step budget policy (``distserve.engine.step_budget``): "static" (max_num_batched_tokens), or
    # "slo": chunk prompts so each step stays within tpot_slo_s next to its decodes.
    step_budget: str = "static"
    tpot_slo_s: float | None = None
    min_prefill_chunk: int = 32  # "slo": prefill tokens a step may always take, so prompts advance
    # Decode instances: one holding latency-class requests (``distserve.cluster.classes``) is kept to
    # this many requests while another has room (``cluster.routing.decode_order`` sends the others
    # elsewhere), so its batch, and their TPOT, stays small. 16: a decode step of 16 costs ~1.4x
    # one of 1 (OPT-13B on an A100, roofline: 26 vs 18 ms at 1k context; 64: ~2.8x). Not a hard
    # cap: past it the instance is still used when no other has room (a refusal would hold up the
    # FCFS migration queue and waste its capacity; measured, that cost every class more TPOT).
    latency_max_num_seqs: int = 16
    # Hold a prompt whose next prefix blocks another request on the instance is computing right now
    # until they are committed, so siblings arriving together compute a shared prefix once.
    enable_inflight_prefix_sharing: bool = True
    # Plans run a layer at a time and may yield (``distserve.engine.preemptible``): on a prefill
    # instance of one worker, a plan of a backlogged admission rank yields to a waiting prompt of a
    # lower rank; on the in-process engine's decode instances, a plan yields to the prefill
    # instances sharing its thread when a request arrives.
    layer_preemption: bool = True
    # While an instance has admitted a prompt of a higher tier among its last
    # ``engine.rank_order.RECENT_ADMISSIONS`` admissions (an interactive tenant's), a step computing
    # prompts of a lower tier (a batch backlog's) takes the prompt tokens that its measured
    # seconds per prompt token say fit in this many seconds, so a higher tier's prompt arriving
    # mid-step waits for one short layer (layer preemption) rather than a long one. A prompt longer
    # than that runs alone (or chunked, with chunked prefill). None: no cap. 0.25 s caps a CPU
    # (SmolLM2: ~0.5 ms a token) at about one 512-token prompt a step, and leaves an A100's
    # 2048-token OPT-13B steps (~0.26 s) nearly as they are: their layers are short anyway.
    backlog_step_s: float | None = 0.25
    # Step composition (``distserve.engine.step_budget.STEP_POLICIES``): "mixed" (admitted prompts join
    # the running decodes' step) or "vllm-2023" (a step that admits prompts runs only them, whole).
    step_policy: str = "mixed"
    # Grammar library for structured output (``engine.grammar_backends.STRUCTURED_OUTPUT_BACKENDS``):
    # "llguidance" or "xgrammar". Every instance and the request front end compile with the same one.
    structured_output_backend: str = "llguidance"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise InvalidConfigError("max_num_batched_tokens must be >= 1")
        if self.tpot_slo_s is not None and not (self.tpot_slo_s > 0 and math.isfinite(self.tpot_slo_s)):
            raise InvalidConfigError(f"tpot_slo_s must be a positive number of seconds, got {self.tpot_slo_s}")
        if self.step_budget == "slo" and self.tpot_slo_s is None:
            raise InvalidConfigError("step_budget 'slo' needs tpot_slo_s (the TPOT SLO the steps must keep)")
        if self.latency_max_num_seqs < 1:
            raise InvalidConfigError(f"latency_max_num_seqs must be >= 1, got {self.latency_max_num_seqs}")
        if self.backlog_step_s is not None and not (self.backlog_step_s > 0 and math.isfinite(self.backlog_step_s)):
            raise InvalidConfigError(f"backlog_step_s must be a positive number of seconds or None, got {self.backlog_step_s}", "backlog_step_s")
        if self.min_prefill_chunk < 1:
            raise InvalidConfigError(f"min_prefill_chunk must be >= 1, got {self.min_prefill_chunk}")
        from distserve.engine.step_budget import STEP_POLICIES  # step_budget imports this module

        if self.step_policy not in STEP_POLICIES:
            raise InvalidConfigError(f"step_policy must be one of {', '.join(STEP_POLICIES)}, got {self.step_policy!r}", "step_policy")
        from distserve.engine.grammar_backends import STRUCTURED_OUTPUT_BACKENDS

        if self.structured_output_backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise InvalidConfigError(f"structured_output_backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, "
                                     f"got {self.structured_output_backend!r}", "structured_output_backend")
        if self.step_policy == "vllm-2023" and (self.enable_chunked_prefill or self.step_budget != "static"):
            raise InvalidConfigError("step_policy 'vllm-2023' runs prompts whole: it takes neither enable_chunked_prefill nor "
                                     f"step_budget {self.step_budget!r} (use 'static')", "step_policy")


def slo_scheduler_config(tpot_slo_s: float | None, base: SchedulerConfig | None = None) -> SchedulerConfig:
    """``base`` (default: the defaults) with the "slo" step budget for ``tpot_slo_s``, or as is if
    there is no (finite) TPOT SLO."""
    base = base or SchedulerConfig()
    if tpot_slo_s is None or not math.isfinite(tpot_slo_s):
        return base
    return replace(base, step_budget="slo", tpot_slo_s=tpot_slo_s)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor (``tp``) and pipeline (``pp``) parallel degrees of one instance."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise InvalidConfigError(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


# Limits of what one request may ask for: each is what the engine can represent (64-bit seeds
# and priorities) or a bound that keeps one request's per-step cost small (stop strings are
# searched every step, and sampling parameters travel with every plan).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's range
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
MAX_TOP_K = 2**31 - 1  # larger values mean "no top-k" as much as the vocabulary size does
MAX_TEMPERATURE = 100.0  # past ~10 every token is equally likely; larger values overflow float32
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID = 2**31 - 1  # checked against the vocabulary where the model is known
MAX_N = 128  # completions per request (``n``); also bounded by the batch cap where the engine is known
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024  # a schema, regex, choice list or grammar travels with every plan's sampling
MAX_PENALTY = 2.0  # presence/frequency penalties: OpenAI's range [-2, 2]
# Repetition penalty: HF/vLLM accept any value > 0; outside this range float32 logits overflow to inf.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # the bias travels with every plan and is applied every step
MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's top_logprobs, vLLM's default max_logprobs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _logit_bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs, from a dict (ids as ints or digit strings) or pairs."""
    def err(message: str) -> InvalidSamplingParamsError:
        return InvalidSamplingParamsError(f"logit_bias {message}", "logit_bias")

    if not bias:
        return ()
    items = list(bias.items()) if isinstance(bias, dict) else list(bias)  # type: ignore[call-overload]
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise err(f"may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(items)}")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise err(f"must map token ids to biases, got {item!r:.80}")
        key, value = item
        if isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 10:
            key = int(key)
        if not _is_int(key) or not 0 <= key <= MAX_TOKEN_ID:
            raise err(f"keys must be token ids (integers >= 0), got {key!r:.80}")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise err(f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r:.80} for token {key}")
        pairs[key] = float(value)
    return tuple(sorted(pairs.items()))


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match, as text so it crosses processes (``distserve.engine.structured_output``
    compiles it): ``json`` a JSON schema (JSON text), ``json_object`` any JSON object (``spec`` empty),
    ``regex`` a regular expression, ``choice`` a JSON list of strings (one of them exactly), ``grammar``
    an EBNF (GBNF, ``root ::= ...``) or Lark grammar. ``param`` is the request field it came from, for errors.
    """

    kind: str
    spec: str = ""
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise InvalidSamplingParamsError(f"structured output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                                             f"got {self.kind!r}", self.param)
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise InvalidSamplingParamsError(f"{self.param} must be text of at most {MAX_STRUCTURED_SPEC_CHARS} characters", self.param)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output; validated on construction.

    ``top_k`` of 0 or -1 disables top-k; ``temperature == 0`` is greedy. ``logprobs`` returns the
    log-probability of each chosen token and ``top_logprobs`` (needs ``logprobs``) the most likely
    alternatives at each position; ``prompt_logprobs`` (vLLM's) the same for the prompt tokens (the
    first excepted). Every log-probability is under the model's raw distribution (vLLM's default
    ``logprobs_mode``, ``raw_logprobs``): before penalties, bias, temperature and filters.

    Logits processing (``engine.sampler``, vLLM's order): ``min_tokens`` bans, ``logit_bias``
    (OpenAI: added to the logits), ``repetition_penalty`` (HF/vLLM: over prompt and output tokens, a
    positive logit divided by it, a negative one multiplied), ``frequency_penalty`` (times each
    token's count in the output) and ``presence_penalty`` (once per token in the output), both
    subtracted as in OpenAI; then greedy argmax, or temperature, ``min_p`` (drop tokens whose
    probability is below ``min_p`` times the top one's), top-k, top-p and a draw.

    ``logit_bias`` may be given as a dict {token id: bias} (ids as ints or digit strings); it is
    stored as sorted ``(id, bias)`` pairs. Limits that depend on the model (token ids within the
    vocabulary, ``max_tokens`` within the context) are checked when a request is submitted
    (``RequestFrontend.check_request``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1  # completions of the prompt: it is prefilled once and its KV forked n ways (copy-on-write)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # False: special tokens' text (e.g. <|im_start|>) is kept in the output text
    structured: StructuredOutput | None = None  # constrained decoding: each token keeps the output matching this
    # Derived in __post_init__, read per row per step: whether any penalty applies, and whether the
    # sampler needs the request's tokens so far (penalties, prompt logprobs).
    has_penalties: bool = field(init=False, repr=False, compare=False, default=False)
    needs_history: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        # Accept lists/str from callers but store tuples so the object stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

        def err(param: str, message: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(f"{param} {message}", param)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise err("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise err("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise err("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise err("top_k", f"must be -1 or 0 (disabled) or an integer in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise err("seed", f"must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise err("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise err("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise err("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise err("stop", "strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise err("stop", f"strings may be at most {MAX_STOP_STRING_CHARS} characters, got one of {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise err("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID]
        if bad:
            raise err("stop_token_ids", f"must be token ids >= 0, got {bad[:3]!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise err("structured", f"must be a StructuredOutput, got {type(self.structured).__name__}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise err(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
            raise err("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1: off), got {rp!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise err("min_p", f"must be in [0, 1], got {self.min_p!r}")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise err("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise err("top_logprobs", "needs logprobs to be true")
        pl = self.prompt_logprobs
        if pl is not None and (not _is_int(pl) or not 0 <= pl <= MAX_LOGPROBS):
            raise err("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {pl!r}")
        has_penalties = bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
        object.__setattr__(self, "has_penalties", has_penalties)
        object.__setattr__(self, "needs_history", has_penalties or pl is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
