"""The embeddings part of the benchmark report, from `bench/results/embeddings.json`."""

from __future__ import annotations

from typing import Any

from bench import charts
from bench.markdown import num, pct, run_line, table
from bench.merging import EMBEDDING_CPU_GOAL_MS

ISSUE = "embeddings"


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return result["meta"]["plan"]["seconds_per_level"] < 2


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The embeddings issue asks for measurements, not goals."""
    return []


def findings(e: dict[str, Any]) -> list[str]:
    """Headline embedding results: batching speed-up, cache latency, share of repeated texts reaching the model."""
    by_name = {s["name"]: {lvl["concurrency"]: lvl for lvl in s["levels"]} for s in e["matrix"]}
    single, batched = by_name.get("one text per call", {}), by_name.get("window batching", {})
    out = []
    for conc in sorted(set(single) & set(batched)):
        a, b = single[conc], batched[conc]
        out.append(f"- Embeddings, {conc} {'client' if conc == 1 else 'clients'}: window batching "
                   f"{num(b['texts_per_s'], 0)} texts/s (p99 {num(b['p99_ms'], 0)} ms, "
                   f"{num(b['mean_batch_size'], 1)} texts per model call, {num(b['broker_cpu_ms_per_text'], 1)} ms CPU "
                   f"per text) vs. one text per call {num(a['texts_per_s'], 0)} texts/s (p99 {num(a['p99_ms'], 0)} ms, "
                   f"{num(a['broker_cpu_ms_per_text'], 1)} ms CPU per text).")
    cache = e["cache"]
    out.append(f"- Embedding cache: L1 hit p50 {num(cache['l1_hit']['p50_ms'], 2)} ms, L2 (Redis) hit p50 "
               f"{num(cache['l2_hit']['p50_ms'], 2)} ms, miss p50 {num(cache['miss']['p50_ms'], 1)} ms.")
    setup = next((s for s in e["matrix"] if s["name"] == "window batching"), e["matrix"][0])
    rep = setup["repeated"]
    saved = rep["texts"] - rep["texts_to_model"]
    out += _cost_finding(e.get("model_cost") or [])
    out += _backend_finding(e.get("backends"))
    out.append(f"- With {pct(rep['repeat_share'])} repeated texts ({setup['name']}), {pct(rep['share_to_model'])} of "
               f"the texts reach the model; of the {int(saved)} that do not, {int(rep['l1_hits'])} are L1 hits and "
               f"{int(rep['coalesced'])} joined the pending computation of the same text.")
    return out


def _cost_finding(rows: list[dict[str, Any]]) -> list[str]:
    """The similarity model's CPU per text, float vs. int8, smallest and largest batch; what it means for merging."""
    by = {(r["embedder"], r["batch"]): r for r in rows}
    sizes = sorted({r["batch"] for r in rows})
    if not sizes or any((m, s) not in by for m in ("local", "local-int8") for s in (sizes[0], sizes[-1])):
        return []
    lo, hi = sizes[0], sizes[-1]
    f_lo, f_hi, q_lo, q_hi = (by[(m, s)]["cpu_ms_per_text"] for m in ("local", "local-int8") for s in (lo, hi))
    cheapest = min(r["cpu_ms_per_text"] for r in rows if r["embedder"] == "local-int8")
    text = (f"- Similarity model on one torch thread (in-process): the int8 copy costs {num(q_lo, 1)} ms of CPU per "
            f"text in calls of {lo} and {num(q_hi, 1)} ms in calls of {hi}, the float model {num(f_lo, 1)} and "
            f"{num(f_hi, 1)} ms ({num(f_lo / q_lo, 1)}x and {num(f_hi / q_hi, 1)}x more).")
    if cheapest >= EMBEDDING_CPU_GOAL_MS:
        text += (f" The merge engine's goal of < {EMBEDDING_CPU_GOAL_MS:g} ms of embedding CPU per request is below "
                 f"the int8 copy's lowest cost per text ({num(cheapest, 1)} ms), so no batching meets it: only "
                 "embedding fewer texts than requests (or a cheaper model) can.")
    return [text]


BROKER_ONNX = "onnxruntime int8, per channel (broker)"


def _backend_finding(backends: dict[str, Any] | None) -> list[str]:
    """The onnxruntime int8 copy against today's torch int8 copy: CPU per text and drift."""
    rows = {r["backend"]: r for r in (backends or {}).get("rows", [])}
    onnx, torch_int8 = rows.get(BROKER_ONNX), rows.get(backends["meta"]["baseline"]) if backends else None
    if onnx is None or torch_int8 is None:
        return []
    ratios = onnx["vs_baseline"]
    return [f"- Similarity backends (one thread, in-process): the onnxruntime int8 copy costs "
            f"{num(min(ratios.values()), 2)}-{num(max(ratios.values()), 2)}x the CPU per text of the torch int8 copy "
            f"across batch sizes and prompt lengths; its pair cosines stay within {num(onnx['max_abs_diff'], 3)} of "
            f"the float model's (torch int8: {num(torch_int8['max_abs_diff'], 3)}), {onnx['crossings']} of "
            f"{backends['meta']['pairs']} pairs crossing 0.85 differently (torch int8: {torch_int8['crossings']})."]


