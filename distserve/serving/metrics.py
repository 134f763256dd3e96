"""Prometheus metrics of the HTTP layer: request latency histograms, per-tenant series and, from the
engine's ``stats()``, per-instance series (``serving.engine_metrics``).

Names follow vLLM's. Families are built under bare names and named when rendered
(``serving.metrics_exposition``): the series vLLM also has get the deployment's prefix
(``distserve:`` by default, ``vllm:`` with ``--metrics-prefix vllm``), the others ``distserve:``,
and every series carries ``model_name``. Each ``ServingMetrics`` owns its own ``CollectorRegistry``
so several apps (tests) can live in one process.

Per-request series, measured at the API server (vLLM's names): time to first token, inter-token
latency (also as vLLM's older ``time_per_output_token_seconds``), each request's mean time per
output token after the first (``request_time_per_output_token_seconds``, the TPOT an SLO judges),
end-to-end latency, prompt and generated tokens (per request, the most of its ``n`` completions,
``max_tokens`` and ``n`` asked for), finished requests by ``finished_reason`` (stop, length, abort,
error) and whether they met the deployment's SLO (``request_slo``, by objective).

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
``request_inference_time_seconds`` (prefill start → finish), named as vLLM's; and
``request_prefill_kv_computed_tokens`` (prompt tokens not taken from the prefix cache). With a
``RequestLog`` each finished request is also written there as one JSON line.

The engine figures it exports come from ``EngineClient.stats()``, whose shape is
``distserve.runtime.stats.ClientStats``.

Several servers over one engine (the replicas of a Ray Serve app, sharing one controller) each
measure the requests they answer; with ``exchange`` a server publishes its request-side families to
the others (``MetricsPeers``) and takes theirs, so that its ``/metrics`` shows the requests of all of
them (``metrics_exposition.merge``) next to the engine's series, which the shared engine reports whole.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric

from distserve.config import SamplingParams
from distserve.engine.outputs import RequestOutput
from distserve.runtime.stats import AGGREGATE_INSTANCE, normalize_stats
from distserve.cluster.classes import DEFAULT, OBJECTIVES
from distserve.cluster.tenants import ANONYMOUS
from distserve.serving.api_keys import OTHER_TENANT
from distserve.serving.engine_metrics import EngineCollector
from distserve.serving.metrics_exposition import ENGINE_LABEL, OWN_PREFIX, check_prefix, merge, render
from distserve.serving.request_log import RequestLog
from distserve.slo import SLO, slo_for_objective, tpot

CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)
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
# Why a request finished (label ``finished_reason``, vLLM's label and values); anything else counts as ``stop``.
FINISHED_REASONS = ("stop", "length", "abort", "error")


def rejection_reason(status_code: int) -> str:
    """The ``reason`` label of a request refused with ``status_code``."""
    return {429: "queue_full", 408: "timeout", 503: "unavailable"}.get(status_code, "error" if status_code >= 500 else "invalid")


class RequestTimer:
    """Observes one request's stream: TTFT, inter-token latency and, at the end, E2E, token counts
    and whether it met the SLO its scheduling-class ``objective`` is judged by. ``sampling``: the
    request's parameters (``max_tokens`` and ``n`` are observed; None: not known here)."""

    def __init__(
        self, metrics: ServingMetrics, start: float | None = None, objective: str = DEFAULT, tenant: str = ANONYMOUS,
        sampling: SamplingParams | None = None,
    ) -> None:
        if objective not in OBJECTIVES:  # a label value: the set stays bounded
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        self.metrics = metrics
        self.objective = objective
        self.sampling = sampling
        self.tenant = metrics.tenant_label(tenant)
        self.tenant_name = tenant  # unbounded: for the request log only, never a label
        self._in_flight: Gauge | None = metrics.tenant_queued.labels(tenant=self.tenant)  # queued until its first token
        self._in_flight.inc()
        self.start = time.perf_counter() if start is None else start
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0  # of all its completions
        self.num_completion_tokens: dict[int, int] = {}  # per completion (``n`` > 1), by index
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
                    m.tpot_iter.observe(gap)
            self.last_token_time = now
            self.num_output_tokens += num_new
            self.num_completion_tokens[out.index] = len(out.token_ids)
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
        m.request_success.labels(finished_reason=reason if reason in FINISHED_REASONS else "stop").inc()
        m.request_prompt_tokens.observe(num_prompt_tokens if num_prompt_tokens is not None else self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_output_tokens)
        m.request_max_num_generation_tokens.observe(max(self.num_completion_tokens.values(), default=0))
        if self.sampling is not None:
            m.request_params_max_tokens.observe(self.sampling.max_tokens)
            m.request_params_n.observe(self.sampling.n)
        mean_tpot = tpot(self.first_token_time, self.last_token_time, self.num_output_tokens)
        if mean_tpot is not None:
            m.request_tpot.observe(mean_tpot)
        if m.slo is not None and reason != "abort" and self.first_token_time is not None:
            slo = slo_for_objective(m.slo, self.objective)
            met = reason != "error" and slo.ttft_met(self.first_token_time - self.start) and slo.tpot_met(mean_tpot)
            m.request_slo.labels(met="true" if met else "false", objective=self.objective).inc()


