"""LLaMA-family decoder (LLaMA 2/3, SmolLM2, Qwen2, Mistral) over a packed batch and a paged KV cache.

Projections are fused at load time (``qkv_proj`` = [q; k; v], ``gate_up_proj`` = [gate; up]) so a
layer is four matmuls. Inputs are packed: ``T`` new tokens of all sequences in one batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distserve.config import ModelConfig
from distserve.engine.shard import ShardSpec
from kernels.paged_attention import AttentionMetadata, paged_attention, write_kv

# Row counts a ``PrepackedLinear`` runs oneDNN at: up to 64 a multiple of 4, above it 8 per power of two
# (4, 8, ..., 64, 72, 80, ..., 128, 144, ...): 56 sizes up to 2048, ~4% padded rows on average.
ROW_BUCKETS_PER_OCTAVE = 8


def padded_rows(t: int) -> int:
    """The row count (>= ``t``) that a ``PrepackedLinear`` pads a ``t``-row input to: one of few sizes.

    oneDNN builds a primitive (JIT-compiled kernels and their scratch memory) for every input shape it
    meets and keeps the newest 1024 in a cache. Packed batches have a new row count at almost every
    prefill step, so a process met hundreds of shapes: it spent time compiling them and its heap kept
    growing with the number of shapes seen (three of SmolLM2's linears over 682 row counts: 175 MB ->
    4.9 GB), which the chaos suite's soak saw as a prefill instance that never stopped growing. Padded to
    these sizes, the shapes are few, every one compiled once (the same three linears: 103 MB once, then
    flat), and a step is faster than unpadded despite the padded rows.
    """
    if t <= 16:
        return (t + 3) // 4 * 4
    step = max(4, (1 << (t.bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE)
    return (t + step - 1) // step * step


class PrepackedLinear(nn.Module):
    """A CPU linear whose weight is reordered once into oneDNN's blocked layout.

    Small-batch matmuls (decode) run 1.3-1.7x faster than ``F.linear`` on the plain weight; this is
    the same weight prepacking torch.compile's freezing pass applies on CPU. Inputs are padded to
    ``padded_rows`` rows (zeros; the extra output rows are dropped), so oneDNN sees few shapes.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = 16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # For fp32 one- and two-row batches MKL's GEMV on the plain weight beats the packed path
        # (~25% at batch 1); keep the plain weight for those. bf16 packed wins at every size.
        self.plain = weight if weight.dtype == torch.float32 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        t = x.shape[0]
        if self.plain is not None and t <= 2:
            return F.linear(x, self.plain, self.bias)
        rows = padded_rows(t) if x.dim() == 2 else t
        if rows != t:
            x = F.pad(x, (0, 0, 0, rows - t))  # [rows, in]
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if rows == t else out[:t]


