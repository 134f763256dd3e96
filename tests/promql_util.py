"""Dashboards' PromQL queries and the series and labels they name, checked against a server's
``/metrics`` (importable as ``promql_util``: pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import distserve.serving

DASHBOARD = Path(distserve.serving.__file__).parent / "dashboards" / "distserve.json"

_RATE = "[$__rate_interval]"
_MODEL = '{model_name="$model_name"}'


def _quantiles(histogram: str) -> list[str]:
    return [f"histogram_quantile({q}, sum by(le) (rate(vllm:{histogram}_bucket{_MODEL}{_RATE})))" for q in (0.99, 0.95, 0.9, 0.5)]


def _mean(histogram: str) -> str:
    return f"rate(vllm:{histogram}_sum{_MODEL}{_RATE})\n/\nrate(vllm:{histogram}_count{_MODEL}{_RATE})"


# The queries of vLLM's example dashboard (examples/online_serving/prometheus_grafana/grafana.json), panel
# by panel; where vLLM renamed a series (cache usage in 0.10, TPOT → ITL) both versions' queries are here.
VLLM_DASHBOARD_QUERIES: dict[str, list[str]] = {
    "E2E Request Latency": [*_quantiles("e2e_request_latency_seconds"), _mean("e2e_request_latency_seconds")],
    "Token Throughput": [f"rate(vllm:prompt_tokens_total{_MODEL}{_RATE})", f"rate(vllm:generation_tokens_total{_MODEL}{_RATE})"],
    "Time Per Output Token Latency": [*_quantiles("time_per_output_token_seconds"), _mean("time_per_output_token_seconds"),
                                      *_quantiles("inter_token_latency_seconds"), _mean("inter_token_latency_seconds")],
    "Scheduler State": [f"vllm:num_requests_running{_MODEL}", f"vllm:num_requests_waiting{_MODEL}"],
    "Time To First Token Latency": [*_quantiles("time_to_first_token_seconds"), _mean("time_to_first_token_seconds")],
    "Cache Utilization": [f"vllm:gpu_cache_usage_perc{_MODEL}", f"vllm:kv_cache_usage_perc{_MODEL}"],
    "Request Prompt Length": [f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{_MODEL}{_RATE}))"],
    "Request Generation Length": [f"sum by(le) (increase(vllm:request_generation_tokens_bucket{_MODEL}{_RATE}))"],
    "Finish Reason": [f"sum by(finished_reason) (increase(vllm:request_success_total{_MODEL}{_RATE}))"],
    "Queue Time": [f"rate(vllm:request_queue_time_seconds_sum{_MODEL}{_RATE})"],
    "Requests Prefill and Decode Time": [f"rate(vllm:request_prefill_time_seconds_sum{_MODEL}{_RATE})",
                                         f"rate(vllm:request_decode_time_seconds_sum{_MODEL}{_RATE})"],
    "Max Generation Token in Sequence Group": [f"rate(vllm:request_max_num_generation_tokens_sum{_MODEL}{_RATE})"],
}

_FUNCTION_OR_KEYWORD = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                                  "offset", "inf", "nan"})
_MATCHERS = re.compile(r"\{([^}]*)\}")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENTIFIER = re.compile(r"(?<![\w.$])[A-Za-z_:][\w:]*")


def dashboard_queries(path: Path = DASHBOARD, prefix: str = "distserve") -> list[str]:
    """Every panel target's ``expr`` in the Grafana dashboard at ``path``, and each variable's
    ``label_values(SELECTOR, LABEL)`` as ``sum by(LABEL) (SELECTOR)``; ``${prefix}`` set to ``prefix``."""
    dashboard = json.loads(path.read_text())
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    queries = [t["expr"] for p in panels for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["query"]["query"]).groups()  # type: ignore[union-attr]
            queries.append(f"sum by({label}) ({selector})")
    return [q.replace("${prefix}", prefix) for q in queries]


def series_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """The series ``expr`` reads (identifiers that are no function, keyword or label) and the labels it
    matches on or aggregates by (``le`` excepted)."""
    labels = {m.group(1) for body in _MATCHERS.findall(expr) for m in re.finditer(r"(\w+)\s*(?:=~|!~|!=|=)", body)}
    labels |= {name.strip() for body in _LABEL_LISTS.findall(expr) for name in body.split(",") if name.strip()}
    bare = _LABEL_LISTS.sub(" ", _MATCHERS.sub(" ", re.sub(r"\[[^\]]*\]", " ", expr)))
    series = {m.group() for m in _IDENTIFIER.finditer(bare)
              if m.group() not in _FUNCTION_OR_KEYWORD and not bare[m.end():].lstrip().startswith("(")}
    return series, labels - {"le"}


def exported_series(text: str) -> dict[str, set[str]]:
    """A ``/metrics`` text's sample names, each with the label names its samples carry."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def unanswered(queries: list[str], exported: dict[str, set[str]]) -> dict[str, str]:
    """The queries that name a series not exported, or a label none of their series carries: query -> why."""
    problems = {}
    for expr in queries:
        series, labels = series_and_labels(expr)
        assert series, f"no series found in {expr!r}"
        missing = sorted(series - set(exported))
        carried = set().union(*(exported.get(s, set()) for s in series))
        if missing or labels - carried:
            problems[expr] = f"missing series {missing}, labels {sorted(labels - carried)}"
    return problems
