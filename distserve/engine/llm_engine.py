"""The colocated engine: prefill and decode batched together by continuous batching (the baseline).

Engine step = ``schedule`` → ``execute`` → ``postprocess`` (detokenize, stop strings, outputs).
"""

from __future__ import annotations

import time
from typing import Any

from distserve.config import CacheConfig, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.instance_core import InstanceCore
from distserve.dtypes import resolve_dtype
from distserve.engine.model_runner import ModelRunner
from distserve.engine.frontend import EngineBase
from distserve.engine.outputs import RequestMetrics, RequestOutput
from distserve.engine.request_metrics import stamp_prefill_starts
from distserve.engine.scheduler import Scheduler
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import SampledToken, StepPlan
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
        cc = self.cache_config
        self.core = InstanceCore("colocated", self.scheduler_config, self.num_blocks, cc.block_size, self.max_model_len,
                                 self.eos_token_ids, enable_prefix_caching=cc.enable_prefix_caching,
                                 grammar_compiler=self.grammar_compiler)
        self.runner = ModelRunner(loaded.config, loaded.state_dict, self.num_blocks, cc.block_size, self.eos_token_ids, device,
                                  decode_attention=cc.decode_attention)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.core.block_manager

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    def _reset(self) -> None:
        self.core.reset()

    def _submit(self, seq: Sequence) -> None:
        self.core.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its completions) and free its blocks; unknown or finished ids are ignored."""
        for seq in self._forget_request(request_id):
            if not seq.is_finished:
                seq.finish_time = time.monotonic()
                self.core.abort(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_work()

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that got a token (or finished)."""
        updated = self.core.step(self._execute, time.monotonic)
        now = time.monotonic()
        return [self._output(seq, now, self.core.finish) for seq in updated]

    def _execute(self, plan: StepPlan) -> list[SampledToken]:
        stamp_prefill_starts(plan, self._seqs, time.monotonic())
        return self.runner.execute(plan)

    def stats(self) -> dict[str, Any]:
        """Gauges and counters for monitoring (``InstanceCore.stats``: queue lengths, KV usage, prefix-cache
        and preemption counts, step histograms) and the prefix-cache hit rate."""
        bm = self.block_manager
        return {**self.core.stats(), "prefix_cache_hit_rate": bm.num_prefix_hit_tokens / max(1, bm.num_prefix_query_tokens)}

__all__ = ["LLMEngine", "RequestOutput", "RequestMetrics"]
