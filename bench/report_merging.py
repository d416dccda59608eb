"""The merge-engine part of the benchmark report, from `bench/results/merging.json`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench import charts
from bench.markdown import fewer, more_ms, num, pct, ratio, run_line, table
from bench.merging import BUDGET_RUN, FLOAT_RUN, LONG_BUDGET_MS, P99_ALLOWANCE_MS

ISSUE = "merge engine"
DEFAULT_RUN = "merge/standard"  # the int8 similarity model, the broker's default

# (label, key, formatter, how a merged run compares with its passthrough)
MAIN_ROWS: tuple[tuple[str, str, Callable[[float], str], Callable[[float, float], str] | None], ...] = (
    ("upstream calls / request", "upstream_calls_per_request", lambda v: num(v, 3), fewer),
    ("upstream prompt tokens / request", "prompt_tokens_per_request", lambda v: num(v, 1), fewer),
    ("upstream completion tokens / request", "completion_tokens_per_request", lambda v: num(v, 1), None),
    ("merge rate (answered by a merged call)", "merge_rate", pct, None),
    ("mean batch size (requests / dispatch)", "mean_batch_size", lambda v: num(v, 2), None),
    ("split fallback rate", "split_fallback_rate", pct, None),
    ("sent unmerged: model slower than the similarity budget", "similarity_slow_rate", pct, None),
    ("answered from the response cache", "cache_hit_rate", pct, None),
    ("coalesced with an identical in-flight request", "coalesced_rate", pct, None),
    ("p50 latency (ms)", "p50_ms", lambda v: num(v, 0), more_ms),
    ("p99 latency (ms)", "p99_ms", lambda v: num(v, 0), more_ms),
    ("p99, requests answered by a merged call (ms)", "p99_ms_merged", lambda v: num(v, 0), None),
    ("p99, requests sent alone (ms)", "p99_ms_alone", lambda v: num(v, 0), None),
    ("mean queue wait (ms)", "queue_wait_ms_mean", lambda v: num(v, 1), more_ms),
    ("mean upstream call (ms)", "upstream_ms_mean", lambda v: num(v, 0), more_ms),
    ("broker CPU / request (ms)", "broker_cpu_ms_per_request", lambda v: num(v, 2), None),
    ("embedding CPU / request (ms)", "embedding_cpu_ms_per_request", lambda v: num(v, 2), None),
    ("embedding time / request (ms)", "embedding_ms_per_request", lambda v: num(v, 2), None),
    ("wrong answers", "wrong_answers", lambda v: str(int(v)), None),
    ("errors (non-200)", "errors", lambda v: str(int(v)), None),
)

# The rows that judge the similarity model: what it costs, and what it changes for merging and latency.
MODEL_ROWS = ("embedding_cpu_ms_per_request", "embedding_ms_per_request", "broker_cpu_ms_per_request",
              "upstream_calls_per_request", "merge_rate", "mean_batch_size", "similarity_slow_rate", "p50_ms", "p99_ms",
              "wrong_answers")


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return result["meta"]["plan"]["requests"] < 500


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets `bench.merging.check_targets` judged at run time."""
    return [{"issue": ISSUE, **t} for t in result["targets"]]


def _cell(fmt: Callable[[float], str], run: dict[str, Any], key: str) -> str:
    return fmt(run[key]) if key in run else "n/a"


def comparison_table(runs: dict[str, dict[str, Any]], pairs: Sequence[tuple[str, str]]) -> str:
    """Metrics as rows; for each (base, run) pair two columns and the change."""
    header = ["metric"]
    for base, run in pairs:
        header += [base, run, "change"]
    rows = []
    for label, key, fmt, change in MAIN_ROWS:
        row = [label]
        for base, run in pairs:
            b, r = runs[base], runs[run]
            row += [_cell(fmt, b, key), _cell(fmt, r, key), change(b[key], r[key]) if change else ""]
        rows.append(row)
    return table(header, rows)


