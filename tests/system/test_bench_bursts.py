"""The bursts and similarity-backend benchmarks judge their runs right: medians and worst runs per host and backend,
issue 25's targets on the loaded host, and drift counted as pairs that cross 0.85 differently."""

from __future__ import annotations

from typing import Any

from bench import report_bursts
from bench.bursts import QUICK_BURST_PLAN, backends, summarize
from bench.embedding_backends import pair_drift
from bench.similarity_pairs import PAIRS, prompt_texts


def burst_run(backend: str, host: str, fewer: float, slow: float) -> dict[str, Any]:
    return {"backend": backend, "host": host, "x_fewer_calls": fewer, "similarity_slow_rate": slow,
            "embedding_cpu_ms_per_request": 1.0, "p99_ms": 900.0, "errors": 0, "wrong_answers": 0,
            "load_average": 2.0}


def test_bursts_summary_keeps_median_and_worst_run_and_targets_judge_the_loaded_defaults_row() -> None:
    before = backends(QUICK_BURST_PLAN)[0].name
    runs = [burst_run(before, "loaded", 1.6, 0.35), burst_run(before, "loaded", 2.0, 0.25),
            burst_run("defaults", "loaded", 3.9, 0.0), burst_run("defaults", "loaded", 3.4, 0.03),
            burst_run("defaults", "quiet", 3.95, 0.0)]
    rows = {(r["host"], r["backend"]): r for r in summarize(runs)}
    onnx = rows[("loaded", "defaults")]
    assert (onnx["x_fewer_calls"], onnx["worst_x_fewer_calls"], onnx["worst_similarity_slow"]) == (3.65, 3.4, 0.03)
    result = {"summary": list(rows.values()), "meta": {"plan": {"per_burst": 30}}}
    assert [t["met"] for t in report_bursts.targets(result)] == [False, False]
    lines = report_bursts.findings(result)  # a backend measured on one host only has no line
    assert len(lines) == 1 and "defaults: 3.95x fewer" in lines[0] and "3.65x with two CPU burners" in lines[0]


def test_drift_counts_pairs_that_cross_the_threshold_differently() -> None:
    reference = [0.9 if p.same else 0.3 for p in PAIRS]
    shifted = list(reference)
    shifted[0] = 0.84  # a paraphrase pushed below 0.85
    drift = pair_drift(shifted, reference)
    assert drift["crossings"] == 1 and drift["crossing_pairs"][0][:2] == [PAIRS[0].a, PAIRS[0].b]
    assert abs(drift["max_abs_diff"] - 0.06) < 1e-9
    assert drift["label_agreement"] == len(PAIRS) - 1


def test_prompt_texts_span_the_asked_lengths_and_differ() -> None:
    texts = prompt_texts(16, min_words=20, max_words=200)
    lengths = sorted(len(t.split()) for t in texts)
    assert lengths[0] == 20 and lengths[-1] == 200 and len(set(texts)) == 16
