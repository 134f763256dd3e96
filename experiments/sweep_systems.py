"""What an SLO sweep (``slo_sweep.py``) measures and how it scores: the systems, parsed from the
command line (a simulated deployment: placement, scheduler settings, latency model; or an
OpenAI-compatible endpoint), and the re-scoring of one run's requests against scaled SLOs.

Re-scoring is exact only while the run itself does not depend on the SLO: a request's timestamps
are then the same whatever SLO it is judged by. A simulated target with the "slo" step budget
chunks prompts to keep steps within the TPOT SLO, so its runs must be repeated per SLO
(``SimTarget.slo_dependent``); an endpoint is assumed not to know the client's SLO.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import harness
from distserve.config import SchedulerConfig
from distserve.errors import DistServeError, InvalidConfigError
from distserve.placement import Placement
from distserve.slo import SLO, SLOSpec, TimedRequest, attainment, slo_for_objective
from simulator import DISTSERVE_A100_PROFILE
from simulator.latency import LatencyModel, get_latency_model
from simulator.simulation import SimConfig

MODES = ("joint", "separate")
PHASES = {"colocated": "scheduler", "prefill": "prefill_scheduler", "decode": "decode_scheduler"}
PLACEMENT_FLAGS = {"--colocated", "--prefill", "--decode", "--prefill-tp", "--prefill-pp", "--decode-tp", "--decode-pp",
                   "--placement", "--router"}


# ---- targets ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimTarget:
    name: str
    spec: str  # as given
    placement: Placement
    config: SimConfig

    @property
    def num_gpus(self) -> int:
        return self.placement.num_workers

    @property
    def slo_dependent(self) -> bool:
        """Whether the schedulers read the TPOT SLO (the "slo" step budget): re-scoring is then not exact."""
        return any(getattr(self.config, f).step_budget == "slo" for f in PHASES.values())

    def config_at(self, scale: float) -> SimConfig:
        """The config for SLOs scaled by ``scale``: the "slo" step budgets keep the scaled TPOT."""
        return replace(self.config, **{f: replace(c, tpot_slo_s=c.tpot_slo_s * scale) for f in PHASES.values()
                                       if (c := getattr(self.config, f)).step_budget == "slo"})


@dataclass(frozen=True)
class EndpointTarget:
    name: str
    url: str
    num_gpus: int


def name_and_spec(text: str, flag: str) -> tuple[str, str]:
    name, sep, spec = text.partition("=")
    if not sep or not name.strip() or not spec.strip():
        raise InvalidConfigError(f"{flag} {text!r}: expected NAME=SPEC", flag.lstrip("-"))
    return name.strip(), spec.strip()


def _coerce(field_type: str, text: str) -> Any:
    if "None" in field_type and text.lower() in ("none", "null"):
        return None
    if field_type.startswith("bool"):
        if text.lower() not in ("true", "false", "1", "0"):
            raise InvalidConfigError(f"expected true or false, got {text!r}")
        return text.lower() in ("true", "1")
    for kind, convert in (("int", int), ("float", float)):
        if field_type.startswith(kind):
            try:
                return convert(text)
            except ValueError:
                raise InvalidConfigError(f"expected a number ({kind}), got {text!r}") from None
    return text


def with_overrides(config: SimConfig, overrides: list[str]) -> SimConfig:
    """``config`` with ``[PHASE.]FIELD=VALUE`` set on its SchedulerConfigs (validated by SchedulerConfig)."""
    types = {f.name: str(f.type) for f in fields(SchedulerConfig)}
    for item in overrides:
        key, _, value = item.partition("=")
        phase, _, field_name = key.rpartition(".")
        if phase and phase not in PHASES or field_name not in types:
            raise InvalidConfigError(f"scheduler setting {item!r}: expected [PHASE.]FIELD=VALUE with PHASE in {sorted(PHASES)} "
                                     f"and FIELD one of {sorted(types)}", "scheduler")
        try:
            parsed = _coerce(types[field_name], value)
            for attr in [PHASES[phase]] if phase else PHASES.values():
                config = replace(config, **{attr: replace(getattr(config, attr), **{field_name: parsed})})
        except DistServeError as exc:
            raise InvalidConfigError(f"scheduler setting {item!r}: {exc}", "scheduler") from exc
    return config


def placement_of_flags(tokens: list[str]) -> tuple[Placement, str | None]:
    """``distserve simulate``'s placement flags, parsed by its own parser: (placement, --router)."""
    from distserve.cli.args import build_parser, check_placement_args, placement_from_args

    unknown = [t for t in tokens if t.startswith("-") and t.split("=")[0] not in PLACEMENT_FLAGS]
    if unknown:
        raise InvalidConfigError(f"not a placement flag: {unknown[0]} (use {', '.join(sorted(PLACEMENT_FLAGS))})")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = build_parser().parse_args(["simulate", "--model", "-", "--ttft", "1", "--tpot", "1", *tokens])
    except SystemExit:
        raise InvalidConfigError(err.getvalue().strip().splitlines()[-1].split("error: ", 1)[-1]) from None
    check_placement_args(ns)
    return placement_from_args(ns), ns.router