def variant_table(scenarios: Sequence[tuple[str, dict[str, dict[str, Any]]]],
                  variants: Sequence[tuple[str, str]]) -> str:
    """Standard-tier variants side by side: per scenario, one column per (run name, label) in `variants`."""
    header = ["metric"] + [f"{name}: {label}" for name, _ in scenarios for _, label in variants]
    rows = [[label] + [_cell(fmt, runs[run], key) for _, runs in scenarios for run, _ in variants]
            for label, key, fmt, _ in MAIN_ROWS if key in MODEL_ROWS]
    return table(header, rows)


def sweep_table(points: list[dict[str, Any]], first: tuple[str, str, Callable[[Any], str]]) -> str:
    """One row per sweep point: the swept value, then cost, merging and latency figures."""
    label, key, fmt = first
    rows = [[fmt(p[key]), num(p["upstream_calls_per_request"], 3), num(p["prompt_tokens_per_request"], 1),
             pct(p["merge_rate"]), num(p["mean_batch_size"], 2), pct(p["split_fallback_rate"]), num(p["p50_ms"], 0),
             num(p["p99_ms"], 0), num(p["broker_cpu_ms_per_request"], 2),
             num(p.get("embedding_cpu_ms_per_request"), 2), str(p["wrong_answers"] + p["errors"])] for p in points]
    return table([label, "upstream calls / req", "prompt tokens / req", "merge rate", "mean batch", "split fallback",
                  "p50 ms", "p99 ms", "broker CPU ms / req", "embedding CPU ms / req", "wrong + errors"], rows)


