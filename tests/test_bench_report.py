"""The benchmark report turns a small fixture of result JSON into markdown tables and titled, labelled PNG charts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import charts
from bench.merging import check_targets
from bench.report import PINNED, main, render, write_report
from bench.workloads import hot_question_versions, mixed_workload, with_repeats

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(name: str, *, calls: float, tokens: float, p99: float, merge_rate: float = 0.0, batch: float = 1.0,
        embedding_ms: float = 0.0, **extra: Any) -> dict[str, Any]:
    """One run's figures, as `bench.merging.summarize_run` writes them."""
    figures = {"name": name, "tier": "batch", "merge": merge_rate > 0, "window_ms": None, "threshold": None,
               "env": [], "requests": 100, "wall_s": 1.0, "rps": 100.0, "errors": 0, "wrong_answers": 0,
               "upstream_calls": calls * 100, "merged_calls": 0, "upstream_calls_per_request": calls,
               "prompt_tokens_per_request": tokens, "completion_tokens_per_request": 20.0, "merge_rate": merge_rate,
               "mean_batch_size": batch, "split_fallback_rate": 0.0, "cache_hit_rate": 0.05, "coalesced_rate": 0.1,
               "p50_ms": p99 - 50, "p90_ms": p99 - 10, "p99_ms": p99, "mean_ms": p99 - 40, "queue_wait_ms_mean": 3.0,
               "upstream_ms_mean": 350.0, "broker_cpu_ms_per_request": 2.5, "embedding_ms_per_request": embedding_ms,
               "embedding_calls": 0, "latency_cdf_ms": [p99 * k / 10 for k in range(11)]}
    return {**figures, **extra}


def merging_fixture() -> dict[str, Any]:
    """A tiny merging.json: batch merging 5x fewer calls, bursts 4x fewer, a slow and a pinned standard run."""
    main_runs = {"passthrough/batch": run("passthrough/batch", calls=0.8, tokens=180, p99=400),
                 "merge/batch": run("merge/batch", calls=0.16, tokens=60, p99=650, merge_rate=0.8, batch=6),
                 "passthrough/standard": run("passthrough/standard", calls=0.8, tokens=180, p99=410),
                 "merge/standard": run("merge/standard", calls=0.6, tokens=150, p99=3000, merge_rate=0.3,
                                       batch=1.3, embedding_ms=400.0, broker_cpu_ms_per_request=30.0),
                 PINNED: run(PINNED, calls=0.6, tokens=150, p99=480, merge_rate=0.3, batch=1.3, embedding_ms=3.0,
                             broker_cpu_ms_per_request=10.0)}
    burst_runs = {"passthrough/standard": run("passthrough/standard", calls=1.0, tokens=240, p99=380),
                  "merge/standard": run("merge/standard", calls=0.25, tokens=100, p99=900, merge_rate=1, batch=4,
                                        embedding_ms=90.0),
                  PINNED: run(PINNED, calls=0.25, tokens=100, p99=600, merge_rate=1, batch=4, embedding_ms=4.0)}
    results = {
        "main": {"rate": 100, "requests": 100, "runs": main_runs},
        "burst": {"bursts": 1, "versions": 30, "spread_ms": 100, "runs": burst_runs},
        "threshold_sweep": {"tier": "batch", "rate": 100, "points": [
            run(f"threshold {t}", calls=0.2 + t / 2, tokens=70 + 100 * t, p99=600, merge_rate=0.8 - t / 2,
                threshold=t) for t in (0.0, 0.85)]},
        "window_sweep": {"tier": "batch", "rate": 100, "points": [
            run(f"window {w} ms", calls=0.8 - w / 100, tokens=180 - w, p99=400 + 3 * w, merge_rate=w / 60,
                window_ms=w) for w in (0, 50)]},
        "rate_sweep": {"tier": "batch", "points": [
            {"rate": r, **run(f"rate {r}/s", calls=0.3, tokens=80, p99=700, merge_rate=0.5 + r / 400, batch=4)}
            for r in (50, 100)]},
        "meta": {"plan": {"requests": 100}, "simulator_options": ["--latency-base-ms", "300"], "model": "sim-small",
                 "cpus": 2, "load_average_at_end": 1.0, "generated_at": "2026-01-01T00:00:00+00:00",
                 "duration_s": 10.0},
    }
    results["targets"] = check_targets(results)
    return results


def level(conc: int, rate: float) -> dict[str, Any]:
    return {"concurrency": conc, "texts": 50, "errors": 0, "p50_ms": 10.0, "p99_ms": 20.0 * conc, "mean_ms": 12.0,
            "cache_hit_share": 0.0, "model_calls": 10, "mean_batch_size": 5.0, "texts_to_model": 50,
            "share_to_model": 1.0, "l1_hits": 0, "l2_hits": 0, "coalesced": 0, "broker_cpu_ms_per_text": 8.0,
            "wall_s": 1.0, "texts_per_s": rate}


