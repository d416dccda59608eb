"""Summarise an evaluation (pure) and render it: Markdown, JSON and an optional chart.

Definitions, per batch size (the alone run is the reference):
- accuracy: mean score of each answer against its `expected` (`merge.fidelity.compare`: exact match after
  normalising for short answers), over the requests that have one. Merged accuracy is what callers would
  get: a block's answer, or for a member whose block failed, its answer alone (production re-sends it).
- agreement: mean fidelity of the block answers against the same requests' answers alone.
- split failure rate: members whose block failed (missing, malformed, leak, failed call...) / members.
- calls and tokens: merged calls plus the alone calls of fallbacks, against one call per request alone.
- latency: per member, its merged call (plus its alone call after a fallback).
- recommended max_batch: the largest batch size such that it and every smaller one keep accuracy (or,
  without expected answers, agreement) within `tolerance` points of alone; 1 means do not merge.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mergebroker.broker.eval.run import CallResult, MergedRun, Observation
from mergebroker.merge.fidelity import compare

Scorer = Callable[[str, str], float]
"""(answer, reference) -> 0..1."""


@dataclass(frozen=True)
class SizeSummary:
    """The figures of one batch size."""

    batch_size: int
    merged_calls: int
    fallbacks: int
    split_failure_rate: float
    failure_reasons: dict[str, int]
    accuracy: float | None
    agreement: float | None
    calls: int
    calls_saved: int
    tokens: int
    tokens_saved: int
    latency_p50_s: float
    latency_p95_s: float


@dataclass(frozen=True)
class EvalSummary:
    """The whole evaluation: the alone reference, every batch size, and the recommendation."""

    model: str
    upstream: str
    seed: int
    requests: int
    with_expected: int
    alone_accuracy: float | None
    alone_failed: int
    alone_calls: int
    alone_tokens: int
    alone_latency_p50_s: float
    alone_latency_p95_s: float
    sizes: tuple[SizeSummary, ...]
    metric: str
    tolerance_points: float
    recommended_max_batch: int


def default_scorer(answer: str, reference: str) -> float:
    """`merge.fidelity.compare` without embeddings (word overlap stands in for prose)."""
    return compare(answer, reference).score


def summarise(obs: Observation, *, model: str, upstream: str, seed: int, tolerance_points: float = 2.0,
              scorer: Scorer = default_scorer) -> EvalSummary:
    """The figures of an evaluation (see the module docstring)."""
    expected = [r.expected for r in obs.requests]
    alone_texts = [c.text for c in obs.alone]
    sizes = tuple(_size(run, obs.alone, expected, scorer) for run in obs.merged)
    alone_accuracy = _accuracy(alone_texts, expected, scorer)
    metric = "accuracy" if alone_accuracy is not None else "agreement"
    reference = alone_accuracy if alone_accuracy is not None else 1.0
    values = {s.batch_size: (s.accuracy if metric == "accuracy" else s.agreement) for s in sizes}
    latencies = [c.latency_s for c in obs.alone]
    return EvalSummary(
        model=model, upstream=upstream, seed=seed, requests=len(obs.requests),
        with_expected=sum(e is not None for e in expected), alone_accuracy=alone_accuracy,
        alone_failed=sum(t is None for t in alone_texts), alone_calls=len(obs.alone),
        alone_tokens=_tokens(obs.alone), alone_latency_p50_s=_quantile(latencies, 0.5),
        alone_latency_p95_s=_quantile(latencies, 0.95), sizes=sizes, metric=metric,
        tolerance_points=tolerance_points, recommended_max_batch=recommend(reference, values, tolerance_points))


def recommend(reference: float, values: dict[int, float | None], tolerance_points: float) -> int:
    """The largest batch size that, with every smaller one, stays within `tolerance_points` of `reference`."""
    best = 1
    for size in sorted(values):
        value = values[size]
        if value is None or (reference - value) * 100 > tolerance_points + 1e-9:
            break
        best = size
    return best


def _size(run: MergedRun, alone: Sequence[CallResult], expected: Sequence[str | None], scorer: Scorer) -> SizeSummary:
    served: list[str | None] = []
    agreement: list[float] = []
    latencies: list[float] = []
    reasons: Counter[str] = Counter()
    fallback_calls: list[CallResult] = []
    for member in run.members:
        own = alone[member.index]
        if member.failure is not None:
            reasons[member.failure] += 1
            fallback_calls.append(own)
            served.append(own.text)
            latencies.append(member.latency_s + own.latency_s)
            continue
        served.append(member.block_answer)
        latencies.append(member.latency_s)
        if own.text is not None and member.block_answer is not None:
            agreement.append(scorer(member.block_answer, own.text))
    ordered_expected = [expected[m.index] for m in run.members]
    calls = len(run.calls) + len(fallback_calls)
    tokens = _tokens(run.calls) + _tokens(fallback_calls)
    fallbacks = sum(reasons.values())
    return SizeSummary(
        batch_size=run.batch_size, merged_calls=len(run.calls), fallbacks=fallbacks,
        split_failure_rate=fallbacks / len(run.members) if run.members else 0.0,
        failure_reasons=dict(sorted(reasons.items())), accuracy=_accuracy(served, ordered_expected, scorer),
        agreement=statistics.fmean(agreement) if agreement else None, calls=calls,
        calls_saved=len(alone) - calls, tokens=tokens, tokens_saved=_tokens(alone) - tokens,
        latency_p50_s=_quantile(latencies, 0.5), latency_p95_s=_quantile(latencies, 0.95))


def _accuracy(answers: Sequence[str | None], expected: Sequence[str | None], scorer: Scorer) -> float | None:
    scores = [0.0 if a is None else scorer(a, e) for a, e in zip(answers, expected) if e is not None]
    return statistics.fmean(scores) if scores else None


def _tokens(calls: Sequence[CallResult]) -> int:
    return sum(c.prompt_tokens + c.completion_tokens for c in calls)


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def render_json(summary: EvalSummary) -> str:
    """The summary as a JSON document (rates as fractions, latencies in seconds)."""
    return json.dumps(dataclasses.asdict(summary), indent=2)


def render_markdown(summary: EvalSummary, *, chart: str | None = None) -> str:
    """The summary as a Markdown report ending with the recommendation."""
    s = summary
    lines = [f"# Merge evaluation: {s.model}", "",
             f"Upstream `{s.upstream}`, {s.requests} requests ({s.with_expected} with an expected answer), "
             f"seed {s.seed}. Alone: accuracy {_pct(s.alone_accuracy)}, {s.alone_failed} failed calls, "
             f"{s.alone_calls} calls, {s.alone_tokens:,} tokens, latency p50 {s.alone_latency_p50_s:.3f} s, "
             f"p95 {s.alone_latency_p95_s:.3f} s.", "",
             "| batch size | accuracy alone | accuracy merged | agreement | split failures | calls (saved) "
             "| tokens (saved) | latency p50 / p95 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for z in s.sizes:
        lines.append(f"| {z.batch_size} | {_pct(s.alone_accuracy)} | {_pct(z.accuracy)} | {_pct(z.agreement)} "
                     f"| {z.split_failure_rate:.1%} | {z.calls} ({z.calls_saved:+}) | {z.tokens:,} "
                     f"({z.tokens_saved:+,}) | {z.latency_p50_s:.3f} / {z.latency_p95_s:.3f} s |")
    lines += ["", "Split failures by reason (members re-sent alone):", ""]
    for z in s.sizes:
        reasons = ", ".join(f"{k} {v}" for k, v in z.failure_reasons.items()) or "none"
        lines.append(f"- batch of {z.batch_size}: {reasons}")
    if chart:
        lines += ["", f"![{s.metric} by batch size]({chart})"]
    verdict = ("merging is not recommended for this model (keep `max_batch: 1`)" if s.recommended_max_batch == 1
               else f"`max_batch: {s.recommended_max_batch}`")
    lines += ["", "## Recommendation", "",
              f"Recommended for {s.model}: {verdict} — the largest batch size whose {s.metric} stays within "
              f"{s.tolerance_points:g} points of alone (at that size and every smaller one).", ""]
    return "\n".join(lines)


def render_chart(summary: EvalSummary, path: str) -> bool:
    """Draw accuracy, agreement and split failures by batch size into `path` (PNG); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = [1, *(z.batch_size for z in summary.sizes)]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if summary.alone_accuracy is not None:
        ax.plot(sizes, [summary.alone_accuracy * 100, *(_num(z.accuracy) for z in summary.sizes)], "o-",
                label="accuracy (as served)")
    ax.plot(sizes, [100, *(_num(z.agreement) for z in summary.sizes)], "s--", label="agreement with alone")
    ax.plot(sizes, [0, *(z.split_failure_rate * 100 for z in summary.sizes)], "^:", label="split failures")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("batch size (1 = alone)")
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.set_title(f"{summary.model}: recommended max_batch {summary.recommended_max_batch}")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _num(value: float | None) -> float:
    return float("nan") if value is None else value * 100


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"