def parse_sim(text: str, base: SimConfig, plan: Callable[[str], Placement]) -> SimTarget:
    """One ``--sim NAME=SPEC``; ``plan(kind)`` gives the planner's placement of a kind."""
    name, spec = name_and_spec(text, "--sim")
    try:
        tokens = shlex.split(spec)
        overrides = [t for t in tokens if "=" in t and not t.startswith("-")]
        rest = [t for t in tokens if t not in overrides]
        router = None
        if len(rest) == 1 and rest[0].startswith("plan:"):
            placement = plan(rest[0].removeprefix("plan:"))
        elif len(rest) == 1 and not rest[0].startswith("-"):
            placement = Placement.load(rest[0])
        else:
            placement, router = placement_of_flags(rest)
        config = with_overrides(base if router is None else replace(base, router=router), overrides)
    except DistServeError as exc:
        raise InvalidConfigError(f"--sim {text!r}: {exc}", "sim") from exc
    return SimTarget(name, spec, placement, config)


def latency_model(args: argparse.Namespace) -> tuple[LatencyModel, str | None]:
    """The step-time model and the profile it came from (None: roofline)."""
    if args.profile == "roofline":
        return get_latency_model(args.model, hardware=args.hardware), None
    if args.profile == "auto":
        if args.hardware in (None, "a100-80g"):
            with contextlib.suppress(InvalidConfigError):  # DistServe's file lacks this model
                return get_latency_model(args.model, hardware=args.hardware, profile=DISTSERVE_A100_PROFILE), str(DISTSERVE_A100_PROFILE)
        return get_latency_model(args.model, hardware=args.hardware), None
    return get_latency_model(args.model, hardware=args.hardware, profile=args.profile), args.profile


def planner(args: argparse.Namespace, profile: str | None, base: SimConfig) -> Callable[[str], Placement]:
    """``plan(kind)``: the planner's best ``disagg`` or ``colocated`` placement (one search, on first use)."""
    found: dict[str, Any] = {}

    def plan(kind: str) -> Placement:
        if kind not in ("disagg", "colocated"):
            raise InvalidConfigError(f"plan:{kind}: expected plan:disagg or plan:colocated")
        if not found:
            from distserve.planner.report import PlanArgs, run_plan

            a = PlanArgs(model=args.model, gpu=args.hardware or "a100-80g", nodes=1, gpus_per_node=args.plan_gpus,
                         workload=args.workload, ttft_s=args.ttft_slo, tpot_s=args.tpot_slo, attainment=args.attainment,
                         attainment_mode=args.plan_mode, profile=profile, num_requests=args.num_requests, seed=args.seed,
                         sim_config=base)
            found["result"] = run_plan(a, show_progress=False)[1]
        options = [o for o in found["result"].options if (o.name == "colocated") == (kind == "colocated")]
        if not options:
            raise InvalidConfigError(f"plan:{kind}: the planner found no {kind} plan meeting the SLO on {args.plan_gpus} GPUs")
        best = max(options, key=lambda o: o.per_gpu)
        print(f"planner's best {kind}: {harness.layout(best.placement)} ({best.per_gpu:.3g} req/s per GPU predicted)", flush=True)
        return best.placement

    return plan


# ---- scoring ---------------------------------------------------------------------------------
def scored(records: list[TimedRequest], slo: SLO) -> dict[str, float]:
    """joint/ttft/tpot attainment and ``separate`` (the weaker of ttft and tpot)."""
    att = attainment(records, SLOSpec(slo))
    return {**att, "separate": min(att["ttft"], att["tpot"])}


def scaled(slo: SLO, scale: float) -> SLO:
    return SLO(slo.ttft_s * scale, slo.tpot_s * scale, slo.attainment)


def min_scale(records: list[TimedRequest], slo: SLO) -> dict[str, float]:
    """Per mode, the smallest SLO scale at which attainment reaches ``slo.attainment`` (inf: none):
    each request meets the SLO scaled by s iff s >= its own need, so it is a quantile of the needs."""
    k = math.ceil(slo.attainment * len(records) - 1e-9)  # requests that must meet it
    needs = []  # (TTFT, TPOT) scale each request needs
    for r in records:
        target = slo_for_objective(slo, r.objective)
        if not r.completed or r.ttft_s is None:
            needs.append((math.inf, math.inf))
        else:
            needs.append((r.ttft_s / target.ttft_s, (r.tpot_s or 0.0) / target.tpot_s))

    def kth(values: Any) -> float:
        return float(sorted(values)[k - 1])

    return {"joint": kth(max(n) for n in needs), "separate": max(kth(t for t, _ in needs), kth(p for _, p in needs))}
