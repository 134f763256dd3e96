"""Grammar backends for constrained decoding, chosen by name (``--structured-output-backend``): each turns a
``StructuredOutput`` into a compiled grammar for one tokenizer and makes matchers that write allowed-token
bitmasks.

A bitmask row is ``int32[ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is
allowed (both libraries' layout). JSON is constrained to one layout whatever the backend: ``", "`` and
``": "`` between items and keys and no other whitespace, so a model cannot pad its output with blanks
until ``max_tokens`` (free whitespace is what lets small models do that under vLLM's default).
``experiments/bench_structured_output.py`` measures both backends; llguidance is the default.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from distserve.config import StructuredOutput
from distserve.errors import InvalidConfigError

JSON_OBJECT_SCHEMA = '{"type": "object"}'
_ITEM_SEPARATOR, _KEY_SEPARATOR = ", ", ": "
_REGEX_META = set("\\.^$|?*+()[]{}/")


class GrammarMatcher(ABC):
    """One sequence's position in its grammar."""

    @abstractmethod
    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into ``row`` (``int32[W]``, C-contiguous)."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it (the matcher is then unusable)."""

    def error(self) -> str | None:
        """Why the matcher failed (a library limit hit while computing a mask), or None."""
        return None


class GrammarBackend(ABC):
    """Compiles specs for one tokenizer (``vocab_size`` ids; ``stop_token_ids`` end an accepted output)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids

    @abstractmethod
    def compile(self, spec: StructuredOutput) -> object:
        """The compiled grammar; raises ``ValueError`` saying what is wrong with ``spec``."""

    @abstractmethod
    def matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


def choice_regex(spec: str) -> str:
    """The regex matching exactly one of the strings of ``spec`` (a JSON list), as vLLM builds ``guided_choice``."""
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("must be a non-empty list of non-empty strings")
    return "|".join("".join("\\" + ch if ch in _REGEX_META else ch for ch in c) for c in choices)


# ---- llguidance ------------------------------------------------------------------------------------
class _LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, row: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token_id: int) -> bool:
        return bool(self._m.consume_token(token_id)) and not self._m.is_error()

    def error(self) -> str | None:
        return str(self._m.get_error()) if self._m.is_error() else None


class LLGuidanceBackend(GrammarBackend):
    """Microsoft's llguidance (Rust; lazy lexer, Earley parser). Compiling is cheap and bounded by its
    parser limits (``LLParserLimits``: lexer fuel, grammar size), so a hostile schema fails fast."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        super().__init__(hf_tokenizer, vocab_size, stop_token_ids)
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids))
        self._limits = llguidance.LLParserLimits(verbose_errors=False)

    def _grammar(self, spec: StructuredOutput) -> str:
        m = self._llg.LLMatcher
        if spec.kind in ("json", "json_object"):
            options = {"whitespace_flexible": False, "item_separator": _ITEM_SEPARATOR, "key_separator": _KEY_SEPARATOR}
            return m.grammar_from_json_schema(spec.spec if spec.kind == "json" else JSON_OBJECT_SCHEMA, overrides=options)
        if spec.kind == "regex":
            return m.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            return m.grammar_from_regex(choice_regex(spec.spec))
        from llguidance.gbnf_to_lark import any_to_lark  # GBNF (``::=``) or Lark as is

        return m.grammar_from_lark(any_to_lark(spec.spec))

    def compile(self, spec: StructuredOutput) -> object:
        try:
            grammar = self._grammar(spec)
        except Exception as exc:  # noqa: BLE001 - the library's parse errors: the spec's fault
            raise ValueError(str(exc)) from exc
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer, limits=self._limits)
        if is_error:
            raise ValueError(messages[0] if messages else "invalid grammar")
        # A matcher never advanced: each sequence's is a deep copy, which shares the compiled lexer and parser.
        template = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise ValueError(template.get_error())
        self._probe(template)
        return template

    def _probe(self, template: Any) -> None:
        """Walk two fresh copies two tokens in, here rather than in an engine step: a grammar that outgrows the
        parser's limits (``((a{1000}){1000}){1000}``: too many lexer expressions, which copies share; 2,000
        alternatives: a parser row over its item bound) otherwise yields masks its matcher then refuses, or EOS
        alone; now it is a bad spec."""
        row = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        stop = set(self.stop_token_ids)
        for _ in range(2):
            probe = _LLGuidanceMatcher(template.deep_copy())
            for _ in range(2):
                probe.fill_bitmask(row)
                allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: self.vocab_size])
                token = next((int(t) for t in allowed if int(t) not in stop), None)
                if probe.error() is not None:
                    raise ValueError(f"the grammar exceeds the parser's limits: {probe.error()}")
                if token is None:
                    if not probe._m.is_accepting():
                        raise ValueError("the grammar exceeds the parser's limits: it allows no output")
                    break
                if not probe.accept(token):
                    raise ValueError(f"the grammar exceeds the parser's limits: {probe.error() or 'its mask and matcher disagree'}")

    def matcher(self, compiled: object) -> GrammarMatcher:
        return _LLGuidanceMatcher(compiled.deep_copy())  # type: ignore[attr-defined]


# ---- xgrammar --------------------------------------------------------------------------------------
class _XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, row: np.ndarray) -> None:
        self._m.fill_next_token_bitmask(row)

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))


def import_xgrammar() -> Any:
    """The xgrammar module, or an ``InvalidConfigError`` naming the extra that installs it."""
    try:
        import xgrammar
    except ImportError as exc:
        raise InvalidConfigError("the xgrammar structured-output backend needs the package: pip install 'distserve[xgrammar]' "
                                 f"({exc})", "structured_output_backend") from exc
    return xgrammar


class XGrammarBackend(GrammarBackend):
    """MLC's xgrammar (C++; pushdown automaton with a precomputed per-state token cache). Compiling
    does that precomputation, so it is slow for large schemas and has no complexity limit of its own."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        super().__init__(hf_tokenizer, vocab_size, stop_token_ids)
        xgrammar = import_xgrammar()

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        # Our own cache keeps compiled grammars (``GrammarCompiler``); one thread: compiles run beside the engine.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: StructuredOutput) -> object:
        c = self._compiler
        try:
            if spec.kind in ("json", "json_object"):
                return c.compile_json_schema(spec.spec if spec.kind == "json" else JSON_OBJECT_SCHEMA, any_whitespace=False,
                                             separators=(_ITEM_SEPARATOR, _KEY_SEPARATOR))
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            if spec.kind == "choice":
                return c.compile_regex(choice_regex(spec.spec))
            grammar = self._xgr.Grammar.from_ebnf(spec.spec) if "::=" in spec.spec else self._xgr.Grammar.from_lark(spec.spec)
            return c.compile_grammar(grammar)
        except Exception as exc:  # noqa: BLE001 - RuntimeError/ValueError/InvalidJSONError for a bad spec
            raise ValueError(str(exc)) from exc

    def matcher(self, compiled: object) -> GrammarMatcher:
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled))


STRUCTURED_OUTPUT_BACKENDS: dict[str, type[GrammarBackend]] = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}
DEFAULT_STRUCTURED_OUTPUT_BACKEND = "llguidance"

__all__ = ["DEFAULT_STRUCTURED_OUTPUT_BACKEND", "GrammarBackend", "GrammarMatcher", "LLGuidanceBackend",
           "STRUCTURED_OUTPUT_BACKENDS", "XGrammarBackend", "choice_regex"]
