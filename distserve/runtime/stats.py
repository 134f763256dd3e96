"""What a runtime reports about its instances: the shape of ``EngineClient.stats()``.

``EngineClient.stats()`` returns a ``ClientStats`` dict::

    {
        "instances": [
            {"instance": "prefill-0", "phase": "prefill",      # phase: prefill | decode | colocated
             "num_requests_waiting": 0, "num_requests_running": 1, "kv_cache_usage_perc": 0.02,
             "prefill_tokens_computed_total": 4096,            # cumulative counters of the instance (optional, each)
             "prefix_cache_query_tokens_total": 8192, "prefix_cache_hit_tokens_total": 4096, "num_preemptions_total": 0,
             "iteration_tokens": {"bounds": [1.0, 2.0, ...], "counts": [3, 0, ...], "sum": 812.0},  # histograms (optional):
             "step_seconds_histogram": {"bounds": [...], "counts": [...], "sum": 1.7},           # engine.step_stats
             "cache_config": {"block_size": 16, "num_gpu_blocks": 2048, "enable_prefix_caching": True},  # (optional)
             "num_requests_migrating": 0},                     # decode instances: KV arriving (optional)
            {"instance": "decode-0", "phase": "decode", ...},
        ],
        "num_requests_awaiting_migration": 0,                  # prefilled, waiting for a decode instance (optional)
        "kv_migration_bytes_total": 123456,                    # cumulative since start
        "kv_migration_blocks_skipped_total": 16,               # cumulative: prefix blocks the receiver held
        "kv_migration_failures_total": 1,                      # cumulative: failed or timed-out migrations (optional)
        "kv_migration_timeouts_total": 1,                      # cumulative: those that timed out (optional)
        "kv_migration_seconds": [0.0012, 0.0009],              # durations of migrations since the previous call
        "instance_restarts_total": 0,                          # cumulative: instances replaced after a death (optional)
        "requests_rerun_total": 0,                             # cumulative: requests re-run after their instance died (optional)
        "requests_failed_poison_total": 0,                     # cumulative: requests failed after a second crash (optional)
        "failed_steps_total": 0,                               # cumulative: engine steps that failed and were recovered from (optional)
        "prefill_tokens_computed_total": 4096,                 # cumulative: prompt tokens computed, all instances (optional)
        "prefix_cache_hit_tokens_total": 7680,                 # cumulative: prompt tokens taken from the prefix cache (optional)
        "admission": {                                         # the admission queue(s) (optional): AdmissionQueue.stats()
            "policy": "fair", "num_queued": 2,
            "tenants": {"acme": {"num_queued": 2, "num_admitted": 9, "num_dispatched": 7, "num_rejected_full": 1,
                                 "num_rejected_rate": 0, "num_expired": 0, "wait_s_total": 0.8}},  # counts cumulative
        },
    }

Each instance's dict may carry its own ``PREFILL_COUNTER_KEYS``; where the top-level totals are
missing, ``normalize_stats`` sums them. Prefill tokens computed are the tokens of prompts (and of
recomputations after a preemption or a failed migration) an instance computed, decodes excluded;
prefix-cache query tokens are the tokens of the sequences its admissions looked up in its prefix
cache, hit tokens those taken from it instead of computed (a decode instance's prompt blocks
shared by prefix-aware migration are ``kv_migration_blocks_skipped_total``).

``kv_cache_usage_perc`` is a fraction in [0, 1] (1 = full), as in vLLM. The top-level migration
figures are exported with ``engine="all", phase="decode"`` (the pulling side); a runtime that
knows which decode instance pulled may instead put the same keys in that instance's dict.
``normalize_stats`` also accepts what ``LLMEngine.stats()`` and ``LocalDisaggEngine.stats()`` return.

``admission`` is ``distserve.cluster.admission.AdmissionQueue.stats()``, from wherever requests
queue: a ``LocalDisaggEngine``'s own queue, the threaded client's queue in front of colocated
engines, or the Ray controller's; a runtime with several queues reports their sum
(``merge_admission_stats``). Its per-tenant figures are exported by ``serving.engine_metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NotRequired, TypedDict, cast

from distserve.engine.step_stats import HistogramCounts

AGGREGATE_INSTANCE = "all"  # the /metrics ``engine`` of a figure a runtime knows only in total


class InstanceStats(TypedDict):
    instance: str
    phase: str
    num_requests_waiting: float
    num_requests_running: float
    kv_cache_usage_perc: float
    kv_migration_bytes_total: NotRequired[float]
    kv_migration_blocks_skipped_total: NotRequired[float]
    kv_migration_failures_total: NotRequired[float]
    kv_migration_timeouts_total: NotRequired[float]
    kv_migration_seconds: NotRequired[list[float]]
    prefill_tokens_computed_total: NotRequired[float]
    prefix_cache_hit_tokens_total: NotRequired[float]
    prefix_cache_query_tokens_total: NotRequired[float]
    num_preemptions_total: NotRequired[float]
    num_requests_migrating: NotRequired[float]
    iteration_tokens: NotRequired[HistogramCounts]
    step_seconds_histogram: NotRequired[HistogramCounts]
    cache_config: NotRequired[dict[str, Any]]


class TenantAdmissionStats(TypedDict):
    """One tenant's admission figures (``cluster.admission.TenantCounters``); all but ``num_queued`` cumulative."""

    num_queued: float
    num_admitted: float
    num_dispatched: float
    num_rejected_full: float
    num_rejected_rate: float
    num_expired: float
    wait_s_total: float


