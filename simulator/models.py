"""Model architectures as numbers (parameters, FLOPs, KV bytes) for the latency models; no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distserve.dtypes import DTYPE_BYTES
from distserve.errors import InvalidConfigError, ModelNotFoundError

_GATED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_DTYPE_BYTES = {**DTYPE_BYTES, "fp32": 4, "fp16": 2, "bf16": 2}  # (and the short names some configs use)


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder-only transformer, described only by the sizes FLOP/byte counting needs.

    Parameter counts include the matmul weights, the token embedding and the norm weights; biases
    and OPT's learned position embeddings (<0.1% of the total) are left out.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool  # LLaMA-style (gate, up, down) vs OPT-style (fc1, fc2)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    dtype_bytes: int = 2
    embed_dim: int | None = None  # token-embedding width when it differs from hidden_size (OPT-350m: 512)

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "max_position_embeddings", "dtype_bytes",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise InvalidConfigError(f"model {self.name!r}: {field_name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise InvalidConfigError(
                f"model {self.name!r}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.embed_dim is not None and self.embed_dim < 1:
            raise InvalidConfigError(f"model {self.name!r}: embed_dim must be >= 1, got {self.embed_dim}")

    @property
    def _embed_width(self) -> int:
        return self.embed_dim or self.hidden_size

    @property
    def attention_params_per_layer(self) -> int:
        """q, k, v and o projection weights of one layer."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        return self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size

    @property
    def mlp_params_per_layer(self) -> int:
        """MLP weights of one layer: 3 matrices if gated, else 2."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @property
    def lm_head_matmul_params(self) -> int:
        """Weights the logits matmul reads per token (an OPT embedding projection included)."""
        width = self._embed_width
        projection = width * self.hidden_size if width != self.hidden_size else 0
        return self.vocab_size * width + projection

    @property
    def num_params(self) -> int:
        """Total parameters: embedding, layers (attention, MLP, 2 norms), final norm, LM head unless tied."""
        width = self._embed_width
        embedding = self.vocab_size * width + (2 * width * self.hidden_size if width != self.hidden_size else 0)
        per_layer = self.attention_params_per_layer + self.mlp_params_per_layer + 2 * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * width
        return embedding + self.num_layers * per_layer + self.hidden_size + lm_head

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights at ``dtype_bytes`` per parameter."""
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def layer_flops_per_token(self) -> int:
        """Matmul FLOPs of all decoder layers for one token (attention score/value products excluded)."""
        return 2 * self.num_layers * (self.attention_params_per_layer + self.mlp_params_per_layer)

    @property
    def lm_head_flops_per_token(self) -> int:
        """FLOPs of the logits matmul for one token."""
        return 2 * self.lm_head_matmul_params

    @property
    def linear_flops_per_token(self) -> int:
        """Matmul FLOPs per token through the whole model, LM head included (2 per weight)."""
        return self.layer_flops_per_token + self.lm_head_flops_per_token

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of QK^T plus PV for one (query, key) pair over all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


def _spec(name: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int,
          gated: bool, tied: bool, max_pos: int) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, intermediate_size=ffn, vocab_size=vocab, gated_mlp=gated,
                     tie_word_embeddings=tied, max_position_embeddings=max_pos)


# Values from each model's published config.json (OPT ties its LM head to the embedding).
_CANONICAL: tuple[ModelSpec, ...] = (
    _spec("facebook/opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, gated=False, tied=True, max_pos=2048),
    _spec("facebook/opt-66b", 64, 9216, 72, 72, 128, 36864, 50272, gated=False, tied=True, max_pos=2048),
    _spec("facebook/opt-175b", 96, 12288, 96, 96, 128, 49152, 50272, gated=False, tied=True, max_pos=2048),
    _spec("meta-llama/Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, gated=True, tied=False, max_pos=131072),
    _spec("meta-llama/Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, gated=True, tied=False, max_pos=131072),
    _spec("Qwen/Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, gated=True, tied=False, max_pos=40960),
    _spec("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 576, 9, 3, 64, 1536, 49152, gated=True, tied=True, max_pos=8192),
)
_ALIASES = {
    "opt-13b": "facebook/opt-13b",
    "opt-66b": "facebook/opt-66b",
    "opt-175b": "facebook/opt-175b",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
KNOWN_MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _CANONICAL}
KNOWN_MODELS.update({alias: KNOWN_MODELS[canonical] for alias, canonical in _ALIASES.items()})
_BY_LOWER_NAME = {key.lower(): spec for key, spec in KNOWN_MODELS.items()}


def known_model(name: str) -> ModelSpec | None:
    """The known model with this id or alias (case-insensitive), else None."""
    return _BY_LOWER_NAME.get(name.strip().lower())


def _require(hf: dict[str, Any], key: str, name: str) -> Any:
    if key not in hf or hf[key] is None:
        raise InvalidConfigError(f"config of {name!r} is missing {key!r}")
    return hf[key]


def model_spec_from_hf_config(hf: dict[str, Any], name: str) -> ModelSpec:
    """Build a spec from a parsed HF ``config.json`` (llama, mistral, qwen2, qwen3 or opt).

    Raises:
        InvalidConfigError: unsupported ``model_type`` or a required key is missing.
    """
    model_type = hf.get("model_type")
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    dtype_bytes = _DTYPE_BYTES.get(dtype, 2)
    if model_type in _GATED_MODEL_TYPES:
        hidden = int(_require(hf, "hidden_size", name))
        heads = int(_require(hf, "num_attention_heads", name))
        return ModelSpec(
            name=name,
            num_layers=int(_require(hf, "num_hidden_layers", name)),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(_require(hf, "intermediate_size", name)),
            vocab_size=int(_require(hf, "vocab_size", name)),
            gated_mlp=True,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            dtype_bytes=dtype_bytes,
        )
    if model_type == "opt":
        hidden = int(_require(hf, "hidden_size", name))
        heads = int(_require(hf, "num_attention_heads", name))
        embed_dim = int(hf.get("word_embed_proj_dim") or hidden)
        return ModelSpec(
            name=name,
            num_layers=int(_require(hf, "num_hidden_layers", name)),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=int(_require(hf, "ffn_dim", name)),
            vocab_size=int(_require(hf, "vocab_size", name)),
            gated_mlp=False,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            dtype_bytes=dtype_bytes,
            embed_dim=None if embed_dim == hidden else embed_dim,
        )
    supported = ", ".join([*_GATED_MODEL_TYPES, "opt"])
    raise InvalidConfigError(f"config of {name!r}: unsupported model_type {model_type!r} (supported: {supported})")


def get_model_spec(name_or_path: str) -> ModelSpec:
    """A known model id or alias (case-insensitive), or a ``config.json`` / a folder holding one.

    Raises:
        ModelNotFoundError: neither a known model nor a readable config (the message lists the known ids).
        InvalidConfigError: the config is readable but describes an unsupported architecture.
    """
    spec = known_model(name_or_path)
    if spec is not None:
        return spec
    path = Path(name_or_path).expanduser()
    config_path = path / "config.json" if path.is_dir() else path
    if config_path.is_file():
        try:
            hf = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(f"cannot read model config {str(config_path)!r}: {exc}") from exc
        if not isinstance(hf, dict):
            raise ModelNotFoundError(f"model config {str(config_path)!r} is not a JSON object")
        return model_spec_from_hf_config(hf, name=name_or_path)
    known = ", ".join(spec.name for spec in _CANONICAL)
    aliases = ", ".join(_ALIASES)
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not a known id ({known}), alias ({aliases}), "
        "or a path to a config.json / a folder holding one"
    )
