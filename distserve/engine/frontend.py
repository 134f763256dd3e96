"""The request front end every engine shares: prompt validation and tokenization, the live requests and their
``RequestOutput``s (``RequestFrontend``), and the synchronous engine's ``generate`` / ``stream`` API over
``add_request`` / ``step`` / ``abort_request`` with recovery from failed steps (``EngineBase``).
"""

from __future__ import annotations

import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence as Seq

from distserve.cluster.admission import check_timeout
from distserve.cluster.classes import RequestClass, check_request_class
from distserve.cluster.recovery import blame, poison_message
from distserve.config import PRIORITY_MAX, PRIORITY_MIN, CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.sequence import Sequence, SequenceStatus, completion_sampling, completion_seq_id
from distserve.engine.outputs import OutputProcessor, RequestOutput
from distserve.engine.structured_output import shared_compiler
from distserve.engine.weights import LoadedModel
from distserve.errors import (
    DistServeError,
    EngineDeadError,
    InvalidConfigError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    StepFailedError,
)

logger = logging.getLogger(__name__)

# A step failing this many times in a row (no step succeeding between) means the engine itself is
# broken, not a request: it is declared dead (``EngineDeadError``) rather than retried forever.
MAX_CONSECUTIVE_FAILED_STEPS = 8

MAX_DEFAULT_BLOCKS = 16384