class AdmissionStats(TypedDict):
    policy: str
    num_queued: float
    tenants: dict[str, TenantAdmissionStats]


TENANT_ADMISSION_KEYS = tuple(TenantAdmissionStats.__annotations__)


class ClientStats(TypedDict):
    instances: list[InstanceStats]
    admission: NotRequired[AdmissionStats | None]
    kv_migration_bytes_total: float
    kv_migration_blocks_skipped_total: float
    kv_migration_failures_total: NotRequired[float]
    kv_migration_timeouts_total: NotRequired[float]
    kv_migration_seconds: list[float]
    instance_restarts_total: NotRequired[float]
    requests_rerun_total: NotRequired[float]
    requests_failed_poison_total: NotRequired[float]
    failed_steps_total: NotRequired[float]
    prefill_tokens_computed_total: NotRequired[float]
    prefix_cache_hit_tokens_total: NotRequired[float]
    prefix_cache_query_tokens_total: NotRequired[float]
    num_preemptions_total: NotRequired[float]
    num_requests_awaiting_migration: NotRequired[float]


# Counted per instance; a runtime's total is their sum.
PREFILL_COUNTER_KEYS = (
    "prefill_tokens_computed_total", "prefix_cache_hit_tokens_total", "prefix_cache_query_tokens_total", "num_preemptions_total",
)
# Passed on from an instance's stats as they are, when present.
_INSTANCE_EXTRAS = ("num_requests_migrating", "iteration_tokens", "step_seconds_histogram", "cache_config")


def instance_stats(raw: Mapping[str, Any], instance: str, phase: str) -> InstanceStats:
    out: InstanceStats = {
        "instance": instance,
        "phase": phase,
        "num_requests_waiting": float(raw.get("num_requests_waiting", 0)),
        "num_requests_running": float(raw.get("num_requests_running", 0)),
        "kv_cache_usage_perc": float(raw.get("kv_cache_usage_perc", 0.0)),
    }
    for key in PREFILL_COUNTER_KEYS:
        if key in raw:
            out[key] = float(raw[key])  # type: ignore[literal-required]
    for key in _INSTANCE_EXTRAS:
        if key in raw:
            out[key] = raw[key]  # type: ignore[literal-required]
    return out


def prefill_totals(instances: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The runtime-wide ``PREFILL_COUNTER_KEYS``: the sums over ``instances`` (per-instance stats dicts)."""
    instances = list(instances)
    return {key: float(sum(i.get(key, 0) for i in instances)) for key in PREFILL_COUNTER_KEYS}


def merge_admission_stats(parts: Iterable[Mapping[str, Any]]) -> AdmissionStats | None:
    """The sum of several admission queues' ``stats()`` (None: no queue); tenants' figures added key by key."""
    parts = [p for p in parts if isinstance(p, Mapping)]
    if not parts:
        return None
    tenants: dict[str, TenantAdmissionStats] = {}
    for part in parts:
        for name, figures in dict(part.get("tenants") or {}).items():
            into = tenants.setdefault(str(name), cast(TenantAdmissionStats, {k: 0.0 for k in TENANT_ADMISSION_KEYS}))
            for key in TENANT_ADMISSION_KEYS:
                into[key] += float(figures.get(key, 0))  # type: ignore[literal-required]
    policies = sorted({str(p.get("policy", "")) for p in parts})
    return {"policy": ",".join(policies), "num_queued": float(sum(p.get("num_queued", 0) for p in parts)), "tenants": tenants}


def normalize_stats(raw: Mapping[str, Any]) -> ClientStats:
    """The ``ClientStats`` shape from itself, ``LocalDisaggEngine.stats()`` or ``LLMEngine.stats()``."""
    instances: list[InstanceStats]
    if "instances" in raw:
        instances = [cast(InstanceStats, dict(i)) for i in raw["instances"]]
    elif isinstance(raw.get("prefill"), Mapping) or isinstance(raw.get("decode"), Mapping):
        instances = [
            instance_stats(s, name, phase)
            for phase in ("prefill", "decode")
            for name, s in dict(raw.get(phase) or {}).items()
        ]
    elif "num_requests_waiting" in raw:
        instances = [instance_stats(raw, "colocated-0", "colocated")]
    else:
        instances = []
    seconds = raw.get("kv_migration_seconds", [])
    out: ClientStats = {
        "instances": instances,
        "kv_migration_bytes_total": float(raw.get("kv_migration_bytes_total", 0)),
        "kv_migration_blocks_skipped_total": float(raw.get("kv_migration_blocks_skipped_total", 0)),
        "kv_migration_failures_total": float(raw.get("kv_migration_failures_total", 0)),
        "kv_migration_timeouts_total": float(raw.get("kv_migration_timeouts_total", 0)),
        "kv_migration_seconds": [float(s) for s in seconds] if isinstance(seconds, list) else [],
        "instance_restarts_total": float(raw.get("instance_restarts_total", 0)),
        "requests_rerun_total": float(raw.get("requests_rerun_total", 0)),
        "requests_failed_poison_total": float(raw.get("requests_failed_poison_total", 0)),
        "failed_steps_total": float(raw.get("failed_steps_total", 0)),
    }
    if "num_requests_awaiting_migration" in raw:
        out["num_requests_awaiting_migration"] = float(raw["num_requests_awaiting_migration"])
    for key, total in prefill_totals(instances).items():
        out[key] = float(raw.get(key, total))  # type: ignore[literal-required]
    admission = raw.get("admission")
    out["admission"] = merge_admission_stats([admission]) if isinstance(admission, Mapping) else None
    return out
