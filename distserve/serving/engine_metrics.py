"""The engine's figures as metric families (bare names, see ``serving.metrics_exposition``): what a
``ClientStats`` snapshot (``EngineClient.stats()``, whichever runtime) says about its instances,
KV migrations, recoveries and admission queue.

Per-instance series are labelled ``engine`` (the placement's instance id: ``prefill-0``,
``decode-1``, ``colocated-0``; bounded by the placement) and ``phase`` (prefill | decode |
colocated). A cumulative figure that instances report is exported per instance only, so that
``sum()`` over ``engine`` is the runtime's total; one that only the runtime knows in total is
exported with ``engine="all"`` (KV migration figures: ``phase="decode"``, the pulling side).

Per-tenant admission series (label ``tenant``, mapped to a bounded set by the server's
``tenant_label``) come from ``ClientStats["admission"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from distserve.runtime.stats import AGGREGATE_INSTANCE, AdmissionStats, ClientStats, InstanceStats
from distserve.serving.metrics_exposition import ENGINE_LABEL

_LABELS = [ENGINE_LABEL, "phase"]

# (stats key, metric name, help) of the per-instance gauges.
_GAUGES = (
    ("num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled on the instance."),
    ("num_requests_running", "num_requests_running", "Requests in the instance's running batch."),
    ("kv_cache_usage_perc", "kv_cache_usage_perc", "Fraction of the instance's KV-cache blocks in use (1 = full)."),
    ("kv_cache_usage_perc", "gpu_cache_usage_perc", "kv_cache_usage_perc under vLLM's name before 0.10, which its example dashboard plots."),
    ("num_requests_migrating", "num_requests_migrating",
     "Requests whose KV is on its way to this decode instance (reserved, transfer not complete)."),
)
# (stats key, metric name, help) of the per-instance counters.
_INSTANCE_COUNTERS = (
    ("prefill_tokens_computed_total", "prefill_tokens_computed",
     "Prompt tokens computed by prefills (recomputations after a preemption included), decodes excluded."),
    ("prefix_cache_query_tokens_total", "prefix_cache_queries",
     "Tokens of the sequences the instance's admissions looked up in its prefix cache (vLLM's prefix_cache_queries)."),
    ("prefix_cache_hit_tokens_total", "prefix_cache_hits",
     "Of those, tokens taken from the prefix cache instead of being computed (vLLM's prefix_cache_hits)."),
    ("num_preemptions_total", "num_preemptions", "Requests preempted (their KV freed, recomputed later) when the instance ran out of blocks."),
)
# (stats key, metric name, help) of the per-instance step histograms (``engine.step_stats``).
_HISTOGRAMS = (
    ("iteration_tokens", "iteration_tokens_total", "Tokens computed per engine step (prefill and decode)."),
    ("step_seconds_histogram", "engine_step_seconds", "Duration of one engine step of the instance."),
)
_MIGRATION_COUNTERS = (
    ("kv_migration_bytes", "Bytes of KV cache moved from prefill to decode instances."),
    ("kv_migration_blocks_skipped", "KV blocks not moved because the receiver already held the prefix."),
    ("kv_migration_failures", "KV migrations that failed or timed out; the request was prefilled again."),
    ("kv_migration_timeouts", "KV migrations that failed because they did not complete within kv_transfer_timeout_s."),
)
_RUNTIME_COUNTERS = (
    ("instance_restarts", "Instances the controller restarted after their actor or a worker died."),
    ("requests_rerun", "Requests re-run from prompt + tokens so far because their instance died."),
    ("requests_failed_poison", "Requests failed because the engine failed a second time while computing them."),
    ("failed_steps", "Engine steps that failed and were recovered from (in-process engines)."),
)
# (stats key, metric name, help); all but the first counters. Tenants' figures from ``AdmissionQueue.stats()``.
_ADMISSION_QUEUED = ("num_queued", "tenant_admission_queued", "Requests waiting in the admission queue for an instance, by tenant.")
_ADMISSION_COUNTERS = (
    ("num_dispatched", "tenant_admission_dispatched", "Requests the admission queue released to an instance, by tenant."),
    ("num_expired", "tenant_admission_expired",
     "Requests that waited in the admission queue past their timeout, by tenant (also in tenant_requests_rejected{reason=\"timeout\"})."),
    ("wait_s_total", "tenant_admission_wait_seconds", "Seconds the dispatched requests waited in the admission queue, by tenant."),
)
_ADMISSION_REFUSALS = (("num_rejected_full", "queue_bound"), ("num_rejected_rate", "token_rate"))


def _labels(inst: InstanceStats) -> list[str]:
    return [inst["instance"], inst["phase"]]


def instance_families(snap: ClientStats | None) -> Iterator[Metric]:
    """The per-instance gauges, counters, step histograms and cache configurations of ``snap``."""
    instances = snap["instances"] if snap else []
    for key, name, doc in _GAUGES:
        gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
        for inst in instances:
            if key in inst:
                gauge.add_metric(_labels(inst), float(inst[key]))  # type: ignore[literal-required]
        yield gauge
    for key, name, doc in _INSTANCE_COUNTERS:
        yield _counter(name, doc, key, snap, AGGREGATE_INSTANCE)
    for key, name, doc in _HISTOGRAMS:
        histogram = HistogramMetricFamily(name, doc, labels=_LABELS)
        for inst in instances:
            if key in inst:
                counts = inst[key]  # type: ignore[literal-required]
                histogram.add_metric(_labels(inst), _cumulative(counts["bounds"], counts["counts"]), float(counts["sum"]))
        yield histogram
    yield _cache_config_info(instances)


def _counter(name: str, doc: str, key: str, snap: ClientStats | None, total_phase: str) -> Metric:
    """Counter ``key`` per instance where instances report it, else the runtime's total as
    ``engine="all"``, ``phase=total_phase`` (never both: ``sum()`` over ``engine`` is the total)."""
    counter = CounterMetricFamily(name, doc, labels=_LABELS)
    reported = [inst for inst in snap["instances"] if key in inst] if snap else []
    for inst in reported:
        counter.add_metric(_labels(inst), float(inst[key]))  # type: ignore[literal-required]
    if snap is not None and not reported and key in snap:
        counter.add_metric([AGGREGATE_INSTANCE, total_phase], float(snap[key]))  # type: ignore[literal-required]
    return counter


def _cumulative(bounds: list[float], counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last above every bound) as Prometheus's cumulative ``le`` buckets."""
    out, total = [], 0.0
    for bound, count in zip([*bounds, float("inf")], counts):
        total += count
        out.append((floatToGoString(bound), total))
    return out


