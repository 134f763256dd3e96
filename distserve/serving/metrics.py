"""Prometheus metrics of the HTTP layer: request latency histograms, per-tenant series and
per-instance engine gauges.

Names follow vLLM's with the prefix ``distserve:``. Each ``ServingMetrics`` owns its own
``CollectorRegistry`` so several apps (tests) can live in one process.

Per-tenant series (label ``tenant``): requests in flight at the server, ``queued`` (submitted, no
token yet) and ``running`` (streaming), ``admitted`` and ``rejected`` counts (by ``reason``) and
a TTFT histogram — for the OpenAI routes and the semantic-variable calls alike. The label set is
bounded: the tenants of the key file plus ``anonymous``; any other name is counted as ``other``,
so no client input can grow the series.

Per-tenant admission series (``tenant_admission_*``), from the engine's admission queue
(``ClientStats["admission"]``, whichever runtime holds it): requests ``queued`` there now,
``dispatched`` to an instance, ``expired`` (waited past their timeout), ``refused`` by a bound
(``reason="queue_bound"``) or a token rate (``"token_rate"``), and the seconds the dispatched ones
waited (``wait_seconds``: divided by ``dispatched``, the mean wait). Expired and refused requests
are also in ``tenant_requests_rejected`` (reasons ``timeout`` and ``queue_full``, as the HTTP
layer saw them, which also counts the server's own in-flight bound): those are a breakdown, not
more requests.

Per-request latency breakdown (DistServe's Figure 10; ``engine.request_metrics.LatencyBreakdown``,
from the engine's own timestamps, so it is there for every runtime): ``request_queue_time_seconds``
(arrival → prefill start), ``request_prefill_time_seconds`` (→ first token),
``request_migration_queue_time_seconds`` and ``request_migration_time_seconds`` (waiting for, and
doing, the KV migration: disaggregated runtimes only), ``request_decode_time_seconds`` (→ finish) and
``request_inference_time_seconds`` (prefill start → finish), named as vLLM's. With a
``RequestLog`` each finished request is also written there as one JSON line.

The engine figures it exports come from ``EngineClient.stats()``, whose shape is
``distserve.runtime.stats.ClientStats``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from distserve.engine.outputs import RequestOutput
from distserve.runtime.stats import AGGREGATE_INSTANCE, AdmissionStats, ClientStats, normalize_stats
from distserve.cluster.classes import DEFAULT, OBJECTIVES
from distserve.cluster.tenants import ANONYMOUS
from distserve.serving.api_keys import OTHER_TENANT
from distserve.serving.request_log import RequestLog
from distserve.slo import SLO, slo_for_objective, tpot

PREFIX = "distserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
MIGRATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# (LatencyBreakdown field, metric name part, help, buckets) of the per-request breakdown histograms.
_BREAKDOWN = (
    ("queue_s", "queue", "Seconds from a request's arrival to the start of its prefill (admission queue and instance queue).", TTFT_BUCKETS),
    ("prefill_s", "prefill", "Seconds from the start of a request's prefill to its first token.", TTFT_BUCKETS),
    ("migration_queue_s", "migration_queue", "Seconds from a request's first token to the start of its KV migration "
     "(waiting for a decode instance with room; disaggregated only).", TTFT_BUCKETS),
    ("migration_s", "migration", "Seconds a request's KV migration took, as its runtime saw it (disaggregated only).", MIGRATION_BUCKETS),
    ("decode_s", "decode", "Seconds from the end of a request's migration (colocated: its first token) to its finish.", E2E_BUCKETS),
    ("inference_s", "inference", "Seconds from the start of a request's prefill to its finish.", E2E_BUCKETS),
)
# Why a request was refused (label ``reason``): by HTTP status, and the session-count limits.
REJECT_REASONS = ("queue_full", "timeout", "invalid", "unavailable", "error", "session_limit")


def rejection_reason(status_code: int) -> str:
    """The ``reason`` label of a request refused with ``status_code``."""
    return {429: "queue_full", 408: "timeout", 503: "unavailable"}.get(status_code, "error" if status_code >= 500 else "invalid")


_GAUGES = (
    ("num_requests_waiting", "Requests waiting to be scheduled on the instance."),
    ("num_requests_running", "Requests in the instance's running batch."),
    ("kv_cache_usage_perc", "Fraction of the instance's KV-cache blocks in use (1 = full)."),
)
_MIGRATION_COUNTERS = (
    ("kv_migration_bytes", "Bytes of KV cache moved from prefill to decode instances."),
    ("kv_migration_blocks_skipped", "KV blocks not moved because the receiver already held the prefix."),
    ("kv_migration_failures", "KV migrations that failed or timed out; the request was prefilled again."),
    ("kv_migration_timeouts", "KV migrations that failed because they did not complete within kv_transfer_timeout_s."),
)
_PREFILL_COUNTERS = (
    ("prefill_tokens_computed", "Prompt tokens computed by prefills (recomputations after a preemption included), decodes excluded."),
    ("prefix_cache_hit_tokens", "Prompt tokens taken from the instance's prefix cache instead of being computed."),
)
# Per-instance counters, each table with the phase label of its aggregate (instance="all") sample:
# migrations are counted by the pulling side, prefill tokens on every instance.
_INSTANCE_COUNTERS = ((_MIGRATION_COUNTERS, "decode"), (_PREFILL_COUNTERS, AGGREGATE_INSTANCE))
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


class _EngineCollector(Collector):
    """Exports the latest ``ClientStats`` snapshot: per-instance gauges, cumulative migration and
    prefill-token counters, per-tenant admission figures (tenants mapped by ``tenant_label``)."""

    def __init__(self, tenant_label: Callable[[str], str], tenant_labels: Iterable[str]) -> None:
        self.snapshot: ClientStats | None = None
        self.tenant_label = tenant_label
        self.tenant_labels = sorted(tenant_labels)  # each series exists from the start, at 0

    def collect(self) -> Iterator[Metric]:
        labels = ["instance", "phase"]
        snap = self.snapshot
        for key, doc in _GAUGES:
            family = GaugeMetricFamily(PREFIX + key, doc, labels=labels)
            for inst in snap["instances"] if snap else []:
                family.add_metric([inst["instance"], inst["phase"]], float(inst.get(key, 0.0)))  # type: ignore[arg-type]
            yield family
        for table, aggregate_phase in _INSTANCE_COUNTERS:
            for key, doc in table:
                family_c = CounterMetricFamily(PREFIX + key, doc, labels=labels)
                if snap is not None:
                    family_c.add_metric([AGGREGATE_INSTANCE, aggregate_phase], float(snap.get(f"{key}_total", 0.0)))  # type: ignore[misc]
                    for inst in snap["instances"]:
                        if f"{key}_total" in inst:
                            family_c.add_metric([inst["instance"], inst["phase"]], float(inst[f"{key}_total"]))  # type: ignore[literal-required]
                yield family_c
        for key, doc in _RUNTIME_COUNTERS:
            family_r = CounterMetricFamily(PREFIX + key, doc)
            if snap is not None:
                family_r.add_metric([], float(snap.get(f"{key}_total", 0.0)))  # type: ignore[misc]
            yield family_r
        yield from self._admission(snap.get("admission") if snap else None)

    def _admission(self, stats: AdmissionStats | None) -> Iterator[Metric]:
        by_label: dict[str, dict[str, float]] = {t: {} for t in self.tenant_labels}
        for tenant, figures in (stats["tenants"] if stats else {}).items():
            into = by_label.setdefault(self.tenant_label(tenant), {})
            for key, value in figures.items():
                into[key] = into.get(key, 0.0) + float(value)
        key, name, doc = _ADMISSION_QUEUED
        gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["tenant"])
        for tenant, figures in by_label.items():
            gauge.add_metric([tenant], figures.get(key, 0.0))
        yield gauge
        for key, name, doc in _ADMISSION_COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["tenant"])
            for tenant, figures in by_label.items():
                counter.add_metric([tenant], figures.get(key, 0.0))
            yield counter
        refused = CounterMetricFamily(
            PREFIX + "tenant_admission_refused", "Requests the admission queue refused (HTTP 429), by tenant and the limit reached "
            "(queue_bound: its or the whole queue's bound, token_rate: its tokens per minute); also in "
            "tenant_requests_rejected{reason=\"queue_full\"}.", labels=["tenant", "reason"])
        for tenant, figures in by_label.items():
            for key, reason in _ADMISSION_REFUSALS:
                refused.add_metric([tenant, reason], figures.get(key, 0.0))
        yield refused


class RequestTimer:
    """Observes one request's stream: TTFT, inter-token latency and, at the end, E2E, token counts
    and whether it met the SLO its scheduling-class ``objective`` is judged by."""

    def __init__(self, metrics: ServingMetrics, start: float | None = None, objective: str = DEFAULT, tenant: str = ANONYMOUS) -> None:
        if objective not in OBJECTIVES:  # a label value: the set stays bounded
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        self.metrics = metrics
        self.objective = objective
        self.tenant = metrics.tenant_label(tenant)
        self.tenant_name = tenant  # unbounded: for the request log only, never a label
        self._in_flight: Gauge | None = metrics.tenant_queued.labels(tenant=self.tenant)  # queued until its first token
        self._in_flight.inc()
        self.start = time.perf_counter() if start is None else start
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        m = self.metrics
        num_new = len(out.new_token_ids)
        if num_new:
            if self.last_token_time is None:
                self.first_token_time = now
                m.ttft.observe(now - self.start)
                m.tenant_ttft.labels(tenant=self.tenant).observe(now - self.start)
                if self._in_flight is not None:
                    self._in_flight.dec()
                    self._in_flight = m.tenant_running.labels(tenant=self.tenant)
                    self._in_flight.inc()
                self.num_prompt_tokens = len(out.prompt_token_ids)
                m.prompt_tokens_total.inc(self.num_prompt_tokens)
            else:
                gap = (now - self.last_token_time) / num_new
                for _ in range(num_new):
                    m.itl.observe(gap)
            self.last_token_time = now
            self.num_output_tokens += num_new
            m.generation_tokens_total.inc(num_new)
        if out.finished:
            if not self.done:
                m.observe_finished(out, self.tenant_name)
            self.finish(out.finish_reason or "stop", len(out.prompt_token_ids))

    def admitted(self) -> None:
        """The engine accepted the request (its first output came without an error)."""
        self.metrics.tenant_admitted.labels(tenant=self.tenant).inc()

    def reject(self, reason: str) -> None:
        """The engine refused the request (``REJECT_REASONS``): it leaves the in-flight gauges, uncounted as finished."""
        self.metrics.reject(self.tenant, reason)
        self.fail()

    def fail(self) -> None:
        """The request failed after admission: it leaves the in-flight gauges, uncounted as finished."""
        self.done = True
        self._leave()

    def _leave(self) -> None:
        if self._in_flight is not None:
            self._in_flight.dec()
            self._in_flight = None

    def finish(self, reason: str, num_prompt_tokens: int | None = None) -> None:
        """Record the end of the request (``abort`` when the client went away)."""
        if self.done:
            return
        self.done = True
        self._leave()
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.start)
        m.request_success.labels(finish_reason=reason).inc()
        m.request_prompt_tokens.observe(num_prompt_tokens if num_prompt_tokens is not None else self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_output_tokens)
        if m.slo is not None and reason != "abort" and self.first_token_time is not None:
            slo = slo_for_objective(m.slo, self.objective)
            met = reason != "error" and slo.ttft_met(self.first_token_time - self.start) and slo.tpot_met(
                tpot(self.first_token_time, self.last_token_time, self.num_output_tokens))
            m.request_slo.labels(met="true" if met else "false", objective=self.objective).inc()


class ServingMetrics:
    """All metrics of one app, in their own registry."""

    def __init__(
        self, registry: CollectorRegistry | None = None, slo: SLO | None = None, tenants: Iterable[str] = (),
        request_log: RequestLog | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.request_log = request_log  # finished requests, one JSON line each (``serve --request-log``)
        self.slo = slo  # the deployment's SLO: finished requests are counted as meeting it or not
        self.tenants = frozenset((ANONYMOUS, *tenants))  # the tenant label's values, with OTHER_TENANT
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token, measured at the API server.", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency at the API server.", buckets=E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request.", buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens", "Generated tokens per request.", buckets=TOKEN_BUCKETS, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.", ["finish_reason"], registry=r)
        self.prompt_tokens_total = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens_total = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.request_slo = Counter(
            PREFIX + "request_slo",
            "Finished requests by whether they met the deployment's TTFT and TPOT SLO (--ttft-slo/--tpot-slo) and by "
            "scheduling-class objective (throughput requests: completion alone).",
            ["met", "objective"], registry=r,
        )
        self.kv_migration_seconds = Histogram(
            PREFIX + "kv_migration_seconds", "Duration of one request's KV migration.", ["instance", "phase"], buckets=MIGRATION_BUCKETS, registry=r
        )
        self.breakdown = {  # LatencyBreakdown field -> its histogram
            field: Histogram(PREFIX + f"request_{name}_time_seconds", doc, buckets=buckets, registry=r)
            for field, name, doc, buckets in _BREAKDOWN
        }
        self.tenant_queued = Gauge(
            PREFIX + "tenant_requests_queued", "Requests submitted to the engine without a token yet, by tenant.", ["tenant"], registry=r)
        self.tenant_running = Gauge(PREFIX + "tenant_requests_running", "Requests streaming their output, by tenant.", ["tenant"], registry=r)
        self.tenant_admitted = Counter(PREFIX + "tenant_requests_admitted", "Requests the engine accepted, by tenant.", ["tenant"], registry=r)
        self.tenant_rejected = Counter(
            PREFIX + "tenant_requests_rejected", "Requests refused, by tenant and reason (queue_full: HTTP 429, timeout: 408, "
            "invalid: other 4xx, unavailable: 503, error: 5xx, session_limit: a session limit reached).", ["tenant", "reason"], registry=r)
        self.tenant_ttft = Histogram(
            PREFIX + "tenant_time_to_first_token_seconds", "Time to first token at the API server, by tenant.", ["tenant"],
            buckets=TTFT_BUCKETS, registry=r)
        self.requests_unauthenticated = Counter(
            PREFIX + "requests_unauthenticated", "Requests refused with 401: no or a wrong API key.", registry=r)
        for tenant in sorted(self.tenants | {OTHER_TENANT}):  # these series exist from the start, at 0; rejections once counted
            for family in (self.tenant_queued, self.tenant_running, self.tenant_admitted, self.tenant_ttft):
                family.labels(tenant=tenant)
        self._engine = _EngineCollector(self.tenant_label, self.tenants | {OTHER_TENANT})
        r.register(self._engine)

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` if it is one of the configured tenants (or anonymous), else ``other``."""
        return tenant if tenant in self.tenants else OTHER_TENANT

    def reject(self, tenant: str, reason: str) -> None:
        """Count a refused request of ``tenant``; ``reason`` is one of ``REJECT_REASONS`` (a bounded label)."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"reason must be one of {REJECT_REASONS}, got {reason!r}")
        self.tenant_rejected.labels(tenant=self.tenant_label(tenant), reason=reason).inc()

    def request_timer(self, objective: str = DEFAULT, tenant: str = ANONYMOUS) -> RequestTimer:
        return RequestTimer(self, objective=objective, tenant=tenant)

    def observe_finished(self, out: RequestOutput, tenant: str) -> None:
        """A request finished: its latency breakdown into the histograms, its record into the request log."""
        bd = out.metrics.breakdown
        if bd is not None:
            for field, histogram in self.breakdown.items():
                seconds = bd.inference_s if field == "inference_s" else getattr(bd, field)
                if seconds is not None:
                    histogram.observe(seconds)
        if self.request_log is not None:
            self.request_log.write(out, tenant)

    def update_engine_stats(self, raw: Mapping[str, Any]) -> None:
        """Take a fresh ``EngineClient.stats()`` snapshot: gauges, migration totals, new migration durations."""
        snap = normalize_stats(raw)
        self._engine.snapshot = snap
        for seconds in snap["kv_migration_seconds"]:
            self.kv_migration_seconds.labels(instance=AGGREGATE_INSTANCE, phase="decode").observe(seconds)
        for inst in snap["instances"]:
            for seconds in inst.get("kv_migration_seconds", []):
                self.kv_migration_seconds.labels(instance=inst["instance"], phase=inst["phase"]).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
