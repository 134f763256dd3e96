"""The mutable request state that flows through scheduler, block manager and model runner."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from dataclasses import dataclass, field

from distserve.cluster.classes import DEFAULT_CLASS, RequestClass
from distserve.config import SamplingParams
from distserve.engine.logprobs import PromptLogprobs, TopLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # slots: the scheduler reads these fields per sequence per step
class Sequence:
    """One request. ``token_ids`` is prompt + output; KV exists for the first ``num_computed_tokens``."""

    seq_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the "priority" policy
    timeout_s: float | None = None  # the longest it may wait in an admission queue (None: no limit)
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # content hash of each committed full block
    # Content hash of each leading full block of token_ids, computed once (block_manager.seq_block_hashes).
    # Never stale: token_ids only grow, and a block's hash depends on the tokens up to its end alone.
    prefix_hashes: list[int] = field(default_factory=list)
    hashed_block_size: int = 0  # the block size prefix_hashes were computed for (0: none yet)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at the last admission
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)  # of each output token, if ``sampling.logprobs``
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per output token, if ``sampling.top_logprobs``
    prompt_logprobs: PromptLogprobs | None = None  # once its prompt is computed, if ``sampling.prompt_logprobs``
    order: int = 0  # admission counter; breaks arrival-time ties deterministically
    error: str | None = None  # why it failed (finish_reason "error"): this request's fault or misfortune alone
    num_crashes: int = 0  # failed steps (instance deaths) it was computed in; see distserve.cluster.recovery
    isolate: bool = False  # a crash suspect: its next step computes nothing else
    request_class: RequestClass = DEFAULT_CLASS  # objective and task group (``distserve.cluster.classes``)
    # The policy keys' fields (flat, so an attrgetter reads them): the class rank (from
    # request_class, set here), and the task group's first (arrival, order) where the scheduler
    # admits it (its own arrival_time and order for a request in no group).
    class_rank: int = 1
    group_arrival: float = 0.0
    group_order: int = 0
    # When an admission queue (``distserve.cluster.admission``) dispatched it: the instance's
    # schedulers order it by this instead of ``arrival_time``, so its fair-queueing order holds
    # there (None: no admission queue in front, ``arrival_time``). On the driver's clock.
    dispatch_time: float | None = None
    # Its admission policy's strict level (``QueuePolicy.rank``: under ``fair``, its tier and whether
    # its tenant was backlogged), set at dispatch; the policy keys order by it after the class rank.
    admission_rank: int = 0
    # Phase timestamps for the latency breakdown (``engine.request_metrics``), on the driver's clock;
    # None where its driver does not know them: the launch of the first plan computing part of its
    # prompt, and the start and end of its (last) KV migration.
    prefill_start_time: float | None = None
    migration_start_time: float | None = None
    migration_end_time: float | None = None
    # A request with ``n`` > 1 is n sequences: completion ``index`` of request ``request_id`` ("": its
    # own ``seq_id``). Completion 0 (the leader) carries the others in ``forks`` until its prompt is
    # prefilled; then they share its KV blocks (copy-on-write) and each samples its own tokens.
    request_id: str = ""
    index: int = 0
    forks: list["Sequence"] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.request_id:
            self.request_id = self.seq_id
        self.class_rank = self.request_class.rank

    def detached_copy(self) -> "Sequence":
        """The request with its tokens so far and no KV: what another instance needs to continue it."""
        return Sequence(
            seq_id=self.seq_id,
            prompt_token_ids=list(self.prompt_token_ids),
            sampling=self.sampling,
            arrival_time=self.arrival_time,
            dispatch_time=self.dispatch_time,
            prefill_start_time=self.prefill_start_time,
            admission_rank=self.admission_rank,
            priority=self.priority,
            token_ids=list(self.token_ids),
            prefix_hashes=list(self.prefix_hashes),
            hashed_block_size=self.hashed_block_size,
            first_token_time=self.first_token_time,
            logprobs=list(self.logprobs),
            top_logprobs=list(self.top_logprobs),
            prompt_logprobs=self.prompt_logprobs,
            num_crashes=self.num_crashes,
            isolate=self.isolate,
            request_class=self.request_class,
            request_id=self.request_id,
            index=self.index,
            forks=[f.detached_copy() for f in self.forks],
        )

    @property
    def num_completions(self) -> int:
        """Sequences this one stands for in admission and KV accounting: itself and its unforked completions."""
        return 1 + len(self.forks)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


def completion_seq_id(request_id: str, index: int) -> str:
    """The sequence id of completion ``index`` of a request (completion 0 keeps the request's id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def completion_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index``'s own parameters: ``n`` = 1 and, for a seeded request, a seed derived from
    (seed, index), so completion i is reproducible and completion 0 is what ``n`` = 1 would give."""
    seed = sampling.seed
    if seed is not None and index:
        seed = int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little") >> 1
    return dataclasses.replace(sampling, n=1, seed=seed)
