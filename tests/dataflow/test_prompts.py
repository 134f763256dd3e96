"""Prompts built piecewise as token ids: a shared prefix keeps its ids whatever follows it (unlike whole-string tokenization)."""

from __future__ import annotations

from distserve.dataflow.prompts import PromptBuilder, kept_output_ids, special_prefix
from distserve.dataflow.transforms import parse_transforms
from distserve.engine.tokenizer import Tokenizer
from distserve.engine.tiny_model import build_tiny_tokenizer

SYSTEM = "System: be brief. User: "


def merging_tokenizer() -> Tokenizer:
    """A byte-level BPE like SmolLM2's — merges, so a token can span a placeholder boundary; no bos added."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [("Ġ", "h"), ("Ġh", "i"), ("Ġ", "b"), ("Ġb", "y"), ("Ġby", "e")]
    symbols = ["</s>", *sorted(pre_tokenizers.ByteLevel.alphabet()), *("".join(m) for m in merges)]
    rust = RustTokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=merges))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens(["</s>"])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="</s>", clean_up_tokenization_spaces=False))


def build(tok: Tokenizer, *pieces: str, model_type: str = "token_id") -> PromptBuilder:
    """Template text and literal inputs alternating, starting with text."""
    b = PromptBuilder(tok, model_type)
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            b.add_text(piece)
        else:
            b.add_input(piece, None, ())
    return b


def test_a_static_prefix_keeps_its_ids_and_a_space_goes_with_the_word_after_it() -> None:
    tok = merging_tokenizer()
    prefix = tok.encode(SYSTEM[:-1], add_special_tokens=False)  # "... User:" — its trailing space joins the value
    for question in ("hi", "bye"):
        ids = build(tok, SYSTEM, question).ids
        assert ids == prefix + tok.encode(" " + question, add_special_tokens=False)
        assert ids == tok.encode(SYSTEM + question)  # " hi" is one token (Ġhi), as in the whole string
        assert len(ids) == len(prefix) + 1
    # Before an output (or generated ids) the space is a token of its own, as at the end of a whole string.
    assert build(tok, SYSTEM).prompt == tok.encode(SYSTEM)
    with_generated = PromptBuilder(tok, "token_id")
    with_generated.add_text(SYSTEM)
    with_generated.add_input("hi", [42], ())
    assert with_generated.ids == tok.encode(SYSTEM) + [42]


def test_the_special_prefix_is_what_encode_puts_before_a_prompt() -> None:
    tiny = build_tiny_tokenizer()
    assert special_prefix(tiny) == (tiny.bos_token_id,)  # the tiny tokenizer adds <s>
    assert special_prefix(merging_tokenizer()) == ()  # SmolLM2-like: nothing
    assert build(tiny, "Hi ", "x").ids == tiny.encode("Hi ") + tiny.encode("x", add_special_tokens=False)


def test_an_output_continues_with_its_generated_ids_cut_where_its_value_ends() -> None:
    tok = merging_tokenizer()
    eos = tok.hf.eos_token_id
    generated = tok.encode(" hi bye", add_special_tokens=False)
    assert len(generated) == 2  # Ġhi Ġbye
    assert kept_output_ids(tok, [*generated, eos], " hi bye") == generated  # the eos ends it, not part of it
    assert kept_output_ids(tok, [*generated, 7], " hi bye", stop_token_ids=[7]) == generated
    # A stop string "ye" cut the value inside the token Ġbye: the ids of " hi", then " b" encoded.
    assert kept_output_ids(tok, generated, " hi b") == generated[:1] + tok.encode(" b", add_special_tokens=False)
    tiny = build_tiny_tokenizer()
    odd = tiny.encode("é!", add_special_tokens=False)[1:]  # a lone UTF-8 continuation byte, then "!"
    assert tiny.decode(odd) == "\ufffd!"  # its text does not re-encode to these ids
    assert kept_output_ids(tiny, odd, tiny.decode(odd)) == odd != tiny.encode(tiny.decode(odd), add_special_tokens=False)


def test_truncate_tokens_cuts_ids_and_text_mode_sends_the_string() -> None:
    tok = merging_tokenizer()
    b = PromptBuilder(tok, "token_id")
    b.add_input("ignored: the ids win", [5, 6, 7], parse_transforms([{"op": "truncate_tokens", "max_tokens": 2}]))
    assert b.ids == [5, 6]  # a generated variable's own ids, cut
    b = PromptBuilder(tok, "token_id")
    b.add_input("  hi bye  ", [5, 6, 7], parse_transforms([{"op": "strip"}, {"op": "truncate_tokens", "max_tokens": 2}]))
    assert b.ids == tok.encode("hi bye", add_special_tokens=False)[:2]  # the transformed text, encoded, cut
    b.add_output(" out", [9])
    assert b.prompt == b.ids and b.ids[-1] == 9
    t = build(tok, SYSTEM, "hi", model_type="text")
    t.add_input("  bye  ", [5], parse_transforms([{"op": "strip"}]))
    t.add_output(" out", [9])
    assert t.prompt == SYSTEM + "hi" + "bye" + " out"
