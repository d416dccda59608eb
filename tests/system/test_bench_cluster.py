"""The cluster benchmark's report judges its targets from the numbers, and its histogram quantile is Prometheus's."""

from __future__ import annotations

from typing import Any

from bench import report_cluster
from bench.cluster import CLUSTER, FULL_PLAN, LAYOUTS, histogram_quantile
from bench.report import render


def run(name: str, calls: float, tokens: float, p50: float, p99: float, **extra: Any) -> dict[str, Any]:
    figures = {"name": name, "requests": 800, "errors": 0, "wrong_answers": 0, "calls_per_request": calls,
               "prompt_tokens_per_request": tokens, "p50_ms": p50, "p99_ms": p99, "hop_p50_ms": None,
               "hop_p99_ms": None, "claims": 0.0, "duplicates_dropped": 0.0, "orphans_answered_after_kill_s": None}
    return {**figures, **extra}


def cluster_fixture(**kill: Any) -> dict[str, Any]:
    names = [layout.name for layout in LAYOUTS]
    runs = [run(names[0], 0.9, 190, 370, 420), run(names[1], 0.125, 54, 1000, 1400),
            run(names[2], 0.2, 75, 860, 1160), run(names[3], 0.33, 108, 730, 1000),
            run(names[4], 0.127, 55, 1001, 1405, hop_p50_ms=1.2, hop_p99_ms=6.0),
            run(names[5], 0.12, 53, 990, 1500, **{"hop_p50_ms": 1.5, "hop_p99_ms": 9.0, "claims": 12.0,
                                                   "orphans_answered_after_kill_s": 1.9, **kill})]
    return {"plan": {"rate": FULL_PLAN.rate, "duration_s": FULL_PLAN.duration_s}, "cluster": CLUSTER, "tier": "batch",
            "simulator_options": ["--latency-base-ms", "300"], "runs": {r["name"]: r for r in runs},
            "hop_floor": {"rate": 100.0, "jobs": 800, "p50_ms": 1.1, "p90_ms": 2.0, "p99_ms": 4.5}}


def test_the_cluster_keeps_the_single_replicas_savings_and_per_replica_mode_loses_them() -> None:
    result = cluster_fixture()
    assert round(report_cluster.kept(result, report_cluster.CLUSTER, "calls_per_request"), 3) == 0.997
    assert report_cluster.kept(result, "4 replicas (per-replica)", "calls_per_request") < 0.8
    text = render({"cluster": result}, {})
    assert "## Cluster mode (issue 13)" in text and "p50 1.10 ms, p90 2.00 ms, p99 4.50 ms over 800 jobs" in text
    assert "| 13 cluster | cluster hop at the front-ends, p99 (ms) | <= 10 | 6.00 | met |" in text
    assert "| 13 cluster | kill -9 of 1 of 2 workers: requests lost (non-200) | == 0 | 0.00 | met |" in text


def test_a_lost_request_or_a_late_orphan_misses_its_target() -> None:
    text = render({"cluster": cluster_fixture(errors=1, orphans_answered_after_kill_s=9.0)}, {})
    assert "| 13 cluster | kill -9 of 1 of 2 workers: requests lost (non-200) | == 0 | 1.00 | **missed** |" in text
    assert "orphans answered after the kill (s; claim_idle_ms + window + call) | <= 3.41 | 9.00 | **missed** |" in text


def test_orphans_are_held_to_2_s_less_their_own_call_at_the_default_settings() -> None:
    met = render({"cluster": cluster_fixture(orphans_answered_after_kill_less_call_s=1.4)}, {})
    assert "orphans answered after the kill, less their own upstream call (s) | <= 2 | 1.40 | met |" in met
    late = render({"cluster": cluster_fixture(orphans_answered_after_kill_less_call_s=3.9)}, {})
    assert "orphans answered after the kill, less their own upstream call (s) | <= 2 | 3.90 | **missed** |" in late


def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    buckets = {0.001: 50.0, 0.002: 90.0, 0.005: 100.0, float("inf"): 100.0}
    assert histogram_quantile(buckets, 0.5) == 0.001
    assert abs(histogram_quantile(buckets, 0.7) - 0.0015) < 1e-9
    assert histogram_quantile({float("inf"): 0.0}, 0.5) is None
