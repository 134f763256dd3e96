"""Tests for distserve.engine.tokenizer: round trips, chat templates, incremental detokenization."""

from __future__ import annotations

import json
import pathlib
import random
from collections.abc import Sequence

import pytest

from distserve.engine.detokenizer import DecodeStreamDetokenizer, Detokenizer, WindowDetokenizer
from distserve.engine.tokenizer import Tokenizer
from distserve.engine.tiny_model import build_tiny_hf_model, build_tiny_tokenizer
from distserve.engine.weights import resolve_model_dir
from distserve.errors import DistServeError, InvalidConfigError

UNICODE_TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "naïve café, Ærøskøbing, São Paulo",
    "日本語のテキストと中文文本",
    "emoji 🎉🚀👩‍👩‍👧 and flags 🇯🇵",
    "tabs\tand\nnewlines\r\n",
    "Ελληνικά — Кириллица — العربية — हिन्दी",
    "<s is not special, nor is </ s>",
]


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return build_tiny_tokenizer()


DETOKENIZERS = [DecodeStreamDetokenizer, WindowDetokenizer]


def stream(detok: Detokenizer, token_ids: Sequence[int]) -> list[str]:
    deltas = [detok.push(t) for t in token_ids]
    deltas.append(detok.flush())
    return deltas


