"""Constrained decoding (structured output) on every driver: grammars compiled once per spec and tokenizer
(``GrammarCompiler``), one matcher per sequence (``SequenceGrammars``), and the allowed-token bitmask the
sampler applies (``apply_token_bitmasks``). The grammar libraries are plug-ins (``engine.grammar_backends``).

Where the state lives, and why. The matchers live beside the sequences, in each instance's
``InstanceCore``, not in the model runner: that is where a sampled token is appended, so
``Scheduler.check_token_stop`` advances the sequence's matcher and ends the sequence once its grammar is
complete (only a stop token could follow); and each plan carries its constrained rows' bitmasks
(``ScheduledChunk.token_bitmask``) to whichever process samples them. Only the spec
(``SamplingParams.structured``) travels with a request: an instance that receives a sequence with tokens
already generated (the decode instance after a KV migration, in process or over Ray; a re-run after a
failure) builds its matcher by replaying them. Each completion of ``n`` > 1 is a sequence of its own, so
it has its own matcher; the completions' first token is sampled from the leader's row with the leader's
bitmask, which is theirs too (nothing is generated yet).

Compiling is slow for some grammars under some backends, so it runs once per spec (cached, bounded) in a
background thread, within ``COMPILE_TIMEOUT_S``: the HTTP layer compiles before it submits (a bad spec is
a 400 naming its param, and the engine thread finds it compiled), and an instance starts compiling a
request's grammar when the request arrives, before its first step.

A compile cannot be stopped once it runs (the libraries are native code), so one that outlives its timeout
keeps its thread until it ends. So that a hostile client cannot occupy every compile thread, the HTTP layer
compiles for an *owner* (its tenant, or for anonymous requests its client address, ``check_async``): an
owner has at most ``MAX_COMPILES_PER_OWNER`` new specs compiling at once (a further one waits, asynchronously,
for the owner's earlier compile, and within the timeout), and at most ``MAX_PENDING_COMPILES`` are queued or
running in all; past either, or when a spec could not even start within the timeout because the threads were
busy, the request is refused with ``QueueFullError`` (HTTP 429), never held. Cached specs are never refused.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from distserve.config import StructuredOutput
from distserve.engine.grammar_backends import STRUCTURED_OUTPUT_BACKENDS, GrammarBackend, GrammarMatcher
from distserve.errors import InvalidConfigError, InvalidSamplingParamsError, QueueFullError, StepFailedError

if TYPE_CHECKING:
    import torch  # (annotations only: a scheduler, the simulator and the planner import no torch)
    from distserve.engine.sequence import Sequence
    from distserve.engine.step_plan import StepPlan
    from distserve.engine.tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 10.0  # a spec that takes longer is refused (a hostile schema must not hold a request for long)
MAX_CACHED_GRAMMARS = 512
MAX_COMPILES_PER_OWNER = 1  # new specs compiling at once for one tenant (or anonymous client): at most one thread each
MAX_PENDING_COMPILES = 8  # new specs queued or running for all owners together
_COMPILE_THREADS = 2
_POLL_S = (0.002, 0.05)  # first and longest pause between looks at a compile in progress


def bitmask_width(vocab_size: int) -> int:
    """32-bit words in one bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """One backend for one tokenizer: compiles specs in the background, caches them, makes matchers. Thread-safe.

    The backend (its tokenizer tables take up to ~1 s to build for a 50k vocabulary) is created on first use.
    """

    def __init__(self, backend: str, tokenizer: Tokenizer, stop_token_ids: tuple[int, ...], timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        if backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise InvalidConfigError(f"structured output backend must be one of {sorted(STRUCTURED_OUTPUT_BACKENDS)}, got {backend!r}",
                                     "structured_output_backend")
        self.backend_name = backend
        self._hf_tokenizer = tokenizer.hf  # not the wrapper: ``shared_compiler`` keys on it weakly
        self.stop_token_ids = tuple(stop_token_ids)
        self.vocab_size = tokenizer.vocab_size
        self.timeout_s = timeout_s
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[object]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._non_stop: np.ndarray | None = None
        self._in_flight: dict[str, set[Future[object]]] = {}  # owner -> its compiles not yet done
        self.num_compiles = 0  # specs compiled (cache misses)
        self.num_refused = 0  # compiles refused for an owner at its bound or a full queue

    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = STRUCTURED_OUTPUT_BACKENDS[self.backend_name](self._hf_tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backend

    @property
    def non_stop_mask(self) -> np.ndarray:
        """``int32[W]`` with the bit of every token but the stop tokens set: a bitmask that shares no bit
        with it allows nothing but ending the output."""
        if self._non_stop is None:
            bits = np.ones(bitmask_width(self.vocab_size) * 32, dtype=np.uint8)
            bits[self.vocab_size :] = 0
            bits[[t for t in self.stop_token_ids if 0 <= t < self.vocab_size]] = 0
            self._non_stop = np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
        return self._non_stop

    def submit(self, spec: StructuredOutput, owner: str | None = None) -> Future[object]:
        """The compile of ``spec``: cached, else started in the background. Failed compiles stay cached too,
        so a bad spec sent again fails at once. For an ``owner`` (see the module docstring) a new spec is
        refused with ``QueueFullError`` when the owner or the queue is at its bound."""
        key = (spec.kind, spec.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            if owner is not None:
                if len(self._in_flight.get(owner, ())) >= MAX_COMPILES_PER_OWNER:
                    self.num_refused += 1
                    raise QueueFullError(f"{spec.param}: an earlier grammar of this client is still compiling; retry once it "
                                         "is done", spec.param, retry_after_s=1.0)
                if sum(len(f) for f in self._in_flight.values()) >= MAX_PENDING_COMPILES:
                    self.num_refused += 1
                    raise QueueFullError(f"{spec.param}: {MAX_PENDING_COMPILES} grammars are compiling; retry shortly",
                                         spec.param, retry_after_s=1.0)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar-compile")
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            self.num_compiles += 1
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                oldest = next(iter(self._cache))
                if not self._cache[oldest].done():
                    break
                del self._cache[oldest]
            if owner is not None:
                self._in_flight.setdefault(owner, set()).add(future)
        if owner is not None:  # outside the lock: a compile already done runs the callback here and now
            future.add_done_callback(lambda f: self._compile_done(owner, f))
        return future

    def _compile_done(self, owner: str, future: Future[object]) -> None:
        with self._lock:
            futures = self._in_flight.get(owner)
            if futures is not None:
                futures.discard(future)
                if not futures:
                    del self._in_flight[owner]

    def num_in_flight(self, owner: str | None = None) -> int:
        """New specs compiling (or queued) for ``owner`` (None: for every owner)."""
        with self._lock:
            return sum(len(f) for o, f in self._in_flight.items() if owner is None or o == owner)

    async def check_async(self, spec: StructuredOutput, owner: str) -> None:
        """Raise what ``compiled`` raises for a bad or too complex spec, or ``QueueFullError`` (see the module
        docstring), waiting without holding a thread; ``owner`` names who the compile is for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pause = _POLL_S[0]
        while True:
            try:
                future = self.submit(spec, owner)
                break
            except QueueFullError:
                if self.num_in_flight(owner) == 0 or loop.time() + pause > deadline:
                    raise  # the queue as a whole is full, or the owner's earlier compile did not end in time
            await asyncio.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])
        while not future.done() and loop.time() < deadline:
            await asyncio.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])
        self._outcome(spec, future)

    def _outcome(self, spec: StructuredOutput, future: Future[object]) -> object:
        """The compiled grammar of a done compile; a compile still running after the timeout is too complex, and
        one that never started (the threads were busy) is cancelled and refused as busy."""
        if not future.done():
            if future.cancel():
                with self._lock:
                    if self._cache.get((spec.kind, spec.spec)) is future:
                        del self._cache[(spec.kind, spec.spec)]
            else:
                raise InvalidSamplingParamsError(f"{spec.param}: the grammar took longer than {self.timeout_s:g} s to compile "
                                                 "(too complex)", spec.param)
        if future.cancelled():
            raise QueueFullError(f"{spec.param}: the server was busy compiling other grammars for {self.timeout_s:g} s; retry",
                                 spec.param, retry_after_s=1.0)
        try:
            return future.result()
        except ValueError as exc:
            raise InvalidSamplingParamsError(f"{spec.param} is invalid: {exc}", spec.param) from None

    def _compile(self, spec: StructuredOutput) -> object:
        return self.backend().compile(spec)

    def compiled(self, spec: StructuredOutput) -> object:
        """``spec`` compiled (waiting up to the timeout); an ``InvalidSamplingParamsError`` naming
        ``spec.param`` if it is invalid or too slow to compile."""
        future = self.submit(spec)
        try:
            future.result(timeout=self.timeout_s)
        except (FutureTimeout, ValueError):
            pass  # said by ``_outcome``
        return self._outcome(spec, future)

    def check(self, spec: StructuredOutput) -> None:
        """Raise what ``compiled`` raises for a bad spec."""
        self.compiled(spec)

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        return self.backend().matcher(self.compiled(spec))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


_SHARED: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[str, tuple[int, ...]], GrammarCompiler]] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def shared_compiler(backend: str, tokenizer: Tokenizer, stop_token_ids: tuple[int, ...]) -> GrammarCompiler:
    """The process's one compiler for ``backend`` over ``tokenizer``: every engine and client holding that
    tokenizer shares its cache (the HTTP layer compiles, the engine thread finds the grammar compiled)."""
    key = (backend, tuple(stop_token_ids))
    with _SHARED_LOCK:
        by_key = _SHARED.setdefault(tokenizer, {})
        compiler = by_key.get(key)
        if compiler is None:
            compiler = by_key[key] = GrammarCompiler(backend, tokenizer, stop_token_ids)
        return compiler


@dataclass(eq=False)
class _Entry:
    seq: Sequence
    matcher: GrammarMatcher
    bitmask: np.ndarray  # int32[W]: the tokens allowed next
    num_accepted: int = 0  # output tokens the matcher has consumed
    error: str | None = None


class SequenceGrammars:
    """The matchers of one instance's constrained sequences, by seq id (``InstanceCore`` holds one)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def prefetch(self, seq: Sequence) -> None:
        """Start compiling ``seq``'s grammar, so its first step finds it ready."""
        if seq.sampling.structured is not None:
            self.compiler.submit(seq.sampling.structured)

    def fill_bitmasks(self, plan: StepPlan, seqs: dict[str, Sequence]) -> None:
        """Give each constrained chunk of ``plan`` that samples its sequence's bitmask. A sequence whose
        grammar cannot be had fails the plan as a ``StepFailedError`` naming it alone."""
        for chunk in plan.chunks:
            if not chunk.sample or chunk.sampling.structured is None:
                continue
            seq = seqs.get(chunk.seq_id)
            if seq is None:
                continue
            try:
                chunk.token_bitmask = self._entry(seq).bitmask
            except Exception as exc:  # noqa: BLE001 - this request's grammar; recovery blames it alone
                raise StepFailedError(f"structured output for {seq.seq_id} failed: {exc}", [seq.seq_id]) from exc

    def accept(self, seq: Sequence) -> str | None:
        """``seq`` got a token: advance its matcher. "stop" once nothing but a stop token may follow (its
        grammar is complete), "error" (with ``seq.error``) if the token does not fit it, else None."""
        entry = self._entry(seq)
        if entry.error is not None:
            seq.error = entry.error
            return "error"
        if not np.any(entry.bitmask & self.compiler.non_stop_mask):
            return "stop"
        return None

    def _entry(self, seq: Sequence) -> _Entry:
        """``seq``'s matcher, caught up with its output tokens (built by replaying them if it has none here)."""
        entry = self._entries.get(seq.seq_id)
        num_output = seq.num_output_tokens
        fresh = entry is None or entry.seq is not seq or entry.num_accepted > num_output
        if fresh:
            spec = seq.sampling.structured
            assert spec is not None
            entry = _Entry(seq, self.compiler.matcher(spec), np.zeros(bitmask_width(self.compiler.vocab_size), dtype=np.int32))
            self._entries[seq.seq_id] = entry
        assert entry is not None
        if fresh or entry.num_accepted < num_output:
            start = seq.num_prompt_tokens + entry.num_accepted
            for token in seq.token_ids[start:] if entry.error is None else ():
                if not entry.matcher.accept(token):
                    entry.error = f"structured output: token {token} does not fit the grammar ({seq.sampling.structured.param})"  # type: ignore[union-attr]
                    break
            entry.num_accepted = num_output
            if entry.error is None:
                entry.matcher.fill_bitmask(entry.bitmask)
                failed = entry.matcher.error()
                if failed is not None:  # a library limit: the mask is not the grammar's, so nothing may be sampled from it
                    entry.error = f"structured output: {failed} ({seq.sampling.structured.param})"  # type: ignore[union-attr]
        return entry

    def drop(self, seq_id: str) -> None:
        self._entries.pop(seq_id, None)

    def clear(self) -> None:
        self._entries.clear()


def apply_token_bitmasks(logits: torch.Tensor, bitmasks: Seq[np.ndarray | None]) -> None:
    """Set each row's disallowed tokens to -inf in place (``logits``: ``[N, V]`` float32, CPU; row i by
    ``bitmasks[i]``, ``int32[W]``, None: unchanged); tokens past a bitmask's width are disallowed."""
    rows = [i for i, b in enumerate(bitmasks) if b is not None]
    if not rows:
        return
    vocab_size = logits.shape[1]
    words = np.stack([bitmasks[i] for i in rows]).astype("<i4", copy=False)  # [R, W], little-endian words
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # [R, 32 W]: bit t is token t
    width = min(vocab_size, allowed.shape[1])
    out = logits.numpy()  # shares memory
    for j, i in enumerate(rows):
        np.putmask(out[i, :width], allowed[j, :width] == 0, -np.inf)
        out[i, width:] = -np.inf


__all__ = ["COMPILE_TIMEOUT_S", "MAX_COMPILES_PER_OWNER", "MAX_PENDING_COMPILES", "GrammarCompiler", "SequenceGrammars", "apply_token_bitmasks", "bitmask_width", "shared_compiler"]
