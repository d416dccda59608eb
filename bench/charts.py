"""Benchmark charts: each function turns result dicts into one titled, labelled matplotlib `Figure`.

Figures are built with `matplotlib.figure.Figure` and rendered by the Agg canvas, so no GUI backend or
global pyplot state is involved. `save` writes a PNG small enough for the docs (100 dpi).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

DPI = 100
COLOURS = {"passthrough": "#7f7f7f", "batch": "#1f77b4", "standard": "#ff7f0e", "float": "#2ca02c",
           "budget": "#9467bd"}


def _colour(run_name: str) -> str:
    if run_name.startswith("passthrough"):
        return COLOURS["passthrough"]
    if "float" in run_name:
        return COLOURS["float"]
    if "budget" in run_name:
        return COLOURS["budget"]
    return COLOURS["standard"] if "standard" in run_name else COLOURS["batch"]


def latency_cdf(main: dict[str, Any]) -> Figure:
    """CDF of request latency for every run of the main scenario (passthrough vs. merging, per tier)."""
    fig = Figure(figsize=(8, 4.5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    for name, run in main["runs"].items():
        points = run["latency_cdf_ms"]
        fractions = [k / (len(points) - 1) for k in range(len(points))]
        style = "--" if name.startswith("passthrough") and "standard" in name else "-"
        ax.plot(points, fractions, style, color=_colour(name), label=name, linewidth=1.8)
    ax.set_xscale("log")
    ax.set_xlabel("request latency (ms, log scale)")
    ax.set_ylabel("fraction of requests answered")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")  # the curves rise on the right; the upper left stays empty
    ax.set_title(f"Latency CDF, mixed workload at {main['rate']:g} req/s: passthrough vs. merging")
    return fig


def window_sweep(sweep: dict[str, Any]) -> Figure:
    """Upstream calls and prompt tokens per request (left, right) as the merge window grows."""
    points = sweep["points"]
    windows = [p["window_ms"] for p in points]
    fig = Figure(figsize=(9, 4), dpi=DPI, layout="constrained")
    left, right = fig.subplots(1, 2)
    for ax, key, label in ((left, "upstream_calls_per_request", "upstream calls per request"),
                           (right, "prompt_tokens_per_request", "upstream prompt tokens per request")):
        ax.plot(windows, [p[key] for p in points], "o-", color=COLOURS["batch"], label=f"{sweep['tier']} tier")
        ax.set_xlabel("merge window (ms)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        ax.set_title(label.capitalize())
    fig.suptitle(f"Upstream cost vs. merge window ({sweep['tier']} tier, {sweep['rate']:g} req/s)")
    return fig


def rate_sweep(sweep: dict[str, Any]) -> Figure:
    """Merge rate (left axis) and mean batch size (right axis) as the arrival rate grows."""
    points = sweep["points"]
    rates = [p["rate"] for p in points]
    fig = Figure(figsize=(8, 4.5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    line1 = ax.plot(rates, [100 * p["merge_rate"] for p in points], "o-", color=COLOURS["batch"],
                    label="merge rate (% of requests)")
    ax.set_xlabel("arrival rate (requests/s, Poisson)")
    ax.set_ylabel("merge rate (% of requests)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    twin = ax.twinx()
    line2 = twin.plot(rates, [p["mean_batch_size"] for p in points], "s--", color=COLOURS["standard"],
                      label="mean batch size (requests per dispatch)")
    twin.set_ylabel("mean batch size (requests)")
    twin.set_ylim(bottom=0)
    ax.legend(line1 + line2, [l.get_label() for l in line1 + line2], loc="lower right", fontsize="small")
    ax.set_title(f"Merge rate vs. arrival rate ({sweep['tier']} tier)")
    return fig


def threshold_sweep(sweep: dict[str, Any]) -> Figure:
    """Upstream calls per request and merge rate as the similarity threshold rises."""
    points = sweep["points"]
    thresholds = [p["threshold"] for p in points]
    fig = Figure(figsize=(8, 4.5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    line1 = ax.plot(thresholds, [p["upstream_calls_per_request"] for p in points], "o-", color=COLOURS["batch"],
                    label="upstream calls per request")
    ax.set_xlabel("similarity threshold (cosine)")
    ax.set_ylabel("upstream calls per request")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    twin = ax.twinx()
    line2 = twin.plot(thresholds, [100 * p["merge_rate"] for p in points], "s--", color=COLOURS["standard"],
                      label="merge rate (%)")
    twin.set_ylabel("merge rate (% of requests)")
    twin.set_ylim(0, 100)
    ax.legend(line1 + line2, [l.get_label() for l in line1 + line2], loc="center right", fontsize="small")
    ax.set_title(f"Similarity threshold sweep ({sweep['tier']} tier, {sweep['rate']:g} req/s)")
    return fig


def embedding_throughput(matrix: list[dict[str, Any]]) -> Figure:
    """Texts/s (left) and p99 latency (right) per concurrency for each embedding setup."""
    fig = Figure(figsize=(9, 4), dpi=DPI, layout="constrained")
    left, right = fig.subplots(1, 2)
    levels = [lvl["concurrency"] for lvl in matrix[0]["levels"]] if matrix else []
    width = 0.8 / max(1, len(matrix))
    for i, setup in enumerate(matrix):
        xs = [k + i * width for k in range(len(levels))]
        for ax, key in ((left, "texts_per_s"), (right, "p99_ms")):
            ax.bar(xs, [lvl[key] for lvl in setup["levels"]], width, label=setup["name"])
    for ax, label, title in ((left, "throughput (texts/s)", "Throughput by concurrency"),
                             (right, "p99 latency (ms, log scale)", "p99 latency by concurrency")):
        ax.set_xticks([k + width * (len(matrix) - 1) / 2 for k in range(len(levels))], [str(c) for c in levels])
        ax.set_xlabel("concurrent clients (one text per request)")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_title(title)
    right.set_yscale("log")  # one text per call at high concurrency is orders of magnitude slower
    right.legend(fontsize="x-small")
    fig.suptitle("Local all-MiniLM-L6-v2 behind /v1/embeddings: window batching vs. one text per call")
    return fig


def save(fig: Figure, path: Path) -> Path:
    """Write `fig` as a PNG at `path` (parents created) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path
