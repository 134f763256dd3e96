"""Where one worker sits inside its instance (tensor rank, pipeline stage): which heads, which slice of the MLP,
which layers it holds. Pure data, without torch: the controller builds these for instances it deploys."""

from __future__ import annotations

from dataclasses import dataclass

from distserve.config import ModelConfig
from distserve.errors import InvalidConfigError
from distserve.kvtransfer.layout import kv_head_range, layer_range


@dataclass(frozen=True)
class ShardSpec:
    """The part of the model held by worker (``tp_rank``, ``pp_rank``) of a ``tp × pp`` instance."""

    tp: int = 1
    pp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    @property
    def rank(self) -> int:
        """Rank inside the instance: stage-major, as in ``KVLayout``."""
        return self.pp_rank * self.tp + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_driver(self) -> bool:
        """The worker that samples: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def layers(self, config: ModelConfig) -> tuple[int, int]:
        return layer_range(config.num_layers, self.pp, self.pp_rank)

    def heads(self, config: ModelConfig) -> tuple[int, int]:
        per = config.num_heads // self.tp
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        return kv_head_range(config.num_kv_heads, self.tp, self.tp_rank)

    def intermediate(self, config: ModelConfig) -> tuple[int, int]:
        per = config.intermediate_size // self.tp
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def validate(self, config: ModelConfig) -> None:
        """Raise ``InvalidConfigError`` if this split does not fit the model."""
        if config.num_heads % self.tp:
            raise InvalidConfigError(f"tp={self.tp} does not divide num_heads={config.num_heads}")
        if config.intermediate_size % self.tp:
            raise InvalidConfigError(f"tp={self.tp} does not divide intermediate_size={config.intermediate_size}")
        try:
            self.kv_heads(config)
            self.layers(config)
        except ValueError as exc:
            raise InvalidConfigError(str(exc)) from exc
