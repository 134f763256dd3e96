"""``Placement``: the deployable description of a serving setup, as data (JSON in, JSON out).

``distserve plan`` writes one; ``distserve serve --placement FILE`` deploys exactly that. The
shorthand flags (``--prefill 1 --decode 1 --prefill-tp 1 ...``, ``--colocated N``) build one too.

    {"prefill": [{"tp": 2, "pp": 1, "node": 0}], "decode": [{"tp": 1, "pp": 1, "node": 0}],
     "colocated": [], "predicted": {...optional planner figures...}}

A decode instance may belong to a **class pool** (``"pool": "latency"``, an objective of
``distserve.cluster.classes``) and cap its batch (``"max_num_seqs": 8``): requests of that
objective are decoded there first, the others only when nothing else is alive
(``distserve.cluster.routing.decode_order``). No pool (the default) is the shared pool.

Batch caps deploy as planned: the top-level ``max_num_seqs``, ``max_num_batched_tokens`` and
``max_model_len`` are the deployment's (``distserve serve`` flags of the same names override them), and an
instance's own ``max_num_seqs``/``max_num_batched_tokens`` override those for it.

The JSON is parsed and validated by pydantic models (``PlacementModel``): unknown keys and wrong types
are refused with the field's path (``decode[0].max_num_seqs``). The frozen dataclasses are what the
code passes around; constructing one runs the same validation.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from distserve.cluster.classes import OBJECTIVES
from distserve.config import ParallelConfig, SchedulerConfig
from distserve.errors import InvalidConfigError
from distserve.slo import SLO

PositiveInt = Annotated[int, Field(ge=1)]
CAPS = ("max_num_seqs", "max_num_batched_tokens")  # an instance's batch caps (``SchedulerConfig`` fields)
DEPLOYMENT_CAPS = ("max_model_len", *CAPS)  # the placement-wide ones


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InstanceModel(_Strict):
    """One instance of the JSON (see ``InstanceSpec``)."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    node: Annotated[int, Field(ge=0)] | None = None
    threads: PositiveInt | None = None
    pool: str | None = None
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None

    @field_validator("pool")
    @classmethod
    def _known_pool(cls, pool: str | None) -> str | None:
        if pool is not None and pool not in OBJECTIVES:
            raise ValueError(f"must be null or one of {', '.join(OBJECTIVES)}, got {pool!r:.80}")
        return pool


class SLOModel(_Strict):
    ttft_s: float
    tpot_s: float
    attainment: float = SLO.attainment


class PlacementModel(_Strict):
    """The Placement JSON (see ``Placement``)."""

    prefill: list[InstanceModel] = []
    decode: list[InstanceModel] = []
    colocated: list[InstanceModel] = []
    predicted: dict[str, Any] | None = None
    slo: SLOModel | None = None
    max_model_len: PositiveInt | None = None
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None

    @model_validator(mode="after")
    def _layout(self) -> PlacementModel:
        disagg = bool(self.prefill or self.decode)
        if disagg and not (self.prefill and self.decode):
            raise ValueError("a disaggregated placement needs at least one prefill and one decode instance")
        if disagg and self.colocated:
            raise ValueError("a placement is either disaggregated (prefill/decode) or colocated, not both")
        if not disagg and not self.colocated:
            raise ValueError("a placement needs prefill+decode instances or colocated instances")
        return self


