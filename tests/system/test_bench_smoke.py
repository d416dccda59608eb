"""Each benchmark script runs end to end in --quick mode and writes its JSON report with the expected keys."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import REPO

SCRIPTS = ("passthrough", "tiers", "chaos", "latency")
EXTRA_ARGS = {"latency": ["--part", "sequential"]}  # its other parts run brokers on a 300 ms upstream: minutes
TIMEOUT_S = 90


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[subprocess.Popen[str], Path]]]:
    """The scripts started at once (each is mostly process start-up and waiting), one JSON file each."""
    out_dir = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    runs = {}
    for name in SCRIPTS:
        out = out_dir / f"{name}.json"
        # Own process group: a script killed at teardown takes its simulator and brokers with it.
        proc = subprocess.Popen([sys.executable, "-m", f"bench.{name}", "--quick", "--out", str(out),
                                 *EXTRA_ARGS.get(name, [])], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        runs[name] = (proc, out)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def finished(runs: dict[str, tuple[subprocess.Popen[str], Path]], name: str) -> dict[str, Any]:
    """Wait for one script; fail with its output unless it exited 0 and wrote its JSON."""
    proc, out = runs[name]
    output, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, output
    assert out.exists(), output
    return json.loads(out.read_text())


def test_passthrough_quick_reports_all_three_targets_with_ratios(quick_runs) -> None:
    result = finished(quick_runs, "passthrough")
    assert {"plan", "runs", "summary", "equal_load", "targets", "meta"} <= set(result)
    for level in result["summary"].values():
        for target in ("direct", "proxy", "broker"):
            assert level[target]["rps"] > 0 and level[target]["errors"] == 0
        assert level["broker_vs_proxy_rps"] > 0
        assert "broker_added_p99_ms" in level
    assert {"throughput_ratio", "throughput_ok", "added_p99_ms", "added_p99_ok"} <= set(result["targets"])
    assert result["targets"]["concurrency"] == 16
    # The hot path's targets: the ratio at every concurrency run, and p50 over the proxy's at the lowest.
    assert set(result["targets"]["floor_ratios"]) == set(result["summary"])
    assert result["targets"]["p50_over_proxy_concurrency"] == min(int(c) for c in result["summary"])


def test_tiers_quick_reports_latency_per_tier_and_queue_overhead(quick_runs) -> None:
    result = finished(quick_runs, "tiers")
    assert {"unloaded", "loaded", "passthrough", "targets", "meta"} <= set(result)
    for tier in ("realtime", "batch"):
        assert result["loaded"][tier]["requests"] > 0
        assert result["loaded"][tier]["ok"] == result["loaded"][tier]["requests"]
    assert result["unloaded"]["realtime"]["p99_ms"] > 0
    assert {"realtime_p99_added_ms", "queue_overhead_cpu_ms_per_req", "limiter_saturated"} <= set(result["targets"])
    # Whether batch absorbs the wait is a measurement (bench/tiers.py reports it), not a smoke check.


def test_chaos_quick_reports_phases_fast_fails_and_one_answer_each(quick_runs) -> None:
    result = finished(quick_runs, "chaos")
    assert [p["phase"] for p in result["phases"]] == ["healthy", "errors_50", "outage", "recovery"]
    phases = {p["phase"]: p for p in result["phases"]}
    # A request still in flight when its phase ends may meet the next phase's upstream on a loaded machine
    # (the quick phases last 0.4-1 s): the healthy phase may lose those, and the outage may still answer one.
    # A request answered while the upstream was still healthy never fails.
    healthy = phases["healthy"]
    assert healthy["failed_within_phase"] == 0 and healthy["ok"] > 0, healthy
    assert phases["outage"]["ok"] <= max(1, 0.05 * phases["outage"]["sent"]) and phases["outage"]["fast_fail"] > 0
    assert result["outage_to_first_fast_fail_s"] is not None
    assert "recovery_to_closed_s" in result and result["breaker_timeline"]
    assert result["accounting"]["exactly_one_each"] is True
    assert result["accounting"]["sent"] == sum(p["sent"] for p in result["phases"])
    assert result["meta"]["duration_s"] > 0


def run_alone(name: str, tmp_path: Path) -> dict[str, Any]:
    """Run one script on its own (not beside the timed ones) and return its JSON."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", f"bench.{name}", "--quick", "--out", str(out)], cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_provider_kinds_quick_measures_every_kind_in_both_modes_without_errors(tmp_path: Path) -> None:
    # Run alone, last, after the others: its four processes would slow the timed chaos phases down.
    result = run_alone("provider_kinds", tmp_path)
    assert {"plan", "runs", "summary", "meta"} <= set(result)
    for mode in ("plain", "stream"):
        summary = result["summary"][mode]
        for kind in ("openai", "anthropic", "azure"):
            assert summary[kind]["rps"] > 0 and summary[kind]["errors"] == 0
        assert summary["anthropic_vs_openai_rps"] > 0 and summary["azure_vs_openai_cpu"] > 0


def test_latency_quick_runs_the_sequential_client_against_three_brokers(quick_runs) -> None:
    result = finished(quick_runs, "latency")
    summary = result["sequential"]["summary"]
    assert set(summary) == {"passthrough", "adaptive", "fixed"} and result["sequential"]["errors"] == 0
    assert {"added_p50_ms"} <= set(summary["adaptive"]) and summary["fixed"]["p50_ms"] > 0


def test_bulk_quick_compacts_the_file_and_answers_every_line_with_its_own_answer(tmp_path: Path) -> None:
    # Run alone, after the others: its three processes would slow the timed chaos phases down.
    result = run_alone("bulk", tmp_path)
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["line_by_line", "compacted_pool", "compacted_batch_api"]
    for run in runs.values():
        assert run["wrong_answers"] == 0 and run["missing"] == 0 and run["answered"] == run["lines"]
    assert runs["line_by_line"]["upstream_calls"] == result["plan"]["lines"]
    assert runs["compacted_pool"]["upstream_calls"] < runs["line_by_line"]["upstream_calls"]
