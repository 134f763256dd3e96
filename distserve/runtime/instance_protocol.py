"""What crosses the Ray boundary of an instance actor (``runtime.instance_server``): the spec it is built from and
the result each of its steps reports to the controller (plain dataclasses, pickled by Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field

from distserve.config import CacheConfig, SchedulerConfig
from distserve.engine.instance_core import SeqUpdate


@dataclass
class InstanceServerSpec:
    """What an instance is: phase, model, caches and parallelism; plain data for Ray."""

    instance_id: str
    phase: str  # prefill | decode | colocated
    model: str
    dtype: str
    cache: CacheConfig
    scheduler: SchedulerConfig
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tp: int
    pp: int
    global_ranks: list[int]  # instance-local rank -> global torch.distributed rank
    num_threads: int = 1
    kv_transfer_timeout_s: float = 30.0


@dataclass
class StepResult:
    updates: list[SeqUpdate] = field(default_factory=list)
    received: list[str] = field(default_factory=list)  # decode: KV arrived, request now decoding
    failed_transfers: list[str] = field(default_factory=list)  # decode: KV did not arrive, reservation cancelled
    timed_out_transfers: list[str] = field(default_factory=list)  # those of failed_transfers that timed out
    received_bytes: int = 0  # KV payload that arrived on this instance's workers
    has_work: bool = False
    step_seconds: float = 0.0
    # A decoding request's time between its tokens (``InstanceCore.token_interval_s``): the step, the
    # controller's round trip and its work, over the last pp steps for a pipelined instance.
    token_interval_s: float = 0.0
    execute_seconds: float = 0.0  # of step_seconds: rank 0 executing the plan launched in this step
    num_batched_tokens: int = 0
    # The scheduler after the step (admission backpressure and TPOT read them), and the requests
    # ``add``ed since the actor started, so the controller can tell which of its adds these counts include.
    num_waiting: int = 0
    num_running: int = 0
    num_added: int = 0
    pending_prompt_tokens: tuple[int, ...] = ()  # prompt tokens not yet computed, by admission rank (``Scheduler.pending_prompt_tokens``)
    num_free_blocks: int = 0  # of its KV cache (decode room: ``backpressure.decode_room_tokens``)
    held_prompt_tokens: int = 0  # prefill: of every request it holds (``backpressure.held_prompt_tokens``)
    num_held: int = 0  # prefill: the requests it holds (``backpressure.held_requests``)


__all__ = ["InstanceServerSpec", "StepResult"]