def _cache_config_info(instances: Iterable[InstanceStats]) -> Metric:
    """vLLM's ``cache_config_info``: 1, labelled with each instance's cache configuration."""
    configs = [(inst, inst["cache_config"]) for inst in instances if "cache_config" in inst]
    keys = sorted({k for _, config in configs for k in config})
    info = GaugeMetricFamily("cache_config_info", "The instance's KV-cache configuration, as labels (value 1).", labels=[*_LABELS, *keys])
    for inst, config in configs:
        info.add_metric([*_labels(inst), *(str(config.get(k, "")) for k in keys)], 1.0)
    return info


def runtime_families(snap: ClientStats | None) -> Iterator[Metric]:
    """The KV migration and recovery figures of ``snap`` and its migration queue."""
    for key, doc in _MIGRATION_COUNTERS:
        yield _counter(key, doc, f"{key}_total", snap, "decode")
    for key, doc in _RUNTIME_COUNTERS:
        counter = CounterMetricFamily(key, doc)
        if snap is not None:
            counter.add_metric([], float(snap.get(f"{key}_total", 0.0)))  # type: ignore[misc]
        yield counter
    queued = GaugeMetricFamily(
        "num_requests_awaiting_migration", "Requests prefilled whose KV waits for a decode instance with room (the migration queue).")
    if snap is not None:
        queued.add_metric([], float(snap.get("num_requests_awaiting_migration", 0.0)))
    yield queued


def admission_families(stats: AdmissionStats | None, tenant_label: Callable[[str], str], tenant_labels: Iterable[str]) -> Iterator[Metric]:
    """Per-tenant admission figures (tenants mapped by ``tenant_label``; each of ``tenant_labels`` at 0 if absent)."""
    by_label: dict[str, dict[str, float]] = {t: {} for t in sorted(tenant_labels)}
    for tenant, figures in (stats["tenants"] if stats else {}).items():
        into = by_label.setdefault(tenant_label(tenant), {})
        for key, value in figures.items():
            into[key] = into.get(key, 0.0) + float(value)
    key, name, doc = _ADMISSION_QUEUED
    gauge = GaugeMetricFamily(name, doc, labels=["tenant"])
    for tenant, figures in by_label.items():
        gauge.add_metric([tenant], figures.get(key, 0.0))
    yield gauge
    for key, name, doc in _ADMISSION_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["tenant"])
        for tenant, figures in by_label.items():
            counter.add_metric([tenant], figures.get(key, 0.0))
        yield counter
    refused = CounterMetricFamily(
        "tenant_admission_refused", "Requests the admission queue refused (HTTP 429), by tenant and the limit reached "
        "(queue_bound: its or the whole queue's bound, token_rate: its tokens per minute); also in "
        "tenant_requests_rejected{reason=\"queue_full\"}.", labels=["tenant", "reason"])
    for tenant, figures in by_label.items():
        for key, reason in _ADMISSION_REFUSALS:
            refused.add_metric([tenant, reason], figures.get(key, 0.0))
    yield refused


class EngineCollector(Collector):
    """The families of the latest ``ClientStats`` snapshot (None until the first one)."""

    def __init__(self, tenant_label: Callable[[str], str], tenant_labels: Iterable[str]) -> None:
        self.snapshot: ClientStats | None = None
        self.tenant_label = tenant_label
        self.tenant_labels = sorted(tenant_labels)  # each series exists from the start, at 0

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        yield from instance_families(snap)
        yield from runtime_families(snap)
        yield from admission_families(snap.get("admission") if snap else None, self.tenant_label, self.tenant_labels)


__all__ = ["EngineCollector", "admission_families", "instance_families", "runtime_families"]
