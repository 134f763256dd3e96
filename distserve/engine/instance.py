"""What a prefill and a decode instance share: a scheduler of their phase over a BlockManager and a model."""

from __future__ import annotations

import time

from distserve.config import CacheConfig, SchedulerConfig
from distserve.engine.block_manager import BlockManager
from distserve.engine.model_runner import ModelRunner
from distserve.engine.scheduler import Scheduler, attributed_to
from distserve.engine.sequence import Sequence
from distserve.engine.weights import LoadedModel


class Instance:
    """One instance executing in this process (tp = pp = 1); subclasses pick the scheduler."""

    scheduler_class: type[Scheduler] = Scheduler

    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        instance_id: str,
    ) -> None:
        self.instance_id = instance_id
        self._scheduler_args = (scheduler_config, max_model_len, eos_token_ids)
        self.cache_config = cache_config
        self.num_blocks = num_blocks
        self.reset()
        self.runner = ModelRunner(loaded.config, loaded.state_dict, num_blocks, cache_config.block_size, eos_token_ids)
        self.num_steps = 0
        self.last_step_s = 0.0

    def reset(self) -> None:
        """Forget every request and its KV (after a failed step); the model stays loaded."""
        cc = self.cache_config
        config, max_model_len, eos_token_ids = self._scheduler_args
        self.block_manager = BlockManager(self.num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = self.scheduler_class(config, self.block_manager, max_model_len, eos_token_ids)
        self.seqs: dict[str, Sequence] = {}

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Sequence]:
        """One batch; the sequences that received a token (finished ones are forgotten here)."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        with attributed_to(plan):
            sampled = self.runner.execute(plan)
            now = time.monotonic()
            self.last_step_s = time.perf_counter() - t0
            self.scheduler.observe_step(plan, self.last_step_s)
            self.num_steps += 1
            updated = self.scheduler.update_from_output(plan, sampled, self.seqs, now)
        for seq in updated:
            if seq.is_finished:
                self.seqs.pop(seq.seq_id, None)
        return updated

    def abort(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    def stats(self) -> dict[str, float]:
        return {
            "num_requests_waiting": self.scheduler.num_waiting,
            "num_requests_running": self.scheduler.num_running,
            "kv_cache_usage_perc": self.block_manager.usage,
            "step_seconds": self.last_step_s,
        }