def _latency_notes(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Where the extra latency of merging comes from, in numbers from this run."""
    notes = []
    for tier in ("batch", "standard"):
        base, run = runs[f"passthrough/{tier}"], runs[f"merge/{tier}"]
        notes.append(
            f"- {tier} tier: p99 {more_ms(base['p99_ms'], run['p99_ms'])} vs. passthrough. Per request, on average: "
            f"{num(run['queue_wait_ms_mean'], 0)} ms waiting for dispatch (merge window, then a free worker), "
            f"{num(run['embedding_ms_per_request'], 1)} ms of similarity embedding, and an upstream call of "
            f"{num(run['upstream_ms_mean'], 0)} ms instead of {num(base['upstream_ms_mean'], 0)} ms (a merged reply "
            f"carries every member's answer: "
            f"{num(ratio(run['completion_tokens_per_request'], run['upstream_calls_per_request']), 0)} completion "
            f"tokens per upstream call on average vs. "
            f"{num(ratio(base['completion_tokens_per_request'], base['upstream_calls_per_request']), 0)}).")
    return notes


def findings(m: dict[str, Any]) -> list[str]:
    """The headline results of a merge run, as bullet points built from its numbers."""
    runs, burst, rate = m["main"]["runs"], m["burst"]["runs"], m["main"]["rate"]
    pb, mb, ps, ms = runs["passthrough/batch"], runs["merge/batch"], runs["passthrough/standard"], runs[DEFAULT_RUN]
    everything = [*runs.values(), *burst.values()] + [p for k in ("threshold_sweep", "window_sweep", "rate_sweep")
                                                      for p in m[k]["points"]]
    bm = burst[DEFAULT_RUN]
    out = [f"- Merging, batch tier at {rate:g} req/s: "
           f"{fewer(pb['upstream_calls_per_request'], mb['upstream_calls_per_request'])} upstream calls and "
           f"{fewer(pb['prompt_tokens_per_request'], mb['prompt_tokens_per_request'])} prompt tokens than "
           f"passthrough; {pct(mb['merge_rate'])} of requests answered by a merged call (mean "
           f"{num(mb['mean_batch_size'], 1)} requests per dispatch), split fallbacks {pct(mb['split_fallback_rate'])}. "
           f"Wrong answers over all {sum(r['requests'] for r in everything):,} requests: "
           f"{sum(r['wrong_answers'] for r in everything)}.",
           f"- Merging, standard tier (similarity threshold, int8 model): "
           f"{fewer(ps['upstream_calls_per_request'], ms['upstream_calls_per_request'])} upstream calls, merge rate "
           f"{pct(ms['merge_rate'])}, p99 {more_ms(ps['p99_ms'], ms['p99_ms'])} vs. passthrough; the model costs "
           f"{num(ms['embedding_cpu_ms_per_request'], 2)} ms of CPU per request ({num(ms['embedding_calls'], 0)} "
           f"groups embedded within their budget for {ms['requests']} requests). Hot-question bursts: "
           f"{fewer(burst['passthrough/standard']['upstream_calls_per_request'], bm['upstream_calls_per_request'])}"
           f" upstream calls ({num(bm['mean_batch_size'], 2)} requests per call), embedding CPU "
           f"{num(bm['embedding_cpu_ms_per_request'], 2)} ms per request."]
    out += _model_finding(runs, burst)
    out += _budget_finding(m)
    out += _latency_finding(m)
    for r in (r for r in everything if r["errors"]):
        statuses = ", ".join(f"{n} x HTTP {code}" for code, n in (r.get("error_statuses") or {}).items())
        reasons = ", ".join(f"{reason} {int(n)}" for reason, n in (r.get("rejected") or {}).items())
        out.append(f"- Errors in run '{r['name']}': {r['errors']} ({statuses or 'non-200'}"
                   f"{'; broker rejections: ' + reasons if reasons else ''}).")
    return out


def _model_finding(runs: dict[str, dict[str, Any]], burst: dict[str, dict[str, Any]]) -> list[str]:
    """Float vs. int8 similarity model: cost and effect, main workload and bursts."""
    if FLOAT_RUN not in runs:
        return []
    parts = []
    for label, scenario in (("mixed workload", runs), ("bursts", burst)):
        f, q = scenario[FLOAT_RUN], scenario[DEFAULT_RUN]
        parts.append(
            f"{label}: embedding CPU {num(q['embedding_cpu_ms_per_request'], 2)} vs. "
            f"{num(f['embedding_cpu_ms_per_request'], 2)} ms per request "
            f"({num(ratio(f['embedding_cpu_ms_per_request'], q['embedding_cpu_ms_per_request']), 1)}x less), upstream "
            f"calls {num(q['upstream_calls_per_request'], 3)} vs. {num(f['upstream_calls_per_request'], 3)} per "
            f"request, merge rate {pct(q['merge_rate'])} vs. {pct(f['merge_rate'])} (sent unmerged because the model "
            f"missed its budget: {pct(q.get('similarity_slow_rate'))} vs. {pct(f.get('similarity_slow_rate'))}), "
            f"p99 {num(q['p99_ms'], 0)} vs. "
            f"{num(f['p99_ms'], 0)} ms, wrong answers {q['wrong_answers']} vs. {f['wrong_answers']}")
    return ["- Similarity model, int8 (default) vs. float, standard tier: " + "; ".join(parts) + "."]


def _budget_finding(m: dict[str, Any]) -> list[str]:
    """What the similarity budget costs in merging, and whether a longer one would meet the burst goal."""
    runs, burst = m["main"]["runs"], m["burst"]["runs"]
    if BUDGET_RUN not in runs:
        return []
    base = burst["passthrough/standard"]["upstream_calls_per_request"]
    parts = []
    for label, scenario in (("bursts", burst), ("mixed workload", runs)):
        d, b = scenario[DEFAULT_RUN], scenario[BUDGET_RUN]
        parts.append(
            f"{label}: {pct(d['similarity_slow_rate'])} of requests sent unmerged because the model missed the "
            f"default budget vs. {pct(b['similarity_slow_rate'])} with {LONG_BUDGET_MS:g} ms, merge rate "
            f"{pct(d['merge_rate'])} vs. {pct(b['merge_rate'])}, upstream calls "
            f"{num(d['upstream_calls_per_request'], 3)} vs. {num(b['upstream_calls_per_request'], 3)} per request, "
            f"p99 {num(d['p99_ms'], 0)} vs. {num(b['p99_ms'], 0)} ms")
    text = "- Similarity budget (int8 model), default vs. " + f"{LONG_BUDGET_MS:g} ms: " + "; ".join(parts) + "."
    burst_goal = next((t for t in m["targets"] if t["name"].startswith("standard tier bursts")), None)
    if burst_goal and not burst_goal["met"]:
        longer = ratio(base, burst[BUDGET_RUN]["upstream_calls_per_request"])
        text += (f" Why the bursts goal is missed: {m['burst']['versions']} versions within "
                 f"{m['burst']['spread_ms']:g} ms make groups the model cannot embed within the default budget, so "
                 f"{pct(burst[DEFAULT_RUN]['similarity_slow_rate'])} of them go out unmerged "
                 f"({num(burst_goal['value'], 2)}x fewer calls than passthrough); with a {LONG_BUDGET_MS:g} ms budget "
                 f"the bursts make {num(longer, 2)}x fewer calls (goal >= {burst_goal['target']:g}).")
    return [text]


def _latency_finding(m: dict[str, Any]) -> list[str]:
    """Why a p99 target was missed, from the run's own decomposition of the added latency."""
    missed = {t["name"]: t for t in m["targets"] if not t["met"]}
    out = []
    for tier in ("batch", "standard"):
        target = missed.get(f"{tier} tier: p99 above passthrough (ms)")
        if target is None:
            continue
        base, run = m["main"]["runs"][f"passthrough/{tier}"], m["main"]["runs"][f"merge/{tier}"]
        per_call = [ratio(r["completion_tokens_per_request"], r["upstream_calls_per_request"]) for r in (run, base)]
        longer = run["upstream_ms_mean"] - base["upstream_ms_mean"]
        text = (f"- Why the {tier} tier's p99 goal is missed (window {target['target'] - P99_ALLOWANCE_MS:g} ms + "
                f"{P99_ALLOWANCE_MS:g} ms allowed, {more_ms(base['p99_ms'], run['p99_ms'])} measured): "
                f"{_tail(run, base)}. Per request on "
                f"average {num(run['queue_wait_ms_mean'], 0)} ms waiting for dispatch (the window), "
                f"{num(run['embedding_ms_per_request'], 1)} ms of similarity embedding, and an upstream call "
                f"{longer:+,.0f} ms longer than passthrough's, because a merged reply generates every member's answer "
                f"({num(per_call[0], 0)} completion tokens per call vs. {num(per_call[1], 0)}).")
        if longer > P99_ALLOWANCE_MS:
            text += (f" The longer upstream call alone exceeds the {P99_ALLOWANCE_MS:g} ms allowance: with an upstream "
                     "whose time grows with output length, window + 50 ms cannot hold for merged calls.")
        out.append(text)
    return out


def _tail(run: dict[str, Any], base: dict[str, Any]) -> str:
    """Which requests make the p99: those answered by a merged call, or those sent alone."""
    merged, alone = run.get("p99_ms_merged"), run.get("p99_ms_alone")
    figures = (f"p99 {num(merged, 0)} ms for requests answered by a merged call, {num(alone, 0)} ms for those "
               f"sent alone, {num(base['p99_ms'], 0)} ms in passthrough")
    text = f"the tail is the merged requests ({figures})" if merged and alone and merged > alone else figures
    if alone and alone > base["p99_ms"]:
        text += (f"; requests sent alone are {more_ms(base['p99_ms'], alone)} at p99 too (they also wait for the "
                 "window, and for the model up to the similarity budget)")
    return text


def sections(m: dict[str, Any], images: dict[str, str]) -> list[str]:
    """Main comparison, model comparison, bursts and the three sweeps."""
    meta, main, burst = m["meta"], m["main"], m["burst"]
    runs = main["runs"]
    out = [
        "## Merge engine (issue: merge engine)", "",
        f"Workload: {main['requests']} chat requests (`temperature: 0`) with Poisson arrivals at "
        f"{main['rate']:g} req/s: 40 % paraphrase clusters (5 wordings of one question asked close together), "
        "20 % exact repeats of an earlier question, 40 % distinct questions; every request carries one of three "
        "long system prompts (185-226 tokens), so up to three merge groups are open at once. "
        f"Upstream: the simulator with `{' '.join(meta['simulator_options'])}` (a reply takes 300 ms plus 2 ms "
        "per completion token, so a merged reply, which carries every member's answer, takes longer). "
        "Passthrough is the same broker with `merge.enabled: false` (cache and in-flight coalescing stay on, "
        "so the comparison isolates merging). Each run uses a fresh broker process after a short warm-up. "
        "Every reply is checked against the simulator's `answer_for(question)`. Embedding CPU is the CPU time "
        "of the broker's threads other than the event loop, i.e. the similarity model's worker thread; "
        "embedding time is the wall time of the model calls that finished within the similarity budget "
        "(`mergebroker_embedding_seconds`), spread over all requests.", "",
        run_line(meta, "merge benchmark"), "",
        comparison_table(runs, [("passthrough/batch", "merge/batch"), ("passthrough/standard", DEFAULT_RUN)]), "",
        f"![Latency CDF]({images['latency_cdf']})", "",
        *_latency_notes(runs), "",
        "### Hot-question bursts (standard tier)", "",
        f"{burst['bursts']} bursts, each {burst['versions']} differently worded versions of one question arriving "
        f"within {burst['spread_ms']:g} ms (a new question per burst, so the cache cannot answer a later burst).", "",
        comparison_table(burst["runs"], [("passthrough/standard", DEFAULT_RUN)]), "",
    ]
    scenarios = [("mixed", runs), ("bursts", burst["runs"])]
    if FLOAT_RUN in runs:
        out += ["### Similarity model: float vs. int8 (standard tier)", "",
                "The same workloads on the standard tier (similarity threshold 0.85) with `merge.embedder: local` "
                "(the float all-MiniLM-L6-v2) and with `local-onnx` (its int8 copy on onnxruntime, the default). "
                "Both run on the default `embeddings.model_threads` (2).", "",
                variant_table(scenarios, [(FLOAT_RUN, "`local` (float)"), (DEFAULT_RUN, "`local-onnx` (default)")]),
                ""]
    if BUDGET_RUN in runs:
        out += ["### Similarity budget (standard tier)", "",
                "A group whose vectors are not ready within the tier's `similarity_budget_ms` goes out unmerged. "
                f"The default budget (the tier's window, at least 50 ms) beside {LONG_BUDGET_MS:g} ms, int8 model.", "",
                variant_table(scenarios, [(DEFAULT_RUN, "default budget"), (BUDGET_RUN, f"{LONG_BUDGET_MS:g} ms")]),
                ""]
    out += ["### Similarity threshold (batch tier)", "",
            sweep_table(m["threshold_sweep"]["points"], ("threshold", "threshold", lambda v: f"{v:g}")), "",
            f"![Threshold sweep]({images['threshold_sweep']})", "",
            "### Merge window (batch tier)", "",
            sweep_table(m["window_sweep"]["points"], ("window ms", "window_ms", lambda v: f"{v:g}")), "",
            f"![Window sweep]({images['window_sweep']})", "",
            "### Arrival rate (batch tier)", "",
            sweep_table(m["rate_sweep"]["points"], ("req/s", "rate", lambda v: f"{v:g}")), "",
            f"![Rate sweep]({images['rate_sweep']})", ""]
    return out


def figures(m: dict[str, Any]) -> dict[str, Any]:
    """Latency CDF and the three sweeps."""
    return {"latency_cdf": charts.latency_cdf(m["main"]),
            "threshold_sweep": charts.threshold_sweep(m["threshold_sweep"]),
            "window_sweep": charts.window_sweep(m["window_sweep"]), "rate_sweep": charts.rate_sweep(m["rate_sweep"])}
