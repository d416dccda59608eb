"""The provider-kinds benchmark pairs each round's kinds against the OpenAI kind and reports them in the benchmark
document (no target: the issue asks for behaviour)."""

from __future__ import annotations

from bench import report_provider_kinds
from bench.provider_kinds import KINDS, QUICK, summarize_mode
from bench.report import render


def row(round_no: int, mode: str, kind: str, rps: float, cpu: float) -> dict:
    return {"round": round_no, "mode": mode, "kind": kind, "requests": 100, "ok": 100, "rps": rps,
            "p50_ms": 1000 / rps, "p99_ms": 2000 / rps, "cpu_ms_per_req": cpu}


def result() -> dict:
    rows = [row(r, mode, kind, rps * (1 + r), cpu)
            for r in range(3) for mode in ("plain", "stream")
            for kind, rps, cpu in (("openai", 400, 1.0), ("anthropic", 300, 1.5), ("azure", 400, 1.0))]
    plan = {"concurrency": 16, "requests": 1500, "warmup": 100, "rounds": 3}
    return {"plan": plan, "runs": rows, "summary": {m: summarize_mode(rows, m) for m in ("plain", "stream")}}


def test_ratios_are_paired_per_round_against_the_openai_kind():
    summary = result()["summary"]["plain"]
    assert summary["rounds"] == 3 and summary["anthropic_vs_openai_rps"] == 0.75
    assert summary["anthropic_vs_openai_cpu"] == 1.5 and summary["azure_vs_openai_cpu"] == 1.0
    assert summary["anthropic_added_p50_ms"] > 0
    assert all(summary[k]["errors"] == 0 for k in KINDS)


def test_the_report_shows_every_kind_and_mode_and_sets_no_target():
    text = render({"provider_kinds": result()}, {})
    assert "## Provider kinds" in text and "## Targets" not in text
    assert text.count("anthropic (translated)") == 2 and "| 1.50 |" in text
    assert "Provider kinds, stream requests" in text
    assert not report_provider_kinds.smoke(result())
    assert QUICK.requests < 100
