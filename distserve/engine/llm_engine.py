"""The colocated engine: prefill and decode batched together by continuous batching (the baseline).

Engine step = ``schedule`` → ``execute`` → ``postprocess`` (detokenize, stop strings, outputs).
"""

from __future__ import annotations

import time

from distserve.config import CacheConfig, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.model import resolve_dtype
from distserve.engine.model_runner import ModelRunner
from distserve.engine.outputs import EngineBase, RequestMetrics, RequestOutput
from distserve.engine.scheduler import Scheduler, attributed_to
from distserve.engine.sequence import Sequence
from distserve.engine.weights import LoadedModel, load_model


class LLMEngine(EngineBase):
    """Offline ``generate`` and streaming over one model with a paged KV cache.

    ``dtype`` applies when ``model`` is a name or path (``auto``: bf16 where the hardware has fast
    bf16, else fp32); a ``LoadedModel`` keeps its own dtype.
    """

    def __init__(
        self,
        model: str | LoadedModel = "tiny",
        *,
        dtype: str = "auto",
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        device: str = "cpu",
    ) -> None:
        loaded = load_model(model, resolve_dtype(dtype, device)) if isinstance(model, str) else model
        super().__init__(loaded, cache_config, scheduler_config)
        bs = self.cache_config.block_size
        self._reset()
        self.runner = ModelRunner(loaded.config, loaded.state_dict, self.num_blocks, bs, self.eos_token_ids, device)
        self.num_steps = 0

    def _reset(self) -> None:
        self.block_manager = BlockManager(self.num_blocks, self.cache_config.block_size, self.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, self.max_model_len, self.eos_token_ids)

    def _submit(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        seq = self._forget(request_id)
        if seq is not None and not seq.is_finished:
            seq.finish_time = time.monotonic()
            self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that got a token (or finished)."""
        plan = self.scheduler.schedule()
        with attributed_to(plan):
            start = time.perf_counter()
            sampled = self.runner.execute(plan)
            self.scheduler.observe_step(plan, time.perf_counter() - start)
            now = time.monotonic()
            self.num_steps += 1
            updated = self.scheduler.update_from_output(plan, sampled, self._seqs, now)
        return [self._output(seq, now, self.scheduler.finish) for seq in updated]

    def stats(self) -> dict[str, float]:
        """Gauges for monitoring: queue lengths, KV usage, prefix-cache hit rate, preemptions."""
        bm = self.block_manager
        return {
            "num_requests_waiting": self.scheduler.num_waiting,
            "num_requests_running": self.scheduler.num_running,
            "kv_cache_usage_perc": bm.usage,
            "prefix_cache_hit_rate": bm.num_prefix_hit_tokens / max(1, bm.num_prefix_query_tokens),
            "num_preemptions": self.scheduler.num_preemptions,
        }


__all__ = ["LLMEngine", "RequestOutput", "RequestMetrics"]
