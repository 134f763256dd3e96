"""Model specs (parameter/KV counting, HF config parsing) and hardware specs of the simulator."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from distserve.errors import InvalidConfigError, ModelNotFoundError
from simulator.hardware import HARDWARE, HardwareSpec, get_hardware, measure_local_cpu
from simulator.models import KNOWN_MODELS, ModelSpec, get_model_spec, model_spec_from_hf_config

LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("name", "nominal"),
    [
        ("facebook/opt-13b", 13e9),
        ("facebook/opt-66b", 66e9),
        ("facebook/opt-175b", 175e9),
        ("meta-llama/Llama-3.1-8B", 8.0e9),
        ("meta-llama/Llama-3.1-70B", 70.6e9),
        ("Qwen/Qwen3-32B", 32.8e9),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", 135e6),
    ],
)
def test_num_params_match_nominal_sizes(name: str, nominal: float) -> None:
    spec = KNOWN_MODELS[name]
    assert spec.num_params == pytest.approx(nominal, rel=0.03)
    assert spec.weight_bytes == spec.num_params * spec.dtype_bytes


def test_kv_bytes_and_flops_of_llama_8b() -> None:
    spec = KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    assert spec.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    # 2 FLOPs per non-embedding matmul weight, LM head included (untied: it is counted in num_params too).
    non_embedding = spec.num_params - spec.vocab_size * spec.hidden_size - (2 * 32 + 1) * spec.hidden_size
    assert spec.linear_flops_per_token == 2 * non_embedding


def test_tied_lm_head_is_counted_once_but_computed() -> None:
    smol = KNOWN_MODELS["smollm2-135m"]
    assert smol.tie_word_embeddings
    untied = ModelSpec(**{**smol.__dict__, "tie_word_embeddings": False})
    assert untied.num_params - smol.num_params == smol.vocab_size * smol.hidden_size
    assert untied.linear_flops_per_token == smol.linear_flops_per_token


def test_aliases_and_case_insensitive_ids() -> None:
    assert get_model_spec("opt-13b") is KNOWN_MODELS["facebook/opt-13b"]
    assert get_model_spec("LLAMA-3.1-70B") is KNOWN_MODELS["meta-llama/Llama-3.1-70B"]
    assert get_model_spec("qwen/qwen3-32b").name == "Qwen/Qwen3-32B"
    assert get_model_spec("SmolLM2-135M").num_layers == 30


def test_hf_llama_config_matches_known_spec() -> None:
    spec = model_spec_from_hf_config(LLAMA_31_8B_CONFIG, name="llama8b")
    known = KNOWN_MODELS["llama-3.1-8b"]
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.gated_mlp) == (32, 8, 128, True)
    assert spec.num_params == known.num_params
    assert spec.max_position_embeddings == 131072


def test_hf_qwen3_config_uses_explicit_head_dim() -> None:
    hf = {
        "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
        "num_hidden_layers": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "tie_word_embeddings": False,
    }
    spec = model_spec_from_hf_config(hf, name="qwen3")
    assert spec.head_dim == 128  # not hidden / heads = 80
    assert spec.num_params == KNOWN_MODELS["Qwen/Qwen3-32B"].num_params


def test_hf_opt_config() -> None:
    hf = {
        "model_type": "opt", "hidden_size": 5120, "ffn_dim": 20480, "num_attention_heads": 40,
        "num_hidden_layers": 40, "vocab_size": 50272, "word_embed_proj_dim": 5120,
        "max_position_embeddings": 2048, "torch_dtype": "float16",
    }
    spec = model_spec_from_hf_config(hf, name="opt")
    assert not spec.gated_mlp and spec.tie_word_embeddings
    assert spec.num_params == KNOWN_MODELS["opt-13b"].num_params
    # OPT-350m projects a 512-wide embedding to hidden 1024.
    small = model_spec_from_hf_config(
        {**hf, "hidden_size": 1024, "ffn_dim": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
         "word_embed_proj_dim": 512}, name="opt-350m",
    )
    assert small.embed_dim == 512
    assert small.num_params == pytest.approx(331e6, rel=0.03)


def test_hf_config_errors() -> None:
    with pytest.raises(InvalidConfigError, match="mixtral"):
        model_spec_from_hf_config({**LLAMA_31_8B_CONFIG, "model_type": "mixtral"}, name="m")
    missing = {k: v for k, v in LLAMA_31_8B_CONFIG.items() if k != "intermediate_size"}
    with pytest.raises(InvalidConfigError, match="intermediate_size"):
        model_spec_from_hf_config(missing, name="m")
    with pytest.raises(InvalidConfigError, match="num_kv_heads"):
        model_spec_from_hf_config({**LLAMA_31_8B_CONFIG, "num_key_value_heads": 5}, name="m")


def test_unknown_model_names_the_known_ids() -> None:
    with pytest.raises(ModelNotFoundError, match="facebook/opt-13b") as info:
        get_model_spec("no-such/model-7b")
    assert "meta-llama/Llama-3.1-8B" in str(info.value)


def test_model_spec_from_config_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B_CONFIG))
    from_file = get_model_spec(str(tmp_path / "config.json"))
    from_folder = get_model_spec(str(tmp_path))
    assert from_file.num_params == from_folder.num_params == KNOWN_MODELS["llama-3.1-8b"].num_params
    assert from_folder.name == str(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelNotFoundError, match="bad.json"):
        get_model_spec(str(tmp_path / "bad.json"))


def test_get_hardware_is_case_insensitive() -> None:
    a100 = get_hardware("A100-80G")
    assert a100 is HARDWARE["a100-80g"]
    assert a100.peak_flops == 312e12 and a100.mem_bandwidth == 2.039e12
    assert 80e9 < a100.mem_bytes < 90e9
    for name in ("a100-80g", "h100-sxm", "h200", "l40s"):
        assert get_hardware(name.upper()).name == name


def test_unknown_hardware_names_the_known_ones() -> None:
    with pytest.raises(InvalidConfigError, match="a100-80g") as info:
        get_hardware("tpu-v9")
    for name in ("h100-sxm", "h200", "l40s", "cpu"):
        assert name in str(info.value)


def test_datasheet_ordering() -> None:
    a100, h100, h200, l40s = (HARDWARE[n] for n in ("a100-80g", "h100-sxm", "h200", "l40s"))
    assert h100.peak_flops > l40s.peak_flops > a100.peak_flops
    assert h200.mem_bandwidth > h100.mem_bandwidth > a100.mem_bandwidth > l40s.mem_bandwidth
    assert h200.mem_bytes > h100.mem_bytes > l40s.mem_bytes
    assert l40s.intra_node_bandwidth < a100.intra_node_bandwidth  # PCIe vs NVLink


def test_hardware_spec_validates() -> None:
    with pytest.raises(InvalidConfigError, match="flops_efficiency"):
        HardwareSpec("x", 1e12, 1e12, 1e9, 1e9, 1e9, flops_efficiency=1.5)
    with pytest.raises(InvalidConfigError, match="mem_bandwidth"):
        HardwareSpec("x", 1e12, 0.0, 1e9, 1e9, 1e9)


def test_measure_local_cpu_is_positive_fast_and_cached() -> None:
    start = time.perf_counter()
    cpu = measure_local_cpu()
    assert time.perf_counter() - start < 5.0
    assert cpu.name == "cpu"
    for value in (cpu.peak_flops, cpu.mem_bandwidth, cpu.mem_bytes, cpu.intra_node_bandwidth,
                  cpu.inter_node_bandwidth, cpu.link_latency_s):
        assert value > 0
    assert 1e8 < cpu.peak_flops < 1e14  # a float32 GEMM on any CPU
    assert get_hardware("CPU") is cpu  # cached per process
