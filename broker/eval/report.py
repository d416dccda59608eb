"""Summarise an evaluation (pure) and render it: Markdown, JSON and an optional chart.

Definitions, per batch size (the alone run is the reference):
- accuracy: mean score of each answer against its `expected` (`merge.fidelity.compare`: exact match after
  normalising for short answers), over the requests that have one. Merged accuracy is what callers would
  get: a block's answer, or for a member whose block failed, its answer alone (production re-sends it).
- agreement: mean fidelity of the block answers against the same requests' answers alone.
- merged accuracy: the same, over the members answered by their block only (the re-sent ones left out):
  what merging itself gets right.
- agreement: mean fidelity of the block answers against the same requests' answers alone.
- split failure rate: members whose block failed (missing, malformed, leak, failed call...) / members.
- calls, tokens and dollars: merged calls plus the alone calls of fallbacks (the re-sends production
  makes), against one call per request alone; dollars at the model's price (`--price`, or the shipped
  table), with the cached tokens each call reported, None where the model has no price.
- latency: per member, its merged call (plus its alone call after a fallback).
- recommended max_batch: the largest batch size such that it and every smaller one pass every check:
  most of its members split (a failure rate of at most `MAX_SPLIT_FAILURE_RATE`), its merged accuracy
  (or, without expected answers, its agreement) within `tolerance` points of alone, and its calls,
  tokens and dollars, re-sends included, below sending alone. 1 means do not merge, and the report says
  which check the first size failed.
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
from mergebroker.merge.pricing import ModelPrice, cost_usd

Scorer = Callable[[str, str], float]
"""(answer, reference) -> 0..1."""

MAX_SPLIT_FAILURE_RATE = 0.5
"""A batch size whose members fail to split more often than this is not recommended: the model does not
follow the merged format, whatever the re-sent answers score."""


@dataclass(frozen=True)
class SizeSummary:
    """The figures of one batch size."""

    batch_size: int
    merged_calls: int
    fallbacks: int
    split_failure_rate: float
    failure_reasons: dict[str, int]
    accuracy: float | None
    merged_accuracy: float | None
    agreement: float | None
    calls: int
    calls_saved: int
    tokens: int
    tokens_saved: int
    usd: float | None
    usd_saved: float | None
    latency_p50_s: float
    latency_p95_s: float
    rejected_because: str | None = None  # the first check it fails (None: it passes every one)


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
    alone_usd: float | None
    alone_latency_p50_s: float
    alone_latency_p95_s: float
    sizes: tuple[SizeSummary, ...]
    metric: str
    tolerance_points: float
    recommended_max_batch: int
    reason: str  # why that size: what it passed, or what the next size (the first, for 1) failed


def default_scorer(answer: str, reference: str) -> float:
    """`merge.fidelity.compare` without embeddings (word overlap stands in for prose)."""
    return compare(answer, reference).score


def summarise(obs: Observation, *, model: str, upstream: str, seed: int, tolerance_points: float = 2.0,
              scorer: Scorer = default_scorer, price: ModelPrice | None = None) -> EvalSummary:
    """The figures of an evaluation (see the module docstring); dollars at `price` where given."""
    expected = [r.expected for r in obs.requests]
    alone_texts = [c.text for c in obs.alone]
    alone_accuracy = _accuracy(alone_texts, expected, scorer)
    metric = "accuracy" if alone_accuracy is not None else "agreement"
    reference = alone_accuracy if alone_accuracy is not None else 1.0
    alone_usd = _usd(obs.alone, price)
    alone = _Alone(metric, reference, tolerance_points, len(obs.alone), _tokens(obs.alone), alone_usd)
    sizes = tuple(alone.judge(_size(run, obs.alone, expected, scorer, price)) for run in obs.merged)
    best, reason = recommend(sizes, metric)
    latencies = [c.latency_s for c in obs.alone]
    return EvalSummary(
        model=model, upstream=upstream, seed=seed, requests=len(obs.requests),
        with_expected=sum(e is not None for e in expected), alone_accuracy=alone_accuracy,
        alone_failed=sum(t is None for t in alone_texts), alone_calls=len(obs.alone),
        alone_tokens=_tokens(obs.alone), alone_usd=alone_usd, alone_latency_p50_s=_quantile(latencies, 0.5),
        alone_latency_p95_s=_quantile(latencies, 0.95), sizes=sizes, metric=metric,
        tolerance_points=tolerance_points, recommended_max_batch=best, reason=reason)


@dataclass(frozen=True)
class _Alone:
    """The reference every batch size is judged against."""

    metric: str
    reference: float
    tolerance_points: float
    calls: int
    tokens: int
    usd: float | None

    def judge(self, size: SizeSummary) -> SizeSummary:
        """`size` with the first check it fails (the module docstring's order), or none."""
        return dataclasses.replace(size, rejected_because=self._first_failure(size))

    def _first_failure(self, z: SizeSummary) -> str | None:
        if z.split_failure_rate > MAX_SPLIT_FAILURE_RATE:
            return f"{z.split_failure_rate:.0%} of its members failed to split and were re-sent alone"
        value = z.merged_accuracy if self.metric == "accuracy" else z.agreement
        if value is None:
            return f"no member was answered by its block, so its {self.metric} is unknown"
        if (self.reference - value) * 100 > self.tolerance_points + 1e-9:
            return (f"its merged answers' {self.metric} ({value:.1%}) is more than {self.tolerance_points:g} "
                    f"points below alone ({self.reference:.1%})")
        if z.calls >= self.calls:
            return f"it makes {z.calls} calls, re-sends included, against {self.calls} alone"
        if z.tokens >= self.tokens:
            return f"it costs {z.tokens:,} tokens, re-sends included, against {self.tokens:,} alone"
        if z.usd is not None and self.usd is not None and z.usd >= self.usd:
            return f"it costs ${z.usd:.4f}, re-sends included, against ${self.usd:.4f} alone"
        return None


def recommend(sizes: Sequence[SizeSummary], metric: str = "accuracy") -> tuple[int, str]:
    """The largest batch size that, with every smaller one, passes every check (`SizeSummary.rejected_because`
    set by the summary), and why."""
    best: SizeSummary | None = None
    for size in sorted(sizes, key=lambda z: z.batch_size):
        if size.rejected_because is not None:
            why = f"a batch of {size.batch_size} is not: {size.rejected_because}"
            if best is None:
                return 1, f"do not merge: {why}"
            return best.batch_size, f"a batch of {best.batch_size} passes every check; {why}"
        best = size
    if best is None:
        return 1, "no batch size was evaluated"
    return best.batch_size, (f"a batch of {best.batch_size} passes every check ({metric} within tolerance, "
                             "calls, tokens and dollars below alone), the largest evaluated")


def _size(run: MergedRun, alone: Sequence[CallResult], expected: Sequence[str | None], scorer: Scorer,
          price: ModelPrice | None) -> SizeSummary:
    served: list[str | None] = []
    merged_only: list[tuple[str | None, str | None]] = []  # (block answer, expected) of the members that split
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
        merged_only.append((member.block_answer, expected[member.index]))
        latencies.append(member.latency_s)
        if own.text is not None and member.block_answer is not None:
            agreement.append(scorer(member.block_answer, own.text))
    ordered_expected = [expected[m.index] for m in run.members]
    calls = len(run.calls) + len(fallback_calls)
    tokens = _tokens(run.calls) + _tokens(fallback_calls)
    usd = _usd([*run.calls, *fallback_calls], price)
    alone_usd = _usd(alone, price)
    fallbacks = sum(reasons.values())
    return SizeSummary(
        batch_size=run.batch_size, merged_calls=len(run.calls), fallbacks=fallbacks,
        split_failure_rate=fallbacks / len(run.members) if run.members else 0.0,
        failure_reasons=dict(sorted(reasons.items())), accuracy=_accuracy(served, ordered_expected, scorer),
        merged_accuracy=_accuracy([a for a, _ in merged_only], [e for _, e in merged_only], scorer),
        agreement=statistics.fmean(agreement) if agreement else None, calls=calls,
        calls_saved=len(alone) - calls, tokens=tokens, tokens_saved=_tokens(alone) - tokens,
        usd=usd, usd_saved=None if usd is None or alone_usd is None else alone_usd - usd,
        latency_p50_s=_quantile(latencies, 0.5), latency_p95_s=_quantile(latencies, 0.95))


def _accuracy(answers: Sequence[str | None], expected: Sequence[str | None], scorer: Scorer) -> float | None:
    scores = [0.0 if a is None else scorer(a, e) for a, e in zip(answers, expected) if e is not None]
    return statistics.fmean(scores) if scores else None


def _tokens(calls: Sequence[CallResult]) -> int:
    return sum(c.prompt_tokens + c.completion_tokens for c in calls)


def _usd(calls: Sequence[CallResult], price: ModelPrice | None) -> float | None:
    if price is None:
        return None
    return sum(cost_usd(price, c.prompt_tokens, min(c.cached_tokens, c.prompt_tokens), 0, c.completion_tokens)
               for c in calls)


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
             f"{s.alone_calls} calls, {s.alone_tokens:,} tokens, {_money(s.alone_usd)}, latency p50 "
             f"{s.alone_latency_p50_s:.3f} s, p95 {s.alone_latency_p95_s:.3f} s.", "",
             "Accuracy as served counts the re-sent members' alone answers; merged accuracy counts only the members "
             "their block answered. Calls, tokens and dollars include the re-sends.", "",
             "| batch size | accuracy alone | as served | merged | agreement | split failures | calls (saved) "
             "| tokens (saved) | dollars (saved) | latency p50 / p95 | verdict |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for z in s.sizes:
        dollars = "n/a" if z.usd is None else f"{_money(z.usd)} ({_money(z.usd_saved, signed=True)})"
        lines.append(f"| {z.batch_size} | {_pct(s.alone_accuracy)} | {_pct(z.accuracy)} | {_pct(z.merged_accuracy)} "
                     f"| {_pct(z.agreement)} | {z.split_failure_rate:.1%} | {z.calls} ({z.calls_saved:+}) "
                     f"| {z.tokens:,} ({z.tokens_saved:+,}) | {dollars} "
                     f"| {z.latency_p50_s:.3f} / {z.latency_p95_s:.3f} s | {z.rejected_because or 'passes'} |")
    lines += ["", "Split failures by reason (members re-sent alone):", ""]
    for z in s.sizes:
        reasons = ", ".join(f"{k} {v}" for k, v in z.failure_reasons.items()) or "none"
        lines.append(f"- batch of {z.batch_size}: {reasons}")
    if chart:
        lines += ["", f"![{s.metric} by batch size]({chart})"]
    verdict = ("merging is not recommended for this model (keep `max_batch: 1`)" if s.recommended_max_batch == 1
               else f"`max_batch: {s.recommended_max_batch}`")
    lines += ["", "## Recommendation", "",
              f"Recommended for {s.model}: {verdict}. Why: {s.reason}.", "",
              f"A size is recommended when it and every smaller one pass: at most {MAX_SPLIT_FAILURE_RATE:.0%} of "
              f"members fail to split, merged {s.metric} within {s.tolerance_points:g} points of alone, and "
              "calls, tokens and dollars (re-sends included) below alone.", ""]
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


def _money(value: float | None, *, signed: bool = False) -> str:
    if value is None:
        return "unpriced"
    return f"{'+' if signed and value >= 0 else ''}{'-' if value < 0 else ''}${abs(value):.4f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"
