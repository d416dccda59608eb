"""`python -m bench.report [--quick] [--from-results]`: run the merge and embedding benchmarks, write docs.

Runs `bench.merging` and `bench.embeddings` (or, with `--from-results`, reads their JSON from
`bench/results/`), then writes `docs/benchmarks.md` with tables and PNG charts in `docs/img/`.
A `--quick` run is smoke-sized; unless told otherwise it writes under `bench/results/quick/` so it never
overwrites the real report. `main(argv)` is what `mergebroker bench` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any, Callable, Sequence

from bench import charts

BENCH_DIR = Path(__file__).parent
RESULTS_DIR = BENCH_DIR / "results"
DOCS_DIR = BENCH_DIR.parent / "docs"
QUICK_DIR = RESULTS_DIR / "quick"
PINNED = "merge/standard, torch 1 thread"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def num(value: float, digits: int = 2) -> str:
    """A number for a table cell: fixed digits, thousands kept readable."""
    return f"{value:,.{digits}f}"


def pct(value: float) -> str:
    return f"{100 * value:.1f} %"


def fewer(base: float, run: float) -> str:
    """How many times fewer `run` is than `base`, e.g. "5.1x fewer"."""
    return f"{base / run:.1f}x fewer" if run else "n/a"


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def more_ms(base: float, run: float) -> str:
    return f"{run - base:+,.0f} ms"


# (label, key, formatter, how a merged run compares with its passthrough)
MAIN_ROWS: tuple[tuple[str, str, Callable[[float], str], Callable[[float, float], str] | None], ...] = (
    ("upstream calls / request", "upstream_calls_per_request", lambda v: num(v, 3), fewer),
    ("upstream prompt tokens / request", "prompt_tokens_per_request", lambda v: num(v, 1), fewer),
    ("upstream completion tokens / request", "completion_tokens_per_request", lambda v: num(v, 1), None),
    ("merge rate (answered by a merged call)", "merge_rate", pct, None),
    ("mean batch size (requests / dispatch)", "mean_batch_size", lambda v: num(v, 2), None),
    ("split fallback rate", "split_fallback_rate", pct, None),
    ("answered from the response cache", "cache_hit_rate", pct, None),
    ("coalesced with an identical in-flight request", "coalesced_rate", pct, None),
    ("p50 latency (ms)", "p50_ms", lambda v: num(v, 0), more_ms),
    ("p99 latency (ms)", "p99_ms", lambda v: num(v, 0), more_ms),
    ("mean queue wait (ms)", "queue_wait_ms_mean", lambda v: num(v, 1), more_ms),
    ("mean upstream call (ms)", "upstream_ms_mean", lambda v: num(v, 0), more_ms),
    ("broker CPU / request (ms)", "broker_cpu_ms_per_request", lambda v: num(v, 2), None),
    ("embedding time / request (ms)", "embedding_ms_per_request", lambda v: num(v, 2), None),
    ("wrong answers", "wrong_answers", lambda v: str(int(v)), None),
    ("errors (non-200)", "errors", lambda v: str(int(v)), None),
)


def comparison_table(runs: dict[str, dict[str, Any]], pairs: Sequence[tuple[str, str]],
                     extra: Sequence[str] = ()) -> str:
    """Metrics as rows; for each (passthrough, merge) pair two columns and the change; then `extra` runs."""
    header = ["metric"]
    for base, run in pairs:
        header += [base, run, "change"]
    header += list(extra)
    rows = []
    for label, key, fmt, change in MAIN_ROWS:
        row = [label]
        for base, run in pairs:
            b, r = runs[base][key], runs[run][key]
            row += [fmt(b), fmt(r), change(b, r) if change else ""]
        row += [fmt(runs[name][key]) for name in extra]
        rows.append(row)
    return table(header, rows)


def sweep_table(points: list[dict[str, Any]], first: tuple[str, str, Callable[[Any], str]]) -> str:
    """One row per sweep point: the swept value, then cost, merging and latency figures."""
    label, key, fmt = first
    rows = [[fmt(p[key]), num(p["upstream_calls_per_request"], 3), num(p["prompt_tokens_per_request"], 1),
             pct(p["merge_rate"]), num(p["mean_batch_size"], 2), pct(p["split_fallback_rate"]), num(p["p50_ms"], 0),
             num(p["p99_ms"], 0), num(p["broker_cpu_ms_per_request"], 2), num(p["embedding_ms_per_request"], 2),
             str(p["wrong_answers"] + p["errors"])] for p in points]
    return table([label, "upstream calls / req", "prompt tokens / req", "merge rate", "mean batch", "split fallback",
                  "p50 ms", "p99 ms", "broker CPU ms / req", "embedding ms / req", "wrong + errors"], rows)


def targets_section(targets: list[dict[str, Any]]) -> list[str]:
    rows = [[t["name"], f"{t['op']} {t['target']:g}", num(t["value"], 2), "met" if t["met"] else "**missed**"]
            for t in targets]
    return ["## Targets", "", table(["target", "goal", "measured", "result"], rows), ""]


def merging_sections(m: dict[str, Any], images: dict[str, str]) -> list[str]:
    """The merge-engine part of the report."""
    meta, main, burst = m["meta"], m["main"], m["burst"]
    runs = main["runs"]
    out = [
        "## Merge engine", "",
        f"Workload: {main['requests']} chat requests (`temperature: 0`) with Poisson arrivals at "
        f"{main['rate']:g} req/s: 40 % paraphrase clusters (5 wordings of one question asked close together), "
        "20 % exact repeats of an earlier question, 40 % distinct questions; every request carries one of three "
        "long system prompts (185-226 tokens), so up to three merge groups are open at once. "
        f"Upstream: the simulator with `{' '.join(meta['simulator_options'])}` (a reply takes 300 ms plus 2 ms "
        "per completion token, so a merged reply, which carries every member's answer, takes longer). "
        "Passthrough is the same broker with `merge.enabled: false` (cache and in-flight coalescing stay on, "
        "so the comparison isolates merging). Each run uses a fresh broker process after a short warm-up. "
        "Every reply is checked against the simulator's `answer_for(question)`.", "",
        comparison_table(runs, [("passthrough/batch", "merge/batch"), ("passthrough/standard", "merge/standard")],
                         extra=[PINNED] if PINNED in runs else []), "",
        f"![Latency CDF]({images['latency_cdf']})", "",
        *_latency_notes(runs), "",
        "### Hot-question bursts (standard tier)", "",
        f"{burst['bursts']} bursts, each {burst['versions']} differently worded versions of one question arriving "
        f"within {burst['spread_ms']:g} ms (a new question per burst, so the cache cannot answer a later burst).", "",
        comparison_table(burst["runs"], [("passthrough/standard", "merge/standard")],
                         extra=[PINNED] if PINNED in burst["runs"] else []), "",
    ]
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
            f"{num(_ratio(run['completion_tokens_per_request'], run['upstream_calls_per_request']), 0)} completion "
            f"tokens per upstream call on average vs. "
            f"{num(_ratio(base['completion_tokens_per_request'], base['upstream_calls_per_request']), 0)}, at 2 ms each).")
    return notes


def merge_findings(m: dict[str, Any]) -> list[str]:
    """The headline results and the hot spots of a merge run, as bullet points built from its numbers."""
    runs, burst, rate = m["main"]["runs"], m["burst"]["runs"], m["main"]["rate"]
    pb, mb = runs["passthrough/batch"], runs["merge/batch"]
    everything = [*runs.values(), *burst.values()] + [p for k in ("threshold_sweep", "window_sweep", "rate_sweep")
                                                      for p in m[k]["points"]]
    out = [f"- Batch tier at {rate:g} req/s: {fewer(pb['upstream_calls_per_request'], mb['upstream_calls_per_request'])}"
           f" upstream calls and {fewer(pb['prompt_tokens_per_request'], mb['prompt_tokens_per_request'])} prompt "
           f"tokens than passthrough; {pct(mb['merge_rate'])} of requests answered by a merged call (mean "
           f"{num(mb['mean_batch_size'], 1)} requests per dispatch), split fallbacks {pct(mb['split_fallback_rate'])}. "
           f"{pct(mb['cache_hit_rate'] + mb['coalesced_rate'])} were answered from the response cache or "
           "coalesced with an identical request in flight. "
           f"Wrong answers over all {sum(r['requests'] for r in everything):,} requests: "
           f"{sum(r['wrong_answers'] for r in everything)}.",
           f"- Hot-question bursts, standard tier: "
           f"{fewer(burst['passthrough/standard']['upstream_calls_per_request'], burst['merge/standard']['upstream_calls_per_request'])}"
           f" upstream calls ({num(burst['merge/standard']['mean_batch_size'], 2)} requests per call; the tier's "
           "max_batch is 4).",
           f"- Latency: merging on the batch tier adds {more_ms(pb['p99_ms'], mb['p99_ms'])} at p99: the window "
           f"({num(mb['queue_wait_ms_mean'], 0)} ms mean wait) plus a longer upstream call "
           f"({num(mb['upstream_ms_mean'], 0)} vs. {num(pb['upstream_ms_mean'], 0)} ms), because a merged reply "
           "generates every member's answer. The 'window + 50 ms' target cannot hold when the upstream's time "
           "grows with output length, as real models' does."]
    out += _hot_spots(m, runs, burst)
    failed = [r for r in everything if r["errors"]]
    for r in failed:
        statuses = ", ".join(f"{n} x HTTP {code}" for code, n in (r.get("error_statuses") or {}).items())
        reasons = ", ".join(f"{reason} {int(n)}" for reason, n in (r.get("rejected") or {}).items())
        out.append(f"- Errors in run '{r['name']}': {r['errors']} ({statuses or 'non-200'}"
                   f"{'; broker rejections: ' + reasons if reasons else ''}).")
    return out


def _hot_spots(m: dict[str, Any], runs: dict[str, dict[str, Any]], burst: dict[str, dict[str, Any]]) -> list[str]:
    if PINNED not in runs:
        return []
    as_is, pinned, base = runs["merge/standard"], runs[PINNED], runs["passthrough/standard"]
    out = []
    if as_is["broker_cpu_ms_per_request"] > 1.5 * pinned["broker_cpu_ms_per_request"]:
        out.append(
            f"- Hot spot 1, torch threads: merging on the standard tier costs "
            f"{num(as_is['broker_cpu_ms_per_request'], 1)} ms of broker CPU per request as the broker ships and "
            f"{num(pinned['broker_cpu_ms_per_request'], 1)} ms with the broker started under `OMP_NUM_THREADS=1` "
            f"(embedding time per request {num(as_is['embedding_ms_per_request'], 0)} vs. "
            f"{num(pinned['embedding_ms_per_request'], 0)} ms; p99 {num(as_is['p99_ms'], 0)} vs. "
            f"{num(pinned['p99_ms'], 0)} ms; bursts: CPU {num(burst['merge/standard']['broker_cpu_ms_per_request'], 1)} "
            f"vs. {num(burst[PINNED]['broker_cpu_ms_per_request'], 1)} ms per request). "
            "`SentenceModelHost` runs torch on its worker thread without setting a thread count, and torch's "
            "intra-op pool then makes small encode calls several times costlier in CPU and, when the host is "
            "busy, in time (pytorch/pytorch#37259; the size of the effect varies from run to run). Fix: call `torch.set_num_threads(n)` on the worker thread from a setting "
            "(e.g. `embeddings.threads`, default 1 on small hosts); `SentenceModelHost(threads=...)` already "
            "supports it, `create_app` does not pass it.")
    if pinned["embedding_ms_per_request"] > 2:
        calls_per_s = pinned["embedding_calls"] / pinned["wall_s"] if pinned["wall_s"] else 0.0
        out.append(
            f"- Hot spot 2, one embedding call per released group: even pinned, merging on the standard tier costs "
            f"{num(pinned['broker_cpu_ms_per_request'] - base['broker_cpu_ms_per_request'], 1)} ms more broker "
            f"CPU per request than passthrough, nearly all of it the model, run as {num(calls_per_s, 0)} small "
            "encode calls per second serialised on the model's one thread. On this "
            f"{m['meta']['cpus']}-CPU host, shared with the simulator and the load generator, the calls queue: "
            f"{num(pinned['embedding_ms_per_request'], 0)} ms of embedding per request on average, p50 "
            f"{num(pinned['p50_ms'], 0)} ms. Proposed: (a) compute a request's vector when it is admitted, "
            "through the batcher that already serves /v1/embeddings (cache, coalescing, window batching across "
            "groups), so the work overlaps the merge window and runs in larger, cheaper batches; (b) never let a "
            "worker wait on the model: a group whose vectors are not ready when its window closes is dispatched "
            "unmerged, so a slow model cannot fill the queue"
            + (" (the as-shipped run's errors)." if as_is["errors"] else "."))
    return out


def embedding_findings(e: dict[str, Any]) -> list[str]:
    """Headline embedding results: batching speed-up, cache latency, share of repeated texts reaching the model."""
    by_name = {s["name"]: {lvl["concurrency"]: lvl for lvl in s["levels"]} for s in e["matrix"]}
    out = []
    for suffix in ("", ", torch 1 thread"):
        single, batched = by_name.get("one text per call" + suffix, {}), by_name.get("window batching" + suffix, {})
        for conc in sorted(set(single) & set(batched)):
            a, b = single[conc], batched[conc]
            out.append(f"- Embeddings{suffix}, {conc} {'client' if conc == 1 else 'clients'}: window batching "
                       f"{num(b['texts_per_s'], 0)} texts/s (p99 {num(b['p99_ms'], 0)} ms, "
                       f"{num(b['mean_batch_size'], 1)} texts per model call) vs. one text per call "
                       f"{num(a['texts_per_s'], 0)} texts/s (p99 {num(a['p99_ms'], 0)} ms).")
    cache = e["cache"]
    out.append(f"- Embedding cache: L1 hit p50 {num(cache['l1_hit']['p50_ms'], 2)} ms, L2 (Redis) hit p50 "
               f"{num(cache['l2_hit']['p50_ms'], 2)} ms, miss p50 {num(cache['miss']['p50_ms'], 1)} ms.")
    setup = next((s for s in e["matrix"] if s["name"] == "window batching"), e["matrix"][0])
    rep = setup["repeated"]
    saved = rep["texts"] - rep["texts_to_model"]
    out.append(f"- With {pct(rep['repeat_share'])} repeated texts ({setup['name']}), {pct(rep['share_to_model'])} of "
               f"the texts reach the model; of the {int(saved)} that do not, {int(rep['l1_hits'])} are L1 hits and "
               f"{int(rep['coalesced'])} joined the pending computation of the same text.")
    return out


def embeddings_sections(e: dict[str, Any], images: dict[str, str]) -> list[str]:
    """The embeddings part of the report."""
    rows = []
    for setup in e["matrix"]:
        for lvl in setup["levels"]:
            rows.append([setup["name"], lvl["concurrency"], num(lvl["texts_per_s"], 0), num(lvl["p50_ms"], 1),
                         num(lvl["p99_ms"], 1), num(lvl["mean_batch_size"], 1), num(lvl["broker_cpu_ms_per_text"], 2),
                         lvl["errors"]])
    cache = e["cache"]
    cache_rows = [[label, num(cache[key]["p50_ms"], 2), num(cache[key]["p99_ms"], 2), pct(cache[key]["cache_hit_share"]),
                   int(cache[key]["texts_to_model"])]
                  for label, key in (("miss (model call)", "miss"), ("L1 hit (in-process LRU)", "l1_hit"),
                                     ("L2 hit (Redis, fresh broker)", "l2_hit"))]
    repeat_rows = [[s["name"], pct(s["repeated"]["repeat_share"]), s["repeated"]["texts"],
                    int(s["repeated"]["texts_to_model"]), pct(s["repeated"]["share_to_model"]),
                    int(s["repeated"]["l1_hits"]), int(s["repeated"]["coalesced"]),
                    num(s["repeated"]["mean_batch_size"], 1)] for s in e["matrix"]]
    return [
        "## Embeddings", "",
        "The broker's local `all-MiniLM-L6-v2` (sentence-transformers, in-process) behind `/v1/embeddings`, one "
        "text per request, every text new (no cache hits). Window batching is the default configuration; the "
        "baseline is `embeddings: {window_ms: 0, max_batch_size: 1}`. Closed loop: each client sends its next "
        f"request as soon as the previous one is answered, for {e['meta']['plan']['seconds_per_level']:g} s per level.",
        "",
        table(["setup", "clients", "texts/s", "p50 ms", "p99 ms", "texts / model call", "broker CPU ms / text",
               "errors"], rows), "",
        f"![Embedding throughput]({images['embedding_throughput']})", "",
        "### Cache latency", "",
        f"{cache['texts']} texts sent one at a time: first computed (miss), then again from the in-process L1, then "
        "from Redis (L2) after a broker restart emptied L1.", "",
        table(["lookup", "p50 ms", "p99 ms", "answered from cache", "texts sent to the model"], cache_rows), "",
        "### Repeated texts", "",
        "A stream where a share of the texts repeat an earlier one, 16 clients; a repeat is answered from L1 or "
        "joins the pending computation of the same text (coalesced).", "",
        table(["setup", "repeated", "texts", "reached the model", "share", "L1 hits", "coalesced",
               "texts / model call"], repeat_rows), "",
    ]


def render(merging: dict[str, Any] | None, embeddings: dict[str, Any] | None, images: dict[str, str]) -> str:
    """The whole markdown document."""
    out = ["# Benchmarks", "",
           "Generated by `mergebroker bench` (`python -m bench.report`); numbers come from "
           "`bench/results/merging.json` and `bench/results/embeddings.json`. Broker, simulator and load "
           "generator run as separate processes on the same machine; broker CPU is read from `/proc`."]
    if merging:
        meta = merging["meta"]
        out += ["", f"Run {meta['generated_at']} on {meta['cpus']} CPUs (load average {meta['load_average_at_end']:.1f} "
                    f"at the end, shared with other work), {meta['duration_s']:g} s for the merge benchmark."]
        if meta["plan"]["requests"] < 500:
            out += ["", "**Smoke-sized run (`--quick`): the numbers are not representative.**"]
        out += ["", *targets_section(merging["targets"])]
    out += ["## Findings", ""]
    out += merge_findings(merging) if merging else []
    out += embedding_findings(embeddings) if embeddings else []
    out += [""]
    if merging:
        out += merging_sections(merging, images)
    if embeddings:
        out += embeddings_sections(embeddings, images)
    return "\n".join(out).rstrip() + "\n"


def write_report(merging: dict[str, Any] | None, embeddings: dict[str, Any] | None, docs_dir: Path) -> Path:
    """Draw the charts into `docs_dir/img`, write `docs_dir/benchmarks.md`, return the markdown path."""
    figures: dict[str, Any] = {}
    if merging:
        figures.update(latency_cdf=charts.latency_cdf(merging["main"]),
                       threshold_sweep=charts.threshold_sweep(merging["threshold_sweep"]),
                       window_sweep=charts.window_sweep(merging["window_sweep"]),
                       rate_sweep=charts.rate_sweep(merging["rate_sweep"]))
    if embeddings:
        figures["embedding_throughput"] = charts.embedding_throughput(embeddings["matrix"])
    images = {}
    for name, fig in figures.items():
        charts.save(fig, docs_dir / "img" / f"bench_{name}.png")
        images[name] = f"img/bench_{name}.png"
    path = docs_dir / "benchmarks.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(merging, embeddings, images))
    return path


def load_results(results_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """`merging.json` and `embeddings.json` from `results_dir` (None for a file that is missing)."""
    def load(name: str) -> dict[str, Any] | None:
        path = results_dir / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    return load("merging"), load("embeddings")


def run_benchmarks(quick: bool, results_dir: Path) -> None:
    """Run both benchmarks with one progress bar and write their JSON into `results_dir`."""
    from tqdm import tqdm

    from bench.embeddings import FULL_EMBEDDING_PLAN, QUICK_EMBEDDING_PLAN, run_embeddings
    from bench.harness import write_json
    from bench.merging import FULL_PLAN, QUICK_PLAN, run_merging

    plan, emb_plan = (QUICK_PLAN, QUICK_EMBEDDING_PLAN) if quick else (FULL_PLAN, FULL_EMBEDDING_PLAN)
    with tqdm(total=plan.run_count() + emb_plan.step_count(), desc="bench", unit="run") as bar:
        def step(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update()

        write_json(results_dir / "merging.json", asyncio.run(run_merging(plan, on_run=step)))
        write_json(results_dir / "embeddings.json", asyncio.run(run_embeddings(emb_plan, on_step=step)))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `mergebroker bench`; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="mergebroker bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs (written under bench/results/quick/)")
    parser.add_argument("--from-results", action="store_true", help="do not run; render the existing result JSON")
    parser.add_argument("--results-dir", type=Path, help="where result JSON is written/read (default: bench/results)")
    parser.add_argument("--docs-dir", type=Path, help="where benchmarks.md and img/ go (default: docs)")
    args = parser.parse_args(argv)
    results_dir = args.results_dir or (QUICK_DIR if args.quick else RESULTS_DIR)
    docs_dir = args.docs_dir or (QUICK_DIR if args.quick else DOCS_DIR)
    if not args.from_results:
        run_benchmarks(args.quick, results_dir)
    merging, embeddings = load_results(results_dir)
    if merging is None and embeddings is None:
        print(f"mergebroker bench: no merging.json or embeddings.json in {results_dir}")
        return 1
    path = write_report(merging, embeddings, docs_dir)
    print(f"wrote {path}")
    for target in (merging or {}).get("targets", []):
        print(f"{'met   ' if target['met'] else 'MISSED'} {target['name']}: {target['value']:g} "
              f"(goal {target['op']} {target['target']:g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
