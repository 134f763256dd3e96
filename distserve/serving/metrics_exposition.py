"""How the server's metric families become the ``/metrics`` text: each series' prefix, and the
``model_name`` label on every series.

``ServingMetrics`` and the engine collector build their families under bare names
(``time_to_first_token_seconds``, ``kv_migration_bytes``); ``exposed`` names them here, once:

* the series vLLM also exports (``VLLM_SERIES``: same name, same meaning, same labels where vLLM
  has them) get the deployment's prefix, ``distserve:`` by default or ``vllm:`` with
  ``distserve serve --metrics-prefix vllm`` — so vLLM's own Grafana dashboard reads them unchanged;
* every other series is distserve's own and stays ``distserve:`` whatever the prefix (a series
  under ``vllm:`` always means what vLLM means by it);
* every sample gets ``model_name`` (the served model name, as vLLM labels its series).

Keeping the families bare until this step is what lets a front end that gathers several replicas'
families (Ray Serve) merge them first (``merge``) and name them once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.samples import Sample
from prometheus_client.registry import Collector

from distserve.errors import InvalidConfigError

OWN_PREFIX = "distserve"
METRICS_PREFIXES = (OWN_PREFIX, "vllm")  # ``--metrics-prefix``
MODEL_LABEL = "model_name"
ENGINE_LABEL = "engine"  # an instance of the placement (``prefill-0``); ``instance`` is Prometheus's own (the scrape target)

# The bare names (family names: counters without ``_total``) of the series vLLM exports too.
VLLM_SERIES = frozenset({
    # scheduler state and KV cache, per engine
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "iteration_tokens_total", "cache_config_info",
    # tokens and finished requests
    "prompt_tokens", "generation_tokens", "request_success",
    # latency, per request
    "time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
    "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
    # request sizes and parameters
    "request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
    "request_prefill_kv_computed_tokens", "request_params_max_tokens", "request_params_n",
})


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is one of ``METRICS_PREFIXES``, else an ``InvalidConfigError``."""
    if prefix not in METRICS_PREFIXES:
        raise InvalidConfigError(f"the metrics prefix must be one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}", "metrics_prefix")
    return prefix


def series_name(name: str, prefix: str = OWN_PREFIX) -> str:
    """The exported family name of bare ``name`` under the deployment's ``prefix``."""
    return f"{prefix if name in VLLM_SERIES else OWN_PREFIX}:{name}"


def exposed(families: Iterable[Metric], prefix: str, model_name: str) -> Iterator[Metric]:
    """``families`` (bare names) as exported: named by ``series_name``, each sample labelled ``model_name``."""
    for family in families:
        name = series_name(family.name, prefix)
        out = Metric(name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            # A sample's name is its family's plus a suffix (``_total``, ``_bucket``, ``_created``, ...).
            out.samples.append(sample._replace(
                name=name + sample.name[len(family.name):], labels={MODEL_LABEL: model_name, **sample.labels}))
        yield out


def merge(snapshots: Iterable[tuple[Iterable[Metric], bool]]) -> list[Metric]:
    """Several servers' families (bare names) as one server's: the samples of a name and label set
    summed (counters, histogram buckets, sums and counts, gauges of requests in flight), except
    ``_created`` timestamps, of which the earliest is kept. Each snapshot comes with whether its
    server is live: a gone server's gauges are left out (they describe a server that no longer
    runs), its counters and histograms still count, so that totals never go down."""
    families: dict[str, Metric] = {}
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], Sample]] = {}
    for snapshot, live in snapshots:
        for family in snapshot:
            out = families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into = samples.setdefault(family.name, {})
            if family.type == "gauge" and not live:
                continue
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                seen = into.get(key)
                if seen is None:
                    into[key] = sample
                elif sample.name.endswith("_created"):
                    into[key] = seen._replace(value=min(seen.value, sample.value))
                else:
                    into[key] = seen._replace(value=seen.value + sample.value)
    for name, out in families.items():
        out.samples = list(samples[name].values())
    return list(families.values())


class _Exposed(Collector):
    def __init__(self, families: Callable[[], Iterable[Metric]], prefix: str, model_name: str) -> None:
        self.families, self.prefix, self.model_name = families, prefix, model_name

    def collect(self) -> Iterator[Metric]:
        return exposed(self.families(), self.prefix, self.model_name)


def render(families: Callable[[], Iterable[Metric]], prefix: str, model_name: str) -> bytes:
    """The Prometheus text of what ``families()`` returns, as ``exposed``."""
    return generate_latest(_Exposed(families, check_prefix(prefix), model_name))


__all__ = [
    "ENGINE_LABEL", "METRICS_PREFIXES", "MODEL_LABEL", "OWN_PREFIX", "VLLM_SERIES",
    "check_prefix", "exposed", "merge", "render", "series_name",
]
