"""What a load-generator run measured: the ``LoadResult`` of every request, its ``Summary`` (TTFT, TPOT,
ITL, E2E, attainment, goodput), vLLM's ``vllm bench serve`` result keys (``vllm_metrics``), the misses
already certain while a run is under way (``num_known_misses``), and the text report (``format_summary``).
The definitions are ``distserve.slo``'s; ``distserve.measure.loadgen`` runs the load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from distserve.measure.stream_client import ENDPOINT_PATHS, RequestResult
from distserve.measure.workload import Workload
from distserve.slo import SLO, attainment, latency_summary, percentile

MAX_ERROR_KINDS = 5


@dataclass(frozen=True)
class Summary:
    """What one run measured: counts, throughput, latency percentiles (completed requests), attainment and goodput."""

    num_requests: int
    num_completed: int
    num_errors: int  # failed requests, not counting cancelled ones
    num_cancelled: int  # cancelled by an early stop (misses, not errors)
    error_kinds: dict[str, int]
    duration_s: float  # first arrival to last completion
    throughput_rps: float  # completed requests / duration
    output_tok_s: float
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    tpot_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    itl_mean_s: float | None  # every gap between streamed output chunks of completed requests
    itl_p50_s: float | None
    itl_p99_s: float | None
    ttft_attainment: float  # fraction of all requests within the TTFT SLO
    tpot_attainment: float
    slo_attainment: float  # fraction of all requests within both
    goodput_rps: float  # requests within both SLOs / duration
    max_send_lag_s: float  # how late the client sent a request relative to its arrival time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadResult:
    """A finished run: what was sent, the SLOs, every request's timings, and the summary."""

    base_url: str
    model: str
    workload: Workload
    slo: SLO
    requests: list[RequestResult]
    summary: Summary
    calibration: tuple[float, float] = (1.0, 0.0)  # (tokens per word, overhead tokens) used to build prompts
    extra: dict[str, Any] = field(default_factory=dict)
    stopped_early: bool = False  # ended once attainment was certain to be below ``stop_below``
    endpoint_type: str = "completions"  # completions | chat
    max_concurrency: int | None = None
    metric_percentiles: tuple[float, ...] = (99.0,)  # the p{P}_*_ms keys (vLLM's --metric-percentiles)

    @property
    def tokens_per_word(self) -> float:
        return self.calibration[0]

    def to_dict(self, include_requests: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "base_url": self.base_url,
            "model": self.model,
            "workload": asdict(self.workload),
            "slo": {"ttft_s": _finite_or_none(self.slo.ttft_s), "tpot_s": _finite_or_none(self.slo.tpot_s)},
            "tokens_per_word": self.calibration[0],
            "overhead_tokens": self.calibration[1],
            "stopped_early": self.stopped_early,
            "endpoint_type": self.endpoint_type,
            "request_rate": self.workload.rate if math.isfinite(self.workload.rate) else "inf",  # as vLLM's result JSON
            "burstiness": self.workload.burstiness,
            "max_concurrency": self.max_concurrency,
            **self.summary.to_dict(),
            **vllm_metrics(self.requests, self.summary, self.slo, self.metric_percentiles),
            **self.extra,
        }
        if include_requests:
            out["requests"] = [
                {**asdict(r), "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s, "itls_s": r.itls_s} for r in self.requests
            ]
        return out


def _finite_or_none(seconds: float) -> float | None:
    return seconds if math.isfinite(seconds) else None


def summarize(results: Seq[RequestResult], slo: SLO) -> Summary:
    """Percentiles over completed requests; attainment over all requests (errors are misses)."""
    n = len(results)
    done = [r for r in results if r.ok]
    finishes = [r.finish_s for r in results if r.finish_s is not None]
    duration = (max(finishes) - min(r.arrival_s for r in results)) if finishes else 0.0
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None and not r.cancelled:
            key = r.error[:160]
            if key in errors or len(errors) < MAX_ERROR_KINDS:
                errors[key] = errors.get(key, 0) + 1
            else:
                errors["(other)"] = errors.get("(other)", 0) + 1
    att = attainment(results, slo) if n else {"ttft": 0.0, "tpot": 0.0, "joint": 0.0}
    good = sum(r.meets(slo) for r in results)
    lags = [r.sent_s - r.arrival_s for r in results if r.sent_s is not None]
    prompt_tokens = [float(r.num_prompt_tokens) for r in done if r.num_prompt_tokens is not None]
    itls = [gap for r in done for gap in r.itls_s]
    return Summary(
        num_requests=n,
        num_completed=len(done),
        num_errors=sum(not r.ok and not r.cancelled for r in results),
        num_cancelled=sum(r.cancelled for r in results),
        error_kinds=errors,
        duration_s=duration,
        throughput_rps=len(done) / duration if duration > 0 else 0.0,
        output_tok_s=sum(r.num_output_tokens for r in done) / duration if duration > 0 else 0.0,
        mean_prompt_tokens=_mean(prompt_tokens),
        mean_output_tokens=_mean([float(r.num_output_tokens) for r in done]),
        **latency_summary(results, with_mean=False, empty=None),  # type: ignore[arg-type]
        itl_mean_s=_mean(itls),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        ttft_attainment=att["ttft"],
        tpot_attainment=att["tpot"],
        slo_attainment=att["joint"],
        goodput_rps=good / duration if duration > 0 else 0.0,
        max_send_lag_s=max(lags) if lags else 0.0,
    )


def _mean(values: Seq[float]) -> float | None:
    return float(np.mean(values)) if values else None


def vllm_metrics(results: Seq[RequestResult], summary: Summary, slo: SLO, percentiles: Seq[float] = (99.0,)) -> dict[str, Any]:
    """The result keys of ``vllm bench serve`` (``vllm/benchmarks/serve.py``), from our measurements (module docstring)."""
    done = [r for r in results if r.ok]
    duration = summary.duration_s
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    input_tokens = sum(r.num_prompt_tokens if r.num_prompt_tokens is not None else r.input_len for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    checks_slo = math.isfinite(slo.ttft_s) or math.isfinite(slo.tpot_s)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "request_goodput": per_s(sum(r.meets(slo) for r in done)) if checks_slo else None,
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
    }
    series = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itls_s],
        "e2el": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000.0
        out[f"mean_{name}_ms"] = float(np.mean(ms))
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"std_{name}_ms"] = float(np.std(ms))
        for p in percentiles:
            out[f"p{int(p) if int(p) == p else p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def num_known_misses(results: Seq[RequestResult], slo: SLO, max_tokens: int | Seq[int], now_s: float) -> int:
    """Requests certain to miss ``slo`` at time ``now_s`` (from the run's start), finished or not.

    A stream has at most ``max_tokens`` tokens (one number for all, or each request's), so once its
    tokens so far span more than ``tpot_s * (max_tokens - 1)`` its TPOT can only end above ``tpot_s``.
    """
    num = 0
    limits = [max_tokens] * len(results) if isinstance(max_tokens, int) else max_tokens
    for r, limit in zip(results, limits):
        if r.finish_s is not None:
            num += not r.meets(slo)
        elif r.sent_s is not None and r.first_token_s is None:
            num += now_s - r.sent_s > slo.ttft_s
        elif r.first_token_s is not None and r.last_token_s is not None:
            missed_ttft = not slo.ttft_met(r.ttft_s)
            missed_tpot = limit > 1 and r.last_token_s - r.first_token_s > slo.tpot_s * (limit - 1)
            num += missed_ttft or missed_tpot
    return num


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isinf(seconds) else f"{seconds * 1000:.0f} ms"


def format_summary(result: LoadResult) -> str:
    s, w, slo = result.summary, result.workload, result.slo
    lines = [
        f"{result.base_url}{ENDPOINT_PATHS[result.endpoint_type]}  model={result.model}  rate={w.rate:g}/s "
        f"(burstiness {w.burstiness:g})  max concurrency {result.max_concurrency or '-'}  requests={w.num_requests}  "
        f"input~{w.input_len} ({w.input_len_dist})  output={w.output_len}",
        f"completed {s.num_completed}/{s.num_requests}  errors {s.num_errors}  duration {s.duration_s:.1f} s  "
        f"throughput {s.throughput_rps:.2f} req/s, {s.output_tok_s:.1f} tok/s",
        f"TTFT p50/p90/p99 {_fmt_ms(s.ttft_p50_s)} / {_fmt_ms(s.ttft_p90_s)} / {_fmt_ms(s.ttft_p99_s)}",
        f"TPOT p50/p90/p99 {_fmt_ms(s.tpot_p50_s)} / {_fmt_ms(s.tpot_p90_s)} / {_fmt_ms(s.tpot_p99_s)}",
        f"ITL mean/p50/p99 {_fmt_ms(s.itl_mean_s)} / {_fmt_ms(s.itl_p50_s)} / {_fmt_ms(s.itl_p99_s)}",
        f"SLO (TTFT {_fmt_ms(slo.ttft_s)}, TPOT {_fmt_ms(slo.tpot_s)}): attainment {s.slo_attainment:.0%} "
        f"(TTFT {s.ttft_attainment:.0%}, TPOT {s.tpot_attainment:.0%})  goodput {s.goodput_rps:.2f} req/s",
    ]
    lines += [f"error x{count}: {kind}" for kind, count in s.error_kinds.items()]
    if result.stopped_early:
        lines.append(f"stopped early: attainment certain to be below the target ({s.num_cancelled} requests cancelled)")
    if "calibration_error" in result.extra:
        lines.append(f"calibration failed (assumed 1 token/word): {result.extra['calibration_error']}")
    return "\n".join(lines)
