"""``Placement``: the deployable description of a serving setup, as data (JSON in, JSON out).

``distserve plan`` writes one; ``distserve serve --placement FILE`` deploys exactly that. The
shorthand flags (``--prefill 1 --decode 1 --prefill-tp 1 ...``, ``--colocated N``) build one too.

    {"prefill": [{"tp": 2, "pp": 1, "node": 0}], "decode": [{"tp": 1, "pp": 1, "node": 0}],
     "colocated": [], "predicted": {...optional planner figures...}}

A decode instance may belong to a **class pool** (``"pool": "latency"``, an objective of
``distserve.cluster.classes``) and cap its batch (``"max_num_seqs": 8``): requests of that
objective are decoded there first, the others only when nothing else is alive
(``distserve.cluster.routing.decode_order``). No pool (the default) is the shared pool.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from distserve.cluster.classes import OBJECTIVES
from distserve.config import ParallelConfig, SchedulerConfig
from distserve.errors import InvalidConfigError
from distserve.slo import SLO


_OPTIONAL_KEYS = ("threads", "pool", "max_num_seqs")  # written only when set


@dataclass(frozen=True)
class InstanceSpec:
    """One instance: its parallelism, optionally the node (index) its workers must use, and
    optionally the torch threads each of its workers computes with (CPU; the planner writes the
    thread count its profile was measured with; ``serve --threads`` overrides it; default 1).

    Decode instances may also name the class ``pool`` they serve (an objective: ``latency``,
    ``throughput``, ``default``; None: shared, any class) and their batch cap ``max_num_seqs``
    (None: the deployment's ``SchedulerConfig``)."""

    tp: int = 1
    pp: int = 1
    node: int | None = None
    threads: int | None = None
    pool: str | None = None
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidConfigError(f"instance {name} must be an integer >= 1, got {value!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1):
            raise InvalidConfigError(f"instance threads must be an integer >= 1, got {self.threads!r}")
        if self.node is not None and (not isinstance(self.node, int) or self.node < 0):
            raise InvalidConfigError(f"instance node must be an integer >= 0, got {self.node!r}")
        if self.pool is not None and self.pool not in OBJECTIVES:
            raise InvalidConfigError(f"instance pool must be null or one of {', '.join(OBJECTIVES)}, got {self.pool!r:.80}", "pool")
        if self.max_num_seqs is not None and (
            not isinstance(self.max_num_seqs, int) or isinstance(self.max_num_seqs, bool) or self.max_num_seqs < 1
        ):
            raise InvalidConfigError(f"instance max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}", "max_num_seqs")

    def scheduler_config(self, base: SchedulerConfig) -> SchedulerConfig:
        """``base`` with this instance's batch cap, if it has one."""
        return base if self.max_num_seqs is None else replace(base, max_num_seqs=self.max_num_seqs)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, pp=self.pp)

    @property
    def num_workers(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class Placement:
    """Prefill and decode instances (disaggregated), or colocated instances (the baseline)."""

    prefill: tuple[InstanceSpec, ...] = ()
    decode: tuple[InstanceSpec, ...] = ()
    colocated: tuple[InstanceSpec, ...] = ()
    predicted: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # The SLO the deployment is planned for: ``serve`` keeps colocated steps within its TPOT (the
    # "slo" step budget) unless --tpot-slo says otherwise.
    slo: SLO | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "decode", tuple(self.decode))
        object.__setattr__(self, "colocated", tuple(self.colocated))
        disagg = bool(self.prefill or self.decode)
        if disagg and not (self.prefill and self.decode):
            raise InvalidConfigError("a disaggregated placement needs at least one prefill and one decode instance")
        if disagg and self.colocated:
            raise InvalidConfigError("a placement is either disaggregated (prefill/decode) or colocated, not both")
        if not disagg and not self.colocated:
            raise InvalidConfigError("a placement needs prefill+decode instances or colocated instances")
        if any(s.pool is not None for s in self.prefill + self.colocated):
            raise InvalidConfigError("only decode instances belong to a class pool", "pool")

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def num_workers(self) -> int:
        return sum(i.num_workers for i in self.prefill + self.decode + self.colocated)

    @property
    def pools(self) -> dict[str | None, int]:
        """Decode instances per class pool (None: shared)."""
        out: dict[str | None, int] = {}
        for s in self.decode:
            out[s.pool] = out.get(s.pool, 0) + 1
        return out

    @classmethod
    def disaggregated(
        cls, num_prefill: int = 1, num_decode: int = 1, prefill_tp: int = 1, prefill_pp: int = 1,
        decode_tp: int = 1, decode_pp: int = 1,
    ) -> "Placement":
        """The shorthand flags: ``num_prefill`` × (prefill_tp, prefill_pp) and ``num_decode`` × (decode_tp, decode_pp)."""
        if num_prefill < 1 or num_decode < 1:
            raise InvalidConfigError(f"--prefill and --decode must be >= 1, got {num_prefill} and {num_decode}")
        return cls(
            prefill=tuple(InstanceSpec(prefill_tp, prefill_pp) for _ in range(num_prefill)),
            decode=tuple(InstanceSpec(decode_tp, decode_pp) for _ in range(num_decode)),
        )

    @classmethod
    def colocated_instances(cls, n: int, tp: int = 1, pp: int = 1) -> "Placement":
        if n < 1:
            raise InvalidConfigError(f"--colocated must be >= 1, got {n}")
        return cls(colocated=tuple(InstanceSpec(tp, pp) for _ in range(n)))

    def with_threads(self, threads: int) -> "Placement":
        """Every instance's workers compute with ``threads`` torch threads (``serve --threads``)."""
        def each(specs: tuple[InstanceSpec, ...]) -> tuple[InstanceSpec, ...]:
            return tuple(replace(s, threads=threads) for s in specs)

        return Placement(each(self.prefill), each(self.decode), each(self.colocated), self.predicted, self.slo)

    def to_dict(self) -> dict[str, Any]:
        def spec(i: InstanceSpec) -> dict[str, Any]:
            return {k: v for k, v in asdict(i).items() if k not in _OPTIONAL_KEYS or v is not None}

        out: dict[str, Any] = {
            "prefill": [spec(i) for i in self.prefill],
            "decode": [spec(i) for i in self.decode],
            "colocated": [spec(i) for i in self.colocated],
        }
        if self.predicted:
            out["predicted"] = self.predicted
        if self.slo is not None:
            out["slo"] = asdict(self.slo)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "Placement":
        if not isinstance(data, dict):
            raise InvalidConfigError("placement JSON must be an object with 'prefill'/'decode' or 'colocated' lists")
        unknown = set(data) - {"prefill", "decode", "colocated", "predicted", "slo"}
        if unknown:
            raise InvalidConfigError(f"unknown placement keys: {sorted(unknown)}")

        def specs(key: str) -> tuple[InstanceSpec, ...]:
            items = data.get(key) or []
            if not isinstance(items, list):
                raise InvalidConfigError(f"placement '{key}' must be a list")
            out = []
            for i, item in enumerate(items):
                if not isinstance(item, dict) or set(item) - {"tp", "pp", "node", *_OPTIONAL_KEYS}:
                    raise InvalidConfigError(f"placement {key}[{i}] must be an object with tp, pp and optional node, "
                                             f"{', '.join(_OPTIONAL_KEYS)}")
                try:
                    out.append(InstanceSpec(**item))
                except InvalidConfigError as exc:
                    raise InvalidConfigError(f"placement {key}[{i}]: {exc}", exc.param) from None

            return tuple(out)

        slo = data.get("slo")
        if slo is not None and (not isinstance(slo, dict) or not {"ttft_s", "tpot_s"} <= set(slo) <= {"ttft_s", "tpot_s", "attainment"}):
            raise InvalidConfigError("placement 'slo' must be an object with ttft_s, tpot_s and optional attainment")
        return cls(
            specs("prefill"), specs("decode"), specs("colocated"), dict(data.get("predicted") or {}),
            SLO(**slo) if slo is not None else None,
        )

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def load(cls, path: str | Path) -> "Placement":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise InvalidConfigError(f"cannot read placement file {path}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise InvalidConfigError(f"placement file {path} is not valid JSON: {exc}") from exc
        return cls.from_dict(data)