def sentencepiece_style_tokenizer() -> Tokenizer:
    """A Llama-style tokenizer: '▁' word markers, <0xNN> byte fallback, decoder strips one leading space."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "!", "▁", "▁the", "end"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    rust = RustTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    rust.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )
    return Tokenizer(hf)


def sp_ids(tokenizer: Tokenizer, pieces: Sequence[str]) -> list[int]:
    ids = tokenizer.hf.convert_tokens_to_ids(list(pieces))
    assert isinstance(ids, list) and tokenizer.hf.unk_token_id not in ids
    return ids


def test_tiny_round_trip(tiny: Tokenizer) -> None:
    for text in UNICODE_TEXTS:
        ids = tiny.encode(text)
        assert ids[0] == tiny.bos_token_id
        assert tiny.decode(ids) == text
        assert tiny.encode(text, add_special_tokens=False) == ids[1:]
    assert len(tiny.encode("日", add_special_tokens=False)) == 3


def test_tiny_special_tokens(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == 259
    assert tiny.hf.convert_ids_to_tokens([tiny.bos_token_id, *tiny.eos_token_ids]) == ["<s>", "</s>"]
    assert tiny.hf.pad_token == "<pad>"
    ids = tiny.encode("a</s>b", add_special_tokens=False)
    assert ids[1] == tiny.eos_token_ids[0] and len(ids) == 3
    assert tiny.decode(ids) == "ab"
    assert tiny.decode(ids, skip_special_tokens=False) == "a</s>b"


def test_tiny_chat_template(tiny: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 👋"}]
    text = tiny.chat_prompt_text(messages)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHéllo 👋</s>\n<|assistant|>\n"
    ids = tiny.apply_chat_template(messages)
    generation_prompt = tiny.encode("<|assistant|>\n", add_special_tokens=False)
    assert ids[-len(generation_prompt) :] == generation_prompt
    assert ids[0] == tiny.bos_token_id and ids.count(tiny.bos_token_id) == 1
    assert ids.count(tiny.eos_token_ids[0]) == 2
    assert tiny.decode(ids, skip_special_tokens=False) == text
    without_prompt = tiny.apply_chat_template(messages, add_generation_prompt=False)
    assert ids == without_prompt + generation_prompt


def test_missing_chat_template_is_invalid_config() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.hf.chat_template = None
    with pytest.raises(InvalidConfigError, match="chat template") as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(info.value, DistServeError)


def test_from_pretrained_reads_generation_config_eos(tmp_path: pathlib.Path) -> None:
    _, tokenizer = build_tiny_hf_model()
    tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}), encoding="utf-8")
    loaded = Tokenizer.from_pretrained(str(tmp_path))
    assert loaded.eos_token_ids == (1, 2)
    assert loaded.encode("ok 🙂") == tokenizer.encode("ok 🙂")


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_detokenizer_never_emits_partial_characters(tiny: Tokenizer, kind: type[Detokenizer]) -> None:
    text = "ab 日本 🎉 é!"
    ids = tiny.encode(text, add_special_tokens=False)
    detok = kind(tiny)
    deltas = stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tiny.decode(ids) == text
    assert detok.token_ids == ids
    first_byte_of_cjk = ids.index(tiny.encode("日", add_special_tokens=False)[0])
    assert deltas[first_byte_of_cjk] == deltas[first_byte_of_cjk + 1] == ""
    assert deltas[first_byte_of_cjk + 2] == "日"


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_detokenizer_flushes_incomplete_tail(tiny: Tokenizer, kind: type[Detokenizer]) -> None:
    ids = tiny.encode("ok 🎉", add_special_tokens=False)[:-2]
    detok = kind(tiny)
    assert "".join(detok.push(t) for t in ids) == "ok "
    tail = detok.flush()
    assert tail and set(tail) == {"\ufffd"}
    assert detok.text == tiny.decode(ids)
    assert detok.flush() == ""


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_detokenizer_skips_special_tokens_and_uses_prompt_context(tiny: Tokenizer, kind: type[Detokenizer]) -> None:
    prompt = tiny.encode("Grüß 日本")
    output = tiny.encode("é</s>x 🎉</s>", add_special_tokens=False) + [tiny.bos_token_id]
    detok = kind(tiny, prompt)
    deltas = stream(detok, output)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text == tiny.decode(output) == "éx 🎉"
    assert detok.token_ids == output


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_detokenizer_keeps_special_tokens_when_asked(tiny: Tokenizer, kind: type[Detokenizer]) -> None:
    output = tiny.encode("é</s>x 🎉<pad>", add_special_tokens=False)
    detok = kind(tiny, tiny.encode("Grüß"), skip_special_tokens=False)
    deltas = stream(detok, output)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text == tiny.decode(output, skip_special_tokens=False) == "é</s>x 🎉<pad>"


def test_fast_tokenizers_detokenize_with_decode_stream(tiny: Tokenizer) -> None:
    assert isinstance(tiny.detokenizer(), DecodeStreamDetokenizer)
    assert isinstance(tiny.detokenizer(skip_special_tokens=False), DecodeStreamDetokenizer)


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_detokenizer_matches_decode_on_random_bytes(tiny: Tokenizer, kind: type[Detokenizer]) -> None:
    rng = random.Random(0)
    for trial in range(200):
        ids = [rng.randrange(tiny.vocab_size) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(tiny.vocab_size) for _ in range(rng.randrange(0, 8))]
        detok = kind(tiny, prompt)
        deltas = stream(detok, ids)
        assert detok.text == "".join(deltas) == tiny.decode(ids), (trial, prompt, ids)


def test_window_detokenizer_decodes_a_bounded_window(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths: list[int] = []
    real_decode = Tokenizer.decode

    def spy(self: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        lengths.append(len(token_ids))
        return real_decode(self, token_ids, skip_special_tokens)

    ids = tiny.encode("streaming 🎉 text, 日本語 " * 40, add_special_tokens=False)
    detok = WindowDetokenizer(tiny, tiny.encode("a long prompt " * 20))
    monkeypatch.setattr(Tokenizer, "decode", spy)
    stream(detok, ids)
    monkeypatch.undo()
    assert len(ids) > 500
    assert max(lengths) <= 10
    assert detok.text == tiny.decode(ids)


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_detokenizer_sentencepiece_leading_spaces(kind: type[Detokenizer]) -> None:
    sp = sentencepiece_style_tokenizer()
    pieces = ["▁Hello", "▁world", "▁", "<0xE6>", "<0x97>", "<0xA5>", "!", "</s>", "▁the", "end"]
    ids = sp_ids(sp, pieces)
    assert sp.decode(sp_ids(sp, ["▁world"])) == "world"
    assert sp.decode(ids) == "Hello world 日! theend"
    detok = kind(sp)
    deltas = stream(detok, ids)
    assert deltas[:7] == ["Hello", " world", " ", "", "", "日", "!"]
    assert detok.text == sp.decode(ids)


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_detokenizer_sentencepiece_continues_prompt(kind: type[Detokenizer]) -> None:
    sp = sentencepiece_style_tokenizer()
    prompt = sp_ids(sp, ["<s>", "▁Hello"])
    output = sp_ids(sp, ["▁world", "!"])
    detok = kind(sp, prompt)
    stream(detok, output)
    assert detok.text == " world!"
    assert sp.decode(prompt) + detok.text == sp.decode(prompt + output)


@pytest.mark.slow
def test_smollm2_tokenizer() -> None:
    model_dir = resolve_model_dir("smollm2-135m")
    assert model_dir is not None
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert tokenizer.vocab_size == 49152
    text = "Hello wörld! 日本語のテキスト 🎉🚀 Ελληνικά — naïve café"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.hf.chat_template
    messages = [{"role": "user", "content": "Bonjour 👋"}]
    prompt_text = tokenizer.chat_prompt_text(messages)
    assert "<|im_start|>user\nBonjour 👋<|im_end|>" in prompt_text
    assert prompt_text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.apply_chat_template(messages), skip_special_tokens=False) == prompt_text
    detok = tokenizer.detokenizer(tokenizer.apply_chat_template(messages))
    deltas = stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text == tokenizer.decode(ids) == text
    assert "<|im_end|>" in tokenizer.hf.convert_ids_to_tokens(list(tokenizer.eos_token_ids))
