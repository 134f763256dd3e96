"""The tiny test model: a deterministic random LLaMA (GQA, 2 layers, hidden 64) over a byte-level tokenizer with a
chat template, built in-process (no download) and its weights cached on disk (``model_cache.cache_dir()/tiny``).
Tests and quick runs use it; ``weights.load_model("tiny")`` loads it like any model."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import pathlib
import tempfile
from typing import TYPE_CHECKING, Any

from distserve.engine.model_cache import cache_dir, log
from distserve.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch
    import transformers

TINY_MODEL_NAME = "tiny"
_TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_hf_model(
    seed: int = 0, **config_overrides: Any
) -> tuple[transformers.LlamaForCausalLM, Tokenizer]:
    """A deterministic random LLaMA (GQA, 2 layers, hidden 64) over a byte-level tokenizer.

    Weights are drawn with a large ``initializer_range`` so next-token logits are peaky and greedy
    decoding is robust to float reordering. The global torch RNG state is left unchanged.
    """
    tokenizer = build_tiny_tokenizer()
    return _init_tiny_model(tiny_hf_config(tokenizer, **config_overrides), seed), tokenizer


def tiny_hf_config(tokenizer: Tokenizer, **config_overrides: Any) -> transformers.LlamaConfig:
    """The tiny model's config (cheap: no model is built), with ``config_overrides`` applied."""
    from transformers import LlamaConfig

    hf_config_kwargs: dict[str, Any] = dict(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.5,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.hf.eos_token_id,
        pad_token_id=tokenizer.hf.pad_token_id,
    )
    hf_config_kwargs.update(config_overrides)
    return LlamaConfig(**hf_config_kwargs)


def _init_tiny_model(hf_config: transformers.LlamaConfig, seed: int) -> transformers.LlamaForCausalLM:
    import torch
    from transformers import LlamaForCausalLM

    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(hf_config)
    finally:
        torch.random.set_rng_state(rng_state)
    return model.float().eval()


def load_tiny_state_dict(hf_config: transformers.LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights ``build_tiny_hf_model`` draws for ``hf_config`` and ``seed``, cached on disk.

    Building the model costs seconds in every process that loads ``tiny`` (tests, Ray actors,
    experiments), mostly to import transformers' LLaMA code; reading the cache costs milliseconds.
    The file is :func:`tiny_cache_path`; an unreadable one is rebuilt. A tied ``lm_head.weight``
    is not stored: it is the embedding, and ``weights._finalize_state_dict`` aliases it.
    """
    from safetensors.torch import load_file, save_file

    path = tiny_cache_path(hf_config, seed)
    try:
        return load_file(str(path))
    except FileNotFoundError:
        pass
    except Exception as exc:  # safetensors raises SafetensorError/OSError/... on a corrupt file
        log(f"rebuilding the unreadable tiny-model cache {path}: {exc}")
    tied = hf_config.tie_word_embeddings
    state_dict = {
        k: v.detach().contiguous()
        for k, v in _init_tiny_model(hf_config, seed).state_dict().items()
        if not k.endswith("rotary_emb.inv_freq") and not (tied and k == "lm_head.weight")
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
        os.close(fd)
        try:
            save_file(state_dict, tmp, metadata={"format": "pt"})
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the file to this user
            os.replace(tmp, path)  # atomic: concurrent builders write the same bytes; readers never see half a file
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:  # an unwritable cache still serves the freshly built weights
        log(f"cannot cache the tiny model at {path}: {exc}")
    return state_dict


def tiny_config_and_weights(weights: bool = True, seed: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The default tiny model's HF config (as a dict) and, if ``weights``, its weights (``load_tiny_state_dict``).

    An index next to the cached weights (:func:`_tiny_index_path`, keyed without importing
    transformers) holds the config and the weights' file name: a process that only runs the model
    (a worker rank) then reads both without importing transformers or building the tokenizer (~1.5 s
    of CPU each). Without the index, or with an unreadable one, they are built and the index written.
    """
    index = _tiny_index_path(seed)
    try:
        entry = json.loads(index.read_text(encoding="utf-8"))
        config = entry["config"]
        if not weights:  # (a process that only routes: no torch)
            return config, {}
        from safetensors.torch import load_file

        return config, load_file(str(index.parent / entry["weights"]))
    except FileNotFoundError:
        pass
    except Exception as exc:  # a corrupt index or weights file: rebuilt below
        log(f"rebuilding the tiny-model cache index {index}: {exc!r}")
    hf_config = tiny_hf_config(build_tiny_tokenizer())
    entry = {"config": hf_config.to_dict(), "weights": tiny_cache_path(hf_config, seed).name}
    entry = json.loads(json.dumps(entry, sort_keys=True, default=str))  # (as a later process reads it)
    if not weights:  # (nothing cached: the index names weights that are built with it)
        return entry["config"], {}
    state_dict = load_tiny_state_dict(hf_config, seed)
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=index.parent, prefix=f".{index.name}.tmp-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entry, f, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, index)  # atomic, as the weights
    except OSError as exc:
        log(f"cannot write the tiny-model cache index {index}: {exc}")
    return entry["config"], state_dict


def _tiny_index_path(seed: int) -> pathlib.Path:
    """``cache_dir()/tiny/index-<key>.json``, the key a hash of what the default config and weights depend on
    (as :func:`tiny_cache_path`'s, the transformers version read from its metadata: no import)."""
    from importlib.metadata import version

    build_code = "".join(inspect.getsource(f) for f in (tiny_hf_config, _init_tiny_model, build_tiny_tokenizer, tiny_cache_path))
    key = json.dumps({"seed": seed, "build_code": build_code, "transformers": version("transformers"), "torch": version("torch")},
                     sort_keys=True)
    return cache_dir() / TINY_MODEL_NAME / f"index-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def tiny_cache_path(hf_config: transformers.LlamaConfig, seed: int = 0) -> pathlib.Path:
    """``cache_dir()/tiny/<key>.safetensors``, the key a hash of all the weights depend on.

    That is the config, the seed, the source of the build code and the transformers and torch
    versions (their initializers draw the weights): a change to any of them is a new file.
    """
    import torch
    import transformers

    build_code = "".join(inspect.getsource(f) for f in (tiny_hf_config, _init_tiny_model, build_tiny_tokenizer))
    key = json.dumps(
        {
            "config": hf_config.to_dict(),
            "seed": seed,
            "build_code": build_code,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        sort_keys=True,
        default=str,
    )
    return cache_dir() / TINY_MODEL_NAME / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"


def build_tiny_tokenizer() -> Tokenizer:
    """Byte-level tokenizer (256 byte tokens, no merges) with ``<s>``, ``</s>``, ``<pad>`` and a chat template."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>"]
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(specials + byte_symbols)}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens(specials)
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=rust,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        chat_template=_TINY_CHAT_TEMPLATE,
    )
    return Tokenizer(hf)
