"""What the executor sends for each output of a call — the exact recipe, so a client issuing the same calls one by one can reproduce it.

**``model_type: "token_id"``** (the default, Parrot's name): the prompt is a list of token ids,
built from the call's template pieces in order, each piece encoded *on its own*:

1. the special tokens the tokenizer puts before a whole prompt — what ``Tokenizer.encode(text)``
   adds to ``Tokenizer.encode(text, add_special_tokens=False)`` in front (SmolLM2: none; the
   tiny test model: ``<s>``). Tokens a tokenizer would append *after* the text (an eos) are left
   off: the prompt is to be continued, not ended;
2. each text piece of the template: ``encode(piece, add_special_tokens=False)`` — except that a
   piece's trailing space goes to the start of the next piece when that piece is text (rule 3):
   BPE tokenizers attach a space to the word after it (``"Ġbees"``), so ``" " + value`` encoded
   together is what tokenizing the whole string gives, while the text before keeps its ids. Before
   an output or generated ids the space is encoded on its own (as at the end of a whole string);
3. each input: a literal or client-set value as ``encode(value, add_special_tokens=False)``; a
   generated variable read without transforms as the token ids it was generated as (rule 5);
   with transforms, ``encode(transformed text, add_special_tokens=False)`` — except that a last
   ``truncate_tokens(n)`` keeps the first ``n`` ids of what it truncates (the generated ids, or
   the text before it encoded), so it cuts tokens, not re-tokenized text;
4. an output is generated after the ids so far; the call then continues after that output's
   generated ids (rule 5), not after its re-tokenized text. Text after the last output is not sent;
5. an output's ids as kept: its generated ids without trailing special tokens (eos) and
   ``stop_token_ids``; when a stop string cut its text, the longest prefix of those ids whose text
   is a prefix of the value, then the rest of the value encoded on its own.

Why pieces: tokenizing the whole string makes the ids at a boundary depend on both sides — a
generated output re-tokenizes differently from the ids the model produced (models emit
non-canonical splits, and bytes that are not valid UTF-8 decode to U+FFFD), a value can merge
with the text around it — so what a prefill sends is not what was computed before, which defeats
block-hash prefix caching. Piece by piece, a template's text is the same ids in every call, a
reused variable the same ids wherever it is read, and a multi-output call's next prefill starts
with exactly the ids whose KV was computed. (SentencePiece tokenizers that add a dummy prefix
space would add one per piece; the models we ship — SmolLM2 and the tiny model — are byte-level
and do not.)

**``model_type: "text"``**: the pieces' text (inputs through their transforms, outputs as their
values) concatenated and sent as one string, which the engine tokenizes as a whole
(``encode(text)``, special tokens included) — for text-only backends; prefixes may then tokenize
differently from call to call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from distserve.dataflow.transforms import Transform, apply_transforms
from distserve.engine.tokenizer import Tokenizer

_PROBE = "a"


@functools.lru_cache(maxsize=8)
def special_prefix(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids ``tokenizer.encode`` puts before a whole prompt's text (a bos), rule 1."""
    with_special = tokenizer.encode(_PROBE)
    plain = tokenizer.encode(_PROBE, add_special_tokens=False)
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            return tuple(with_special[:start])
    return ()


def kept_output_ids(tokenizer: Tokenizer, token_ids: Sequence[int], text: str, stop_token_ids: Sequence[int] = ()) -> list[int]:
    """An output's generated ids as the prompt continues with them (rule 5)."""
    ids = list(token_ids)
    ends = tokenizer.skipped_token_ids | frozenset(stop_token_ids)
    while ids and ids[-1] in ends:
        ids.pop()
    if tokenizer.decode(ids) == text:
        return ids
    # A stop string cut the text (possibly inside a token): the largest k whose text is a prefix of the value.
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(tokenizer.decode(ids[:mid])):
            lo = mid
        else:
            hi = mid - 1
    head = ids[:lo]
    rest = text[len(tokenizer.decode(head)) :]
    return head + (tokenizer.encode(rest, add_special_tokens=False) if rest else [])


class PromptBuilder:
    """One call's prompt, grown piece by piece; ``prompt`` is what to send for the next output."""

    def __init__(self, tokenizer: Tokenizer, model_type: str) -> None:
        self.tokenizer = tokenizer
        self.model_type = model_type
        self.ids: list[int] = list(special_prefix(tokenizer)) if model_type == "token_id" else []
        self.text = ""
        self._space = ""  # a text piece's trailing space, held for the next piece (rule 2)
        self._encoded: dict[str, list[int]] = {}  # piece text -> ids: a value read twice is encoded once

    @property
    def prompt(self) -> str | list[int]:
        if self.model_type == "text":
            return self.text
        return self.ids + self.encode(self._space)

    def encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        return ids

    def truncate_text(self, text: str, max_tokens: int) -> str:
        """``truncate_tokens`` on text (text mode, or inside a chain of transforms)."""
        return self.tokenizer.decode(self.encode(text)[:max_tokens])

    def add_text(self, text: str) -> None:
        if self.model_type == "text":
            self.text += text
            return
        self.ids += self.encode(self._take_space())
        if text.endswith(" "):
            text, self._space = text[:-1], " "
        self.ids += self.encode(text)

    def add_input(self, value: str, generated_ids: Sequence[int] | None, transforms: Sequence[Transform]) -> None:
        """An input's value (``generated_ids``: the kept ids of a generated variable, else None) through its transforms (rule 3)."""
        if self.model_type == "text":
            self.text += apply_transforms(value, transforms, self.truncate_text)
            return
        truncate = transforms[-1].arg("max_tokens") if transforms and transforms[-1].op == "truncate_tokens" else None
        head = transforms[:-1] if truncate is not None else transforms
        if generated_ids is not None and not head:
            self.ids += self.encode(self._take_space())
            ids = list(generated_ids)
        else:
            ids = self.encode(self._take_space() + apply_transforms(value, head, self.truncate_text))
        self.ids += ids if truncate is None else ids[:truncate]

    def add_output(self, text: str, kept_ids: Sequence[int]) -> None:
        """The generated output, so the next output continues after it (rule 4)."""
        if self.model_type == "text":
            self.text += text
            return
        self.ids += self.encode(self._take_space())
        self.ids += kept_ids

    def _take_space(self) -> str:
        space, self._space = self._space, ""
        return space


__all__ = ["PromptBuilder", "kept_output_ids", "special_prefix"]