def _path(loc: tuple[Any, ...]) -> str:
    """``("decode", 0, "pool")`` as ``decode[0].pool``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validated(model: type[BaseModel], data: Any, what: str) -> Any:
    """``data`` validated as ``model``; the first error as an ``InvalidConfigError`` naming the field's path
    (``param``: the field's own name)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        path = _path(loc)
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        param = next((p for p in reversed(loc) if isinstance(p, str)), None)
        raise InvalidConfigError(f"{what} {path}: {message}" if path else f"{what}: {message}", param) from None


@dataclass(frozen=True)
class InstanceSpec:
    """One instance: its parallelism, optionally the node (index) its workers must use, and
    optionally the torch threads each of its workers computes with (CPU; the planner writes the
    thread count its profile was measured with; ``serve --threads`` overrides it; default 1).

    Decode instances may also name the class ``pool`` they serve (an objective: ``latency``,
    ``throughput``, ``default``; None: shared, any class). Any instance may cap its batch:
    ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens per step (None: the deployment's
    ``SchedulerConfig``)."""

    tp: int = 1
    pp: int = 1
    node: int | None = None
    threads: int | None = None
    pool: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        _validated(InstanceModel, asdict(self), "instance")

    def scheduler_config(self, base: SchedulerConfig) -> SchedulerConfig:
        """``base`` with this instance's batch caps, where it has them."""
        caps = {k: getattr(self, k) for k in CAPS if getattr(self, k) is not None}
        return replace(base, **caps) if caps else base

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: ``tp`` and ``pp`` always, the optional keys only when set."""
        return {k: v for k, v in asdict(self).items() if k in ("tp", "pp") or v is not None}

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, pp=self.pp)

    @property
    def num_workers(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class Placement:
    """Prefill and decode instances (disaggregated), or colocated instances (the baseline), and the
    deployment's batch caps (None: ``SchedulerConfig``'s defaults; see ``scheduler_config``)."""

    prefill: tuple[InstanceSpec, ...] = ()
    decode: tuple[InstanceSpec, ...] = ()
    colocated: tuple[InstanceSpec, ...] = ()
    predicted: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # The SLO the deployment is planned for: ``serve`` keeps colocated steps within its TPOT (the
    # "slo" step budget) unless --tpot-slo says otherwise.
    slo: SLO | None = field(default=None, compare=False, hash=False)
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "decode", tuple(self.decode))
        object.__setattr__(self, "colocated", tuple(self.colocated))
        _validated(PlacementModel, self._model_dict(), "placement")
        if any(s.pool is not None for s in self.prefill + self.colocated):
            raise InvalidConfigError("only decode instances belong to a class pool", "pool")

    def _model_dict(self) -> dict[str, Any]:
        """What ``PlacementModel`` validates (instances were validated when they were built)."""
        return {"prefill": [InstanceModel.model_construct() for _ in self.prefill],
                "decode": [InstanceModel.model_construct() for _ in self.decode],
                "colocated": [InstanceModel.model_construct() for _ in self.colocated],
                **{k: getattr(self, k) for k in DEPLOYMENT_CAPS}}

    def scheduler_config(self, base: SchedulerConfig) -> SchedulerConfig:
        """``base`` with the placement's deployment-wide caps (``max_model_len``, ``max_num_seqs``,
        ``max_num_batched_tokens``) where it has them; ``InstanceSpec.scheduler_config`` then applies an
        instance's own."""
        caps = {k: getattr(self, k) for k in DEPLOYMENT_CAPS if getattr(self, k) is not None}
        return replace(base, **caps) if caps else base

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

        return replace(self, prefill=each(self.prefill), decode=each(self.decode), colocated=each(self.colocated))

    def with_caps(self, **caps: int | None) -> "Placement":
        """The placement with these deployment-wide caps (``max_model_len``, ``max_num_seqs``,
        ``max_num_batched_tokens``) where they are not None (``serve`` flags override the JSON's)."""
        unknown = set(caps) - set(DEPLOYMENT_CAPS)
        if unknown:
            raise InvalidConfigError(f"unknown placement caps {sorted(unknown)}; expected some of {', '.join(DEPLOYMENT_CAPS)}")
        given = {k: v for k, v in caps.items() if v is not None}
        return replace(self, **given) if given else self

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prefill": [i.to_dict() for i in self.prefill],
            "decode": [i.to_dict() for i in self.decode],
            "colocated": [i.to_dict() for i in self.colocated],
        }
        out.update({k: getattr(self, k) for k in DEPLOYMENT_CAPS if getattr(self, k) is not None})
        if self.predicted:
            out["predicted"] = self.predicted
        if self.slo is not None:
            out["slo"] = asdict(self.slo)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "Placement":
        """Parse the JSON object; an unknown key or a bad value is an ``InvalidConfigError`` naming its path."""
        if not isinstance(data, dict):
            raise InvalidConfigError("placement JSON must be an object with 'prefill'/'decode' or 'colocated' lists")
        model: PlacementModel = _validated(PlacementModel, data, "placement")

        def specs(items: list[InstanceModel]) -> tuple[InstanceSpec, ...]:
            return tuple(InstanceSpec(**item.model_dump()) for item in items)

        try:
            slo = SLO(**model.slo.model_dump()) if model.slo is not None else None
        except InvalidConfigError as exc:
            raise InvalidConfigError(f"placement slo: {exc}", "slo") from None
        return cls(specs(model.prefill), specs(model.decode), specs(model.colocated), dict(model.predicted or {}), slo,
                   **{k: getattr(model, k) for k in DEPLOYMENT_CAPS})

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
