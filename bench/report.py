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
        "long system prompts (about 170-190 tokens), so up to three merge groups are open at once. "
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
            f"{num(run['queue_wait_ms_mean'], 0)} ms waiting in the merge window, "
            f"{num(run['embedding_ms_per_request'], 1)} ms of similarity embedding, and an upstream call of "
            f"{num(run['upstream_ms_mean'], 0)} ms instead of {num(base['upstream_ms_mean'], 0)} ms (a merged reply "
            f"carries every member's answer, {num(run['completion_tokens_per_request'] * run['mean_batch_size'], 0)} "
            "completion tokens per call on average, at 2 ms each).")
    if PINNED in runs:
        as_is, pinned = runs["merge/standard"], runs[PINNED]
        if as_is["embedding_ms_per_request"] > 2 * max(pinned["embedding_ms_per_request"], 0.01):
            notes.append(
                f"- Hot spot: on the standard tier the similarity embedding takes "
                f"{num(as_is['embedding_ms_per_request'], 1)} ms per request as the broker ships, and "
                f"{num(pinned['embedding_ms_per_request'], 1)} ms with the broker started under "
                "`OMP_NUM_THREADS=1`. Torch runs the model on the embedding host's worker thread without a "
                "configured thread count, which makes each encode call several times slower and its CPU cost "
                "higher (pytorch/pytorch#37259); calls then queue behind each other on that one thread and the "
                f"p99 grows to {num(as_is['p99_ms'], 0)} ms ({num(pinned['p99_ms'], 0)} ms when pinned). "
                "Proposed fix: always call `torch.set_num_threads(n)` on the worker thread (a configured "
                "`embeddings.threads`, default 1 on small hosts) when `SentenceModelHost` loads the model.")
    return notes


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
        out += ["", *targets_section(merging["targets"]), *merging_sections(merging, images)]
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
