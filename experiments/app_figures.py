"""Parrot's application figures (issue 18), measured by ``bench_apps.py --figures`` and drawn from its JSON.

Parrot (OSDI'24) plots, for its applications, each against the request-centric baseline:

* chain summarisation: end-to-end latency vs the output length of every call;
* multi-agent programming: the mean latency of the programs vs how many run at once;
* a copilot whose users share one long system prompt: latency per output token vs how many users
  query at once (the batch).

``FIGURES`` lists those sweeps over the apps of ``experiments/apps`` (each written both ways, as in
``bench_apps``' table); ``summarize_figures`` reduces ``bench_apps`` rows to the median per point and
way (and the request-centric / dataflow ratio); ``render`` draws one panel per figure, one line per
way. ``slo_sweep.py --render-apps FILE.json`` redraws a saved run with the same function.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import harness
from apps import App, ChainSummary, Concurrent, Copilot, MultiAgentCoding

WAYS = ("request_centric", "dataflow")
WAY_LABELS = {"request_centric": "request-centric (OpenAI API, call by call)", "dataflow": "dataflow (semantic variables)"}


@dataclass(frozen=True)
class Figure:
    """One Parrot figure: an app swept over one parameter; ``metric`` is the row field plotted (seconds)."""

    app: str
    param: str
    xlabel: str
    ylabel: str
    metric: str
    values: tuple[int, ...]
    quick_values: tuple[int, ...]
    make: Callable[[int, int, bool], App]  # (parameter value, seed, quick) -> the app to run once


def _chain(output_tokens: int, seed: int, quick: bool) -> App:
    return ChainSummary(3, 40, output_tokens, seed=seed) if quick else ChainSummary(summary_tokens=output_tokens, seed=seed)


def _agents(num_apps: int, seed: int, quick: bool) -> App:
    # Distinct seeds: the programs share no prefix with one another (only each one's own context).
    programs = (MultiAgentCoding(2, 40, 8, 8, 8, seed=seed * 64 + i) if quick else MultiAgentCoding(seed=seed * 64 + i)
                for i in range(num_apps))
    return Concurrent(tuple(programs), seed=seed, name="multi_agent")


def _copilot(num_users: int, seed: int, quick: bool) -> App:
    return Copilot(num_users, 80, 8, 8, seed=seed) if quick else Copilot(num_users=num_users, seed=seed)


FIGURES = (
    Figure("chain", "output_tokens", "output tokens of each call", "end-to-end latency (s)", "latency_s", (16, 32, 64), (4, 8), _chain),
    Figure("multi_agent", "num_apps", "multi-agent programs at once", "mean program latency (s)", "latency_s", (1, 2, 4), (1, 2), _agents),
    Figure("copilot", "num_users", "users querying at once (batch)", "latency per output token (s)", "per_token_latency_s",
           (2, 4, 8, 16), (2, 4), _copilot),
)


def summarize_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure (by app): its parameter and, per value, each way's median metric and the ratio
    request-centric / dataflow (> 1: dataflow is faster)."""
    out: dict[str, Any] = {}
    for fig in FIGURES:
        mine = [r for r in rows if r["app"] == fig.app and fig.param in r]
        if not mine:
            continue
        points: dict[str, Any] = {}
        for value in sorted({r[fig.param] for r in mine}):
            cell = {way: round(statistics.median(r[fig.metric] for r in mine if r[fig.param] == value and r["way"] == way), 4)
                    for way in WAYS}
            cell["ratio"] = round(cell["request_centric"] / cell["dataflow"], 3) if cell["dataflow"] > 0 else None
            points[str(value)] = cell
        out[fig.app] = {"param": fig.param, "metric": fig.metric, "points": points}
    return out


def markdown_lines(summary: dict[str, Any]) -> list[str]:
    md = ["| figure | parameter | value | request-centric | dataflow | ratio |", "|---|---|---|---|---|---|"]
    for app, fig in summary.items():
        for value, c in fig["points"].items():
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}x"
            md.append(f"| {app} ({fig['metric']}) | {fig['param']} | {value} | {harness.ms(c['request_centric'])} ms | "
                      f"{harness.ms(c['dataflow'])} ms | {ratio} |")
    return md


def render(summary: dict[str, Any], title: str) -> Any:
    """A matplotlib figure: one panel per measured figure, x = its parameter, one line per way."""
    plt = harness.pyplot()
    figs = [f for f in FIGURES if f.app in summary]
    fig, axes = plt.subplots(1, max(1, len(figs)), figsize=(4.4 * max(1, len(figs)), 3.6), squeeze=False)
    for ax, spec in zip(axes[0], figs):
        points = summary[spec.app]["points"]
        xs = [int(v) for v in points]
        for way in WAYS:
            ax.plot(xs, [points[str(x)][way] for x in xs], marker="o", label=WAY_LABELS[way])
        ax.set_xticks(xs)
        ax.set_xlabel(spec.xlabel)
        ax.set_ylabel(spec.ylabel)
        ax.set_title(spec.app, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