def prepack_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` for a ``PrepackedLinear`` (CPU, fp32/bf16); returns how many.

    Leaves the model untouched where oneDNN is unavailable or the op is rejected.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if not targets or targets[0][1].weight.dtype not in (torch.float32, torch.bfloat16):
        return 0
    try:
        probe = PrepackedLinear(targets[0][1])
        probe(torch.zeros(1, probe.in_features, dtype=targets[0][1].weight.dtype))
    except (RuntimeError, AttributeError):
        return 0
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PrepackedLinear(mod))
    return len(targets)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and attention scaling, via transformers' rope initialisers."""
    params = dict(config.rope_parameters)
    rope_type = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        dim = config.head_dim
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope scaling depends on the sequence length; not supported")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=params,
    )
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; HF's rotate-half convention."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", (emb.cos() * scaling), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, D] each, broadcast over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel
        # HF LlamaRMSNorm's arithmetic for half types: normalise in fp32, cast, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Attention(nn.Module):
    """Heads split over TP ranks: column-parallel ``qkv_proj``, row-parallel ``o_proj`` + all-reduce."""

    def __init__(self, config: ModelConfig, shard: ShardSpec, all_reduce: AllReduce) -> None:
        super().__init__()
        h0, h1 = shard.heads(config)
        k0, k1 = shard.kv_heads(config)
        self.num_heads = h1 - h0
        self.num_kv_heads = k1 - k0
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.all_reduce = all_reduce
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # Row-parallel: the bias is added once, by TP rank 0, before the all-reduce sums the partials.
        o_bias = config.attention_bias and config.model_type != "qwen2" and shard.tp_rank == 0
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) * D] local heads
        # Rotate q and k together: one set of elementwise kernels instead of two.
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        return self.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    """SwiGLU with the intermediate dimension split over TP ranks."""

    def __init__(self, config: ModelConfig, shard: ShardSpec, all_reduce: AllReduce) -> None:
        super().__init__()
        i0, i1 = shard.intermediate(config)
        self.intermediate = i1 - i0
        self.all_reduce = all_reduce
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=config.mlp_bias and shard.tp_rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: ShardSpec, all_reduce: AllReduce) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard, all_reduce)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, shard, all_reduce)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The part of the decoder one worker holds: its pipeline stage's layers, its TP shard of each.

    The first stage embeds token ids; later stages take the previous stage's hidden states. The
    last stage applies the final norm; ``compute_logits`` exists there only.
    """

    def __init__(self, config: ModelConfig, shard: ShardSpec | None = None, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard = shard or ShardSpec()
        shard.validate(config)
        all_reduce = all_reduce or _identity
        self.layer_start, self.layer_end = shard.layers(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if shard.is_first_stage else None
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, shard, all_reduce) for _ in range(self.layer_end - self.layer_start)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if shard.is_last_stage else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if shard.is_last_stage else None

    @torch.inference_mode()
    def forward(
        self,
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one per local layer
        meta: AttentionMetadata,
        input_ids: torch.Tensor | None = None,  # [T] on the first stage
        hidden: torch.Tensor | None = None,  # [T, hidden] from the previous stage otherwise
    ) -> torch.Tensor:  # [T, hidden]; normalised on the last stage
        x, cos, sin = self.start(positions, input_ids, hidden)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        return self.finish(x)

    # One layer at a time (``ModelRunner.begin``/``run``: a plan that yields between layers).
    def start(
        self, positions: torch.Tensor, input_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's input ``[T, hidden]`` and the rope tables for ``positions`` ``[T]``."""
        if self.embed_tokens is not None:
            assert input_ids is not None
            x = self.embed_tokens(input_ids)
        else:
            assert hidden is not None
            x = hidden
        cos, sin = self.rotary(positions, x.dtype)
        return x, cos, sin

    def finish(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] after the last local layer
        """The final norm on the last stage; as is on the others."""
        return self.norm(x) if self.norm is not None else x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] fp32
        assert self.lm_head is not None, "logits exist on the last pipeline stage only"
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF LLaMA parameter names: keep this worker's layers and shards, fuse q/k/v and gate/up."""
        cfg, shard = self.config, self.shard
        d = cfg.head_dim
        h0, h1 = shard.heads(cfg)
        k0, k1 = shard.kv_heads(cfg)
        i0, i1 = shard.intermediate(cfg)
        q_rows, kv_rows = slice(h0 * d, h1 * d), slice(k0 * d, k1 * d)
        own: dict[str, torch.Tensor] = {}
        if shard.is_first_stage:
            own["embed_tokens.weight"] = state["model.embed_tokens.weight"]
        if shard.is_last_stage:
            own["norm.weight"] = state["model.norm.weight"]
            own["lm_head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        for local, i in enumerate(range(self.layer_start, self.layer_end)):
            p, o = f"model.layers.{i}.", f"layers.{local}."
            attn, mlp = p + "self_attn.", p + "mlp."
            rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
            own[o + "self_attn.qkv_proj.weight"] = torch.cat([state[attn + n + "_proj.weight"][r] for n, r in rows.items()])
            if cfg.attention_bias:
                own[o + "self_attn.qkv_proj.bias"] = torch.cat([state[attn + n + "_proj.bias"][r] for n, r in rows.items()])
            own[o + "self_attn.o_proj.weight"] = state[attn + "o_proj.weight"][:, q_rows]
            if self.layers[local].self_attn.o_proj.bias is not None:
                own[o + "self_attn.o_proj.bias"] = state[attn + "o_proj.bias"]
            own[o + "mlp.gate_up_proj.weight"] = torch.cat(
                [state[mlp + "gate_proj.weight"][i0:i1], state[mlp + "up_proj.weight"][i0:i1]]
            )
            own[o + "mlp.down_proj.weight"] = state[mlp + "down_proj.weight"][:, i0:i1]
            if cfg.mlp_bias:
                own[o + "mlp.gate_up_proj.bias"] = torch.cat(
                    [state[mlp + "gate_proj.bias"][i0:i1], state[mlp + "up_proj.bias"][i0:i1]]
                )
                if self.layers[local].mlp.down_proj.bias is not None:
                    own[o + "mlp.down_proj.bias"] = state[mlp + "down_proj.bias"]
            own[o + "input_layernorm.weight"] = state[p + "input_layernorm.weight"]
            own[o + "post_attention_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [m for m in missing if not m.startswith("rotary.")]
        if missing or unexpected:
            raise ValueError(f"weight mismatch: missing={missing} unexpected={unexpected}")
        if self.lm_head is not None and self.embed_tokens is not None and "lm_head.weight" not in state:
            self.lm_head.weight = self.embed_tokens.weight