class MetricsPeers(Protocol):
    """Where the servers over one engine publish their request-side families and read each other's
    (``RemoteController`` of a shared controller)."""

    async def publish(self, snapshot: Any) -> None:
        """Make ``snapshot`` this server's latest."""

    async def published(self) -> list[tuple[Any, bool]]:
        """The other servers' latest snapshots, each with whether its server is still live."""


class ServingMetrics:
    """All metrics of one app, in their own registry. ``prefix``: of the series vLLM also has
    (``metrics_exposition.METRICS_PREFIXES``); ``model_name``: the ``model_name`` label of every
    series (``build_fastapi_app`` sets the served model name if it is empty)."""

    def __init__(
        self, registry: CollectorRegistry | None = None, slo: SLO | None = None, tenants: Iterable[str] = (),
        request_log: RequestLog | None = None, *, prefix: str = OWN_PREFIX, model_name: str = "",
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.prefix = check_prefix(prefix)
        self.model_name = model_name
        self.request_log = request_log  # finished requests, one JSON line each (``serve --request-log``)
        self.slo = slo  # the deployment's SLO: finished requests are counted as meeting it or not
        self.tenants = frozenset((ANONYMOUS, *tenants))  # the tenant label's values, with OTHER_TENANT
        r = self.registry

        def histogram(name: str, doc: str, buckets: Iterable[float], labels: Iterable[str] = ()) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=tuple(buckets), registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, measured at the API server.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.tpot_iter = histogram(
            "time_per_output_token_seconds", "Time between consecutive output tokens (vLLM's older name of inter_token_latency_seconds).",
            ITL_BUCKETS)
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds", "A finished request's mean time per output token after the first "
            "(the TPOT its SLO is judged by); requests with one output token are not observed.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency at the API server.", E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request (all its completions).", TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Generated tokens of a request's longest completion (n > 1: the most of its n).", TOKEN_BUCKETS)
        self.request_prefill_kv_computed_tokens = histogram(
            "request_prefill_kv_computed_tokens", "Prompt tokens of a finished request whose KV was computed, not taken from the prefix cache.",
            TOKEN_BUCKETS)
        self.request_params_max_tokens = histogram("request_params_max_tokens", "The max_tokens a request asked for.", TOKEN_BUCKETS)
        self.request_params_n = histogram("request_params_n", "The n (completions) a request asked for.", N_BUCKETS)
        self.request_success = Counter(
            "request_success", "Finished requests by finish reason (stop, length, abort, error).", ["finished_reason"], registry=r)
        for reason in FINISHED_REASONS:  # as vLLM: every reason's series exists from the start
            self.request_success.labels(finished_reason=reason)
        self.prompt_tokens_total = Counter("prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens_total = Counter("generation_tokens", "Tokens generated.", registry=r)
        self.request_slo = Counter(
            "request_slo",
            "Finished requests by whether they met the deployment's TTFT and TPOT SLO (--ttft-slo/--tpot-slo) and by "
            "scheduling-class objective (throughput requests: completion alone).",
            ["met", "objective"], registry=r,
        )
        self.kv_migration_seconds = histogram(
            "kv_migration_seconds", "Duration of one request's KV migration.", MIGRATION_BUCKETS, [ENGINE_LABEL, "phase"])
        self.kv_migration_seconds.labels(engine=AGGREGATE_INSTANCE, phase="decode")  # where the runtimes report them: exists at 0
        self.breakdown = {  # LatencyBreakdown field -> its histogram
            field: histogram(f"request_{name}_time_seconds", doc, buckets) for field, name, doc, buckets in _BREAKDOWN
        }
        self.tenant_queued = Gauge(
            "tenant_requests_queued", "Requests submitted to the engine without a token yet, by tenant.", ["tenant"], registry=r)
        self.tenant_running = Gauge("tenant_requests_running", "Requests streaming their output, by tenant.", ["tenant"], registry=r)
        self.tenant_admitted = Counter("tenant_requests_admitted", "Requests the engine accepted, by tenant.", ["tenant"], registry=r)
        self.tenant_rejected = Counter(
            "tenant_requests_rejected", "Requests refused, by tenant and reason (queue_full: HTTP 429, timeout: 408, "
            "invalid: other 4xx, unavailable: 503, error: 5xx, session_limit: a session limit reached).", ["tenant", "reason"], registry=r)
        self.tenant_ttft = histogram("tenant_time_to_first_token_seconds", "Time to first token at the API server, by tenant.",
                                     TTFT_BUCKETS, ["tenant"])
        self.requests_unauthenticated = Counter(
            "requests_unauthenticated", "Requests refused with 401: no or a wrong API key.", registry=r)
        for tenant in sorted(self.tenants | {OTHER_TENANT}):  # these series exist from the start, at 0
            for family in (self.tenant_queued, self.tenant_running, self.tenant_admitted, self.tenant_ttft):
                family.labels(tenant=tenant)
            for reason in REJECT_REASONS:
                self.tenant_rejected.labels(tenant=tenant, reason=reason)
        for met, objective in itertools.product(("true", "false"), OBJECTIVES if slo is not None else ()):
            self.request_slo.labels(met=met, objective=objective)
        self._engine = EngineCollector(self.tenant_label, self.tenants | {OTHER_TENANT})  # not in ``registry``: see ``families``
        self._peer_snapshots: list[tuple[Any, bool]] = []  # the other servers' request-side families (``exchange``)

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` if it is one of the configured tenants (or anonymous), else ``other``."""
        return tenant if tenant in self.tenants else OTHER_TENANT

    def reject(self, tenant: str, reason: str) -> None:
        """Count a refused request of ``tenant``; ``reason`` is one of ``REJECT_REASONS`` (a bounded label)."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"reason must be one of {REJECT_REASONS}, got {reason!r}")
        self.tenant_rejected.labels(tenant=self.tenant_label(tenant), reason=reason).inc()

    def request_timer(self, objective: str = DEFAULT, tenant: str = ANONYMOUS, sampling: SamplingParams | None = None) -> RequestTimer:
        return RequestTimer(self, objective=objective, tenant=tenant, sampling=sampling)

    def observe_finished(self, out: RequestOutput, tenant: str) -> None:
        """A request finished: its latency breakdown and computed prompt tokens into the histograms, its
        record into the request log."""
        bd = out.metrics.breakdown
        if bd is not None:
            for field, histogram in self.breakdown.items():
                seconds = bd.inference_s if field == "inference_s" else getattr(bd, field)
                if seconds is not None:
                    histogram.observe(seconds)
        if out.metrics.first_token_time is not None:
            self.request_prefill_kv_computed_tokens.observe(max(0, out.metrics.num_prompt_tokens - out.metrics.num_cached_tokens))
        if self.request_log is not None:
            self.request_log.write(out, tenant)

    def update_engine_stats(self, raw: Mapping[str, Any]) -> None:
        """Take a fresh ``EngineClient.stats()`` snapshot: gauges, migration totals, new migration durations."""
        snap = normalize_stats(raw)
        self._engine.snapshot = snap
        for seconds in snap["kv_migration_seconds"]:
            self.kv_migration_seconds.labels(engine=AGGREGATE_INSTANCE, phase="decode").observe(seconds)
        for inst in snap["instances"]:
            for seconds in inst.get("kv_migration_seconds", []):
                self.kv_migration_seconds.labels(engine=inst["instance"], phase=inst["phase"]).observe(seconds)

    def request_families(self) -> list[Metric]:
        """This server's own request-side families (everything it measured itself), bare names."""
        return list(self.registry.collect())

    async def exchange(self, peers: MetricsPeers) -> None:
        """Publish this server's request-side families to ``peers`` and take theirs, which ``families`` merges in from now on."""
        await peers.publish(self.request_families())
        self._peer_snapshots = await peers.published()

    def families(self) -> Iterator[Metric]:
        """Every family under its bare name (``metrics_exposition.exposed`` names them): the request
        side merged with the peers' latest (after ``exchange``), then the engine's."""
        own = self.registry.collect()
        requests = merge([(own, True), *self._peer_snapshots]) if self._peer_snapshots else own
        return itertools.chain(requests, self._engine.collect())

    def render(self) -> bytes:
        """The ``/metrics`` text: every family, named under ``prefix`` and labelled ``model_name``."""
        return render(self.families, self.prefix, self.model_name)