def _backend_section(backends: dict[str, Any] | None) -> list[str]:
    if not backends or not backends.get("rows"):
        return []
    rows = backends["rows"]
    keys = list(rows[0]["cpu_ms_per_text"])
    cpu_rows = [[r["backend"], *(f"{num(r['cpu_ms_per_text'][k], 2)} ({num(r['vs_baseline'][k], 2)}x)"
                                 for k in keys)] for r in rows]
    drift_rows = [[r["backend"], num(r["max_abs_diff"], 4), num(r["mean_abs_diff"], 4), r["crossings"],
                   f"{r['label_agreement']} / {backends['meta']['pairs']}"] for r in rows]
    missing = [f"- not measured: {name}: {why}" for name, why in backends.get("unavailable", {}).items()]
    return [
        "### Similarity model backends", "",
        "all-MiniLM-L6-v2 from the bundled package, each backend on one thread in the benchmark process, in "
        f"{backends['meta']['plan']['rounds']} interleaved rounds (median); CPU ms per text by text set and texts "
        f"per call (prompts of {backends['meta']['plan']['min_words']}-{backends['meta']['plan']['max_words']} "
        f"words, questions of 5-15), with the ratio to `{backends['meta']['baseline']}` (today's default).", "",
        run_line(backends["meta"], "backends benchmark"), "",
        table(["backend", *keys], cpu_rows), "",
        f"Pair cosines against `{backends['meta']['reference']}` on {backends['meta']['pairs']} labelled question "
        "pairs (paraphrases, decorated copies, near misses): the largest and mean absolute difference, how many pairs "
        "fall on the other side of 0.85, and how many the backend puts on the side their label says.", "",
        table(["backend", "max abs diff", "mean abs diff", "pairs crossing 0.85", "labels right"], drift_rows), "",
        *missing, "",
    ]


def sections(e: dict[str, Any], images: dict[str, str]) -> list[str]:
    """Throughput matrix, cache latency and the repeated-texts stream."""
    rows = [[setup["name"], lvl["concurrency"], num(lvl["texts_per_s"], 0), num(lvl["p50_ms"], 1),
             num(lvl["p99_ms"], 1), num(lvl["mean_batch_size"], 1), num(lvl["broker_cpu_ms_per_text"], 2),
             lvl["errors"]] for setup in e["matrix"] for lvl in setup["levels"]]
    cache = e["cache"]
    cache_rows = [[label, num(cache[key]["p50_ms"], 2), num(cache[key]["p99_ms"], 2),
                   pct(cache[key]["cache_hit_share"]), int(cache[key]["texts_to_model"])]
                  for label, key in (("miss (model call)", "miss"), ("L1 hit (in-process LRU)", "l1_hit"),
                                     ("L2 hit (Redis, fresh broker)", "l2_hit"))]
    cost_rows = [[f"`{r['embedder']}`", r["batch"], r["calls"], num(r["cpu_ms_per_call"], 1),
                  num(r["cpu_ms_per_text"], 2), num(r["wall_ms_per_call"], 1)] for r in e.get("model_cost") or []]
    repeat_rows = [[s["name"], pct(s["repeated"]["repeat_share"]), s["repeated"]["texts"],
                    int(s["repeated"]["texts_to_model"]), pct(s["repeated"]["share_to_model"]),
                    int(s["repeated"]["l1_hits"]), int(s["repeated"]["coalesced"]),
                    num(s["repeated"]["mean_batch_size"], 1)] for s in e["matrix"]]
    return [
        "## Embeddings (issue: embeddings)", "",
        "The broker's local `all-MiniLM-L6-v2` (sentence-transformers, in-process, float model on one torch thread, "
        "`embeddings.model_threads: 1`) behind `/v1/embeddings`, one text per request, every text new (no cache "
        "hits). Window batching is the default configuration; the baseline is "
        "`embeddings: {window_ms: 0, max_batch_size: 1}`. Closed loop: each client sends its next request as soon "
        f"as the previous one is answered, for {e['meta']['plan']['seconds_per_level']:g} s per level.", "",
        run_line(e["meta"], "embeddings benchmark"), "",
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
    ] + ([
        "### Similarity model cost by batch size", "",
        "The model as the merge engine runs it (`SentenceModelHost`, one worker thread, one torch thread), called "
        "directly in the benchmark process with distinct texts of about a dozen words; CPU is the worker thread's. "
        "`local` is the float all-MiniLM-L6-v2, `local-int8` its dynamically quantised copy (the default "
        "`merge.embedder`).", "",
        table(["merge.embedder", "texts / call", "calls", "CPU ms / call", "CPU ms / text", "wall ms / call"],
              cost_rows), "",
    ] if cost_rows else []) + _backend_section(e.get("backends"))


def figures(e: dict[str, Any]) -> dict[str, Any]:
    """Throughput and p99 per concurrency."""
    return {"embedding_throughput": charts.embedding_throughput(e["matrix"])}