def embeddings_fixture() -> dict[str, Any]:
    repeated = {**level(16, 100), "repeat_share": 0.4, "texts_to_model": 30, "share_to_model": 0.6, "l1_hits": 12,
                "coalesced": 8}
    hit = {**level(1, 700), "cache_hit_share": 1.0, "texts_to_model": 0, "p50_ms": 1.3}
    return {"matrix": [{"name": "one text per call", "batching": False, "env": [],
                        "levels": [level(1, 40), level(16, 50)], "repeated": repeated},
                       {"name": "window batching", "batching": True, "env": [],
                        "levels": [level(1, 30), level(16, 120)], "repeated": repeated}],
            "cache": {"texts": 10, "miss": level(1, 30), "l1_hit": hit, "l2_hit": hit},
            "meta": {"plan": {"seconds_per_level": 1.0}, "model": "all-MiniLM-L6-v2", "duration_s": 5.0}}


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "results"
    directory.mkdir()
    (directory / "merging.json").write_text(json.dumps(merging_fixture()))
    (directory / "embeddings.json").write_text(json.dumps(embeddings_fixture()))
    return directory


def test_from_results_writes_markdown_with_tables_ratios_targets_and_linked_charts(results_dir: Path,
                                                                                   tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    status = main(["--from-results", "--results-dir", str(results_dir), "--docs-dir", str(docs)])
    text = (docs / "benchmarks.md").read_text()
    assert status == 0
    assert "| upstream calls / request | 0.800 | 0.160 | 5.0x fewer |" in text
    assert "| standard tier bursts: upstream calls, x fewer | >= 3 | 4.00 | met |" in text
    assert "**missed**" in text  # the slow standard run misses its p99 target, and the report says so
    assert "Hot spot 1, torch threads" in text  # 30 vs. 10 ms of CPU per request: reported as a hot spot
    assert "| window batching | 16 | 120 |" in text
    for link in ("latency_cdf", "threshold_sweep", "window_sweep", "rate_sweep", "embedding_throughput"):
        assert f"](img/bench_{link}.png)" in text
        png = docs / "img" / f"bench_{link}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert png.stat().st_size < 200_000


def test_every_chart_has_a_title_axis_labels_with_units_and_a_legend() -> None:
    merging, embeddings = merging_fixture(), embeddings_fixture()
    figures = [charts.latency_cdf(merging["main"]), charts.window_sweep(merging["window_sweep"]),
               charts.rate_sweep(merging["rate_sweep"]), charts.threshold_sweep(merging["threshold_sweep"]),
               charts.embedding_throughput(embeddings["matrix"])]
    for fig in figures:
        axes = [ax for ax in fig.axes if ax.get_xlabel()]  # twin axes share the x label of their host
        assert fig.get_suptitle() or all(ax.get_title() for ax in axes)
        assert all(ax.get_ylabel() for ax in fig.axes)
        assert any("(" in ax.get_xlabel() for ax in axes)  # a unit in brackets
        assert any(ax.get_legend() is not None for ax in fig.axes)


def test_report_without_embedding_results_still_renders_the_merge_part(tmp_path: Path) -> None:
    text = render(merging_fixture(), None, {name: f"img/{name}.png" for name in (
        "latency_cdf", "threshold_sweep", "window_sweep", "rate_sweep")})
    assert "## Merge engine" in text and "## Embeddings" not in text
    assert write_report(None, embeddings_fixture(), tmp_path).read_text().startswith("# Benchmarks")


def test_no_torch_thread_hot_spot_is_reported_when_pinning_makes_no_difference() -> None:
    merging = merging_fixture()
    merging["main"]["runs"][PINNED]["broker_cpu_ms_per_request"] = 30.0
    assert "Hot spot 1" not in render(merging, None, {name: "x.png" for name in (
        "latency_cdf", "threshold_sweep", "window_sweep", "rate_sweep")})


def test_from_results_without_any_result_file_fails_with_status_1(tmp_path: Path) -> None:
    assert main(["--from-results", "--results-dir", str(tmp_path), "--docs-dir", str(tmp_path / "d")]) == 1


def test_workloads_mix_kinds_in_the_requested_shares_and_bursts_never_repeat_a_wording() -> None:
    items = mixed_workload(200, seed=3)
    kinds = [i.kind for i in items]
    assert (kinds.count("paraphrase"), kinds.count("repeat"), kinds.count("distinct")) == (80, 40, 80)
    originals = {i.question for i in items if i.kind != "repeat"}
    assert all(i.question in originals for i in items if i.kind == "repeat")
    versions = [" ".join(v.question.lower().split()) for v in hot_question_versions(0, 30)]
    assert len(set(versions)) == 30
    stream = with_repeats(100, repeat_share=0.4)
    assert len(stream) - len(set(stream)) == 40