class RequestFrontend(ABC):
    """The request front end every engine shares (colocated, in-process or Ray-disaggregated).

    It validates prompts, keeps the live sequences and turns their tokens into ``RequestOutput``s;
    subclasses decide where a new sequence runs (``_submit``).
    """

    def __init__(
        self, loaded: LoadedModel, cache_config: CacheConfig | None, scheduler_config: SchedulerConfig | None
    ) -> None:
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.num_blocks = self.cache_config.num_blocks or min(
            self.cache_config.resolve_num_blocks(self.model_config), MAX_DEFAULT_BLOCKS
        )
        model_len = self.scheduler_config.max_model_len or self.model_config.max_position_embeddings
        if model_len > self.model_config.max_position_embeddings:
            raise InvalidConfigError(
                f"max_model_len={model_len} exceeds the model's max_position_embeddings="
                f"{self.model_config.max_position_embeddings}"
            )
        # A sequence can never hold more tokens than a whole cache.
        self.max_model_len = min(model_len, self.num_blocks * self.cache_config.block_size)
        self.eos_token_ids = tuple(sorted(set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        # Structured output: one compiler per tokenizer and backend in the process, shared with the instances here.
        self.grammar_compiler = shared_compiler(self.scheduler_config.structured_output_backend, self.tokenizer, self.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._groups: dict[str, set[str]] = {}  # request id -> its unfinished completions' seq ids (``n`` > 1)
        self._ids = itertools.count()

    @abstractmethod
    def _submit(self, seq: Sequence) -> None:
        """Hand a new, validated sequence to the scheduler that will run it."""

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of ``prompt``, validated against the vocabulary and the context length."""
        if isinstance(prompt, str):
            self.tokenizer.check_text_fits(prompt, self.max_model_len)
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise DistServeError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        if not ids:
            raise DistServeError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                f"(at least one output token must fit)"
            )
        return ids

    def check_request(self, prompt_ids: Seq[int], sampling: SamplingParams, priority: int = 0) -> None:
        """What ``SamplingParams`` cannot check alone: limits set by the model and the context.

        Raises a ``DistServeError`` naming the field at fault (``param``).
        """
        if not isinstance(priority, int) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise DistServeError(f"priority must be a 64-bit signed integer, got {priority!r}", "priority")
        if sampling.n > self.scheduler_config.max_num_seqs:
            raise InvalidSamplingParamsError(
                f"n is {sampling.n} but a batch holds at most {self.scheduler_config.max_num_seqs} sequences (max_num_seqs)", "n")
        vocab = self.model_config.vocab_size
        bad = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidSamplingParamsError(f"stop_token_ids must be below the vocabulary size {vocab}, got {bad[:3]}", "stop_token_ids")
        bad = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad:
            raise InvalidSamplingParamsError(f"logit_bias keys must be token ids below the vocabulary size {vocab}, got {bad[:3]}", "logit_bias")
        if sampling.structured is not None:
            self.grammar_compiler.check(sampling.structured)  # compiled once; a bad or too complex spec names its param
        room = self.max_model_len - len(prompt_ids)
        if sampling.max_tokens > room:
            raise PromptTooLongError(
                f"max_tokens is {sampling.max_tokens} but the context holds {self.max_model_len} tokens and the "
                f"prompt has {len(prompt_ids)}: at most {room} output tokens fit",
                "max_tokens",
            )

    def encode_batch(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        """Validated token ids and one ``SamplingParams`` per prompt; raises before anything is queued."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise DistServeError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if any(sp.n > 1 for sp in params):  # one ``RequestOutput`` per prompt cannot hold n completions
            raise InvalidSamplingParamsError("generate returns one output per prompt, so n must be 1; for n > 1 use "
                                             "add_request and step (or stream): each output carries its completion's index", "n")
        encoded = [self.encode_prompt(p) for p in prompts]
        for ids, sp in zip(encoded, params):
            self.check_request(ids, sp)
        return encoded, params

    def add_request(
        self,
        prompt: str | Seq[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        request_class: RequestClass | None = None,
        timeout_s: float | None = None,
        dispatch_time: float | None = None,
        admission_rank: int = 0,
    ) -> str:
        """Queue a request (of scheduling class ``request_class``, default: none); raises a
        ``DistServeError`` (a ValueError) for bad input. ``timeout_s``: the longest it may wait in
        the driver's admission queue before it fails with a ``RequestTimeoutError`` (a driver
        without one dispatches every request on arrival, so it never waits there).
        ``dispatch_time``: when an admission queue in front of this engine released it (its
        scheduler orders it by this, ``Sequence.dispatch_time``; None: by ``arrival_time``), and
        ``admission_rank`` the level it left that queue at (``Sequence.admission_rank``)."""
        sampling = sampling or SamplingParams()
        ids = self.encode_prompt(prompt)
        self.check_request(ids, sampling, priority)
        request_class = check_request_class(request_class)
        timeout_s = check_timeout(timeout_s)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq_ids = [completion_seq_id(request_id, i) for i in range(sampling.n)]
        if any(s in self._seqs for s in seq_ids) or request_id in self._groups:
            raise DistServeError(f"request id {request_id!r} is already in flight")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        seqs = [
            Sequence(
                seq_id=seq_id,
                prompt_token_ids=ids,
                sampling=completion_sampling(sampling, i) if sampling.n > 1 else sampling,
                arrival_time=arrival_time,
                priority=priority,
                request_class=request_class,
                timeout_s=timeout_s,
                dispatch_time=dispatch_time,
                admission_rank=admission_rank,
                request_id=request_id,
                index=i,
            )
            for i, seq_id in enumerate(seq_ids)
        ]
        seq = seqs[0]
        seq.forks = seqs[1:]  # prefilled once, with the leader (``Scheduler._fork``)
        if len(seqs) > 1:
            self._groups[request_id] = set(seq_ids)
        for s in seqs:
            self._seqs[s.seq_id] = s
            self.outputs.add(s)
        try:
            self._submit(seq)
        except BaseException:
            self._forget_request(request_id)
            raise
        return request_id

    def _forget(self, request_id: str) -> Sequence | None:
        self.outputs.discard(request_id)
        return self._seqs.pop(request_id, None)

    def _forget_request(self, request_id: str) -> list[Sequence]:
        """Forget every completion of a request (one unless ``n`` > 1); returns those that were live here."""
        group = self._groups.pop(request_id, None)
        seq_ids = sorted(group, key=lambda s: s != request_id) if group is not None else [request_id]  # the leader first
        return [seq for s in seq_ids if (seq := self._forget(s)) is not None]

    def _request_done(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        """``seq`` finished: ``out.finished`` says whether its whole request did (``n`` > 1)."""
        self._seqs.pop(seq.seq_id, None)
        group = self._groups.get(seq.request_id)
        if group is not None:
            group.discard(seq.seq_id)
            if group:
                out.finished = False
            else:
                del self._groups[seq.request_id]
        return out

    def _output(self, seq: Sequence, now: float, finish: Callable[[Sequence, str], None]) -> RequestOutput:
        """The request's output since its last one; a failure here (detokenizing, stop strings) is
        that request's alone: it ends with ``finish_reason`` "error" and its KV is freed."""
        try:
            out = self.outputs.process(seq, now, finish)
        except Exception as exc:  # noqa: BLE001 - fails this request only
            logger.exception("output processing failed for request %s", seq.seq_id)
            return self._fail(seq, f"output processing failed: {type(exc).__name__}: {exc}", now, finish)
        if out.finished:
            return self._request_done(seq, out)
        return out

    def _fail(
        self, seq: Sequence, error: str, now: float, finish: Callable[[Sequence, str], None] | None = None, kind: str | None = None,
    ) -> RequestOutput:
        """End ``seq`` with ``error`` (``finish`` frees its KV where it runs) and return its last output
        (``kind``: its ``RequestOutput.error_kind``)."""
        seq.error = error
        if not seq.is_finished:
            seq.finish_time = now
            if finish is not None:
                finish(seq, "error")
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "error"
        forks, seq.forks = seq.forks, []
        for f in forks:  # completions riding with it (never dispatched): they fail with it
            if not f.is_finished:
                f.error, f.finish_time, f.status, f.finish_reason = error, now, SequenceStatus.FINISHED, "error"
            self._request_done(f, self.outputs.failed(f, now, kind))
        return self._request_done(seq, self.outputs.failed(seq, now, kind))


def _already_finished(seq: Sequence, reason: str) -> None:
    """The ``finish`` callback for a sequence that no scheduler holds any more."""


class EngineBase(RequestFrontend):
    """A synchronous engine: ``step`` runs one batch. ``generate`` and ``stream`` come for free.

    ``step_or_recover`` is the step its drivers call: a step that raises is recovered from (see
    ``recover``) rather than ending the engine, unless steps keep failing.
    """

    num_failed_steps = 0
    num_consecutive_failed_steps = 0
    num_poison_requests = 0  # failed by ``recover`` for a second failed step

    @abstractmethod
    def step(self) -> list[RequestOutput]: ...

    @abstractmethod
    def _reset(self) -> None:
        """Forget every request's KV and scheduling state (fresh block managers and schedulers);
        the model, its weights and the requests' tokens so far are kept."""

    def step_or_recover(self) -> list[RequestOutput]:
        """``step``; if it raises, ``recover`` and return the outputs of the requests that failed.

        Raises ``EngineDeadError`` after ``MAX_CONSECUTIVE_FAILED_STEPS`` failures in a row.
        """
        try:
            outputs = self.step()
        except Exception as exc:  # noqa: BLE001 - any failure of the step: recover, or declare the engine dead
            self.num_failed_steps += 1
            self.num_consecutive_failed_steps += 1
            if self.num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                raise EngineDeadError(
                    f"the engine failed {self.num_consecutive_failed_steps} steps in a row; last: {type(exc).__name__}: {exc}"
                ) from exc
            return self.recover(exc)
        self.num_consecutive_failed_steps = 0
        return outputs

    def recover(self, exc: BaseException) -> list[RequestOutput]:
        """After a failed step: reset the engine's state and re-run every request in flight from its
        prompt and tokens so far, except the requests blamed for a second failed step, which fail.

        The step's suspects are the requests its plan computed (``StepFailedError.seq_ids``); each
        runs its next step alone (``Sequence.isolate``), so a second failure finds the culprit.
        """
        suspects = exc.seq_ids if isinstance(exc, StepFailedError) else ()
        logger.error("engine step failed (%s: %s); re-running %d requests", type(exc).__name__, exc, len(self._seqs))
        live = [seq for seq in self._seqs.values() if not seq.is_finished]
        for seq in live:
            seq.forks = []  # ``n`` > 1: each completion is live here and re-runs (or fails) on its own
        self._reset()
        convicted = {seq.seq_id for seq in blame(self._seqs[s] for s in suspects if s in self._seqs)}
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for seq in [s for s in self._seqs.values() if s.is_finished]:
            outputs.append(self._output(seq, now, _already_finished))  # finished before the failure: report it
        for seq in live:
            if seq.seq_id in convicted:
                self.num_poison_requests += 1
                outputs.append(self._fail(seq, poison_message(seq), now))
                continue
            seq.status = SequenceStatus.WAITING
            seq.block_table = []
            seq.block_hashes = []
            seq.num_computed_tokens = 0
            self._submit(seq)
        return outputs

    @abstractmethod
    def abort_request(self, request_id: str) -> None: ...

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    def generate(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (batched with whatever else is in flight); outputs in input order."""
        encoded, params = self.encode_batch(prompts, sampling_params)
        ids = [self.add_request(e, sp) for e, sp in zip(encoded, params)]
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        while pending:
            for out in self.step_or_recover():
                if out.finished and out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
        return [results[i] for i in ids]

    def stream(
        self, prompt: str | Seq[int], sampling: SamplingParams | None = None, priority: int = 0
    ) -> Iterator[RequestOutput]:
        """Yield this request's outputs as tokens arrive; other requests in flight advance too."""
        request_id = self.add_request(prompt, sampling, priority=priority)
        try:
            while True:
                for out in self.step_or_recover():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if request_id in self._seqs:
                self.abort_request(request_id)

