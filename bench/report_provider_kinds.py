"""The provider-kinds part of the benchmark report (issue: providers beyond OpenAI-compatible), from
`bench/results/provider_kinds.json`. The issue sets no number: the part reports what translation costs."""

from __future__ import annotations

from typing import Any

from bench.markdown import num, run_line, table
from bench.provider_kinds import KINDS

LABELS = {"openai": "openai (relayed as is)", "anthropic": "anthropic (translated)", "azure": "azure (paths only)"}


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return result["plan"]["requests"] < 100


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """None: the issue asks for behaviour, not a speed."""
    return []


def findings(result: dict[str, Any]) -> list[str]:
    """Broker CPU and throughput of the translated kinds against the relayed one, per mode."""
    out = []
    for mode, s in result["summary"].items():
        out.append(
            f"- Provider kinds, {mode} requests: the broker spends {num(s['anthropic']['cpu_ms_per_req'], 2)} ms of CPU "
            f"per request over an Anthropic upstream and {num(s['azure']['cpu_ms_per_req'], 2)} ms over Azure vs. "
            f"{num(s['openai']['cpu_ms_per_req'], 2)} ms over an OpenAI one ({num(s['anthropic_vs_openai_cpu'], 2)}x "
            f"and {num(s['azure_vs_openai_cpu'], 2)}x); throughput {num(s['anthropic_vs_openai_rps'], 2)}x and "
            f"{num(s['azure_vs_openai_rps'], 2)}x the OpenAI kind's.")
    return out


def sections(result: dict[str, Any], images: dict[str, str]) -> list[str]:
    """Per mode and kind: req/s, latency, broker CPU, and the paired ratios against the openai kind."""
    plan = result["plan"]
    rows = [[mode, LABELS[kind], num(s[kind]["rps"], 0), num(s[kind]["p50_ms"], 2), num(s[kind]["p99_ms"], 2),
             num(s[kind]["cpu_ms_per_req"], 3), s[kind]["errors"],
             "1" if kind == "openai" else num(s[f"{kind}_vs_openai_rps"], 2),
             "1" if kind == "openai" else num(s[f"{kind}_vs_openai_cpu"], 2)]
            for mode, s in result["summary"].items() for kind in KINDS]
    return [
        "## Provider kinds (issue: providers beyond OpenAI-compatible)", "",
        "One simulator speaking all three protocols and three brokers (merging and caching off) that differ only "
        f"in their provider's `kind`. Closed loop, {plan['concurrency']} clients, {plan['requests']:,} requests per "
        f"run after {plan['warmup']} warm-up requests, {plan['rounds']} rounds whose kind order rotates; figures are "
        "medians over rounds, ratios medians of per-round (paired) ratios. An Anthropic stream carries more events "
        "than an OpenAI one (message and block start and stop, ping), so its simulator side costs more too.", "",
        run_line(result.get("meta"), "provider-kinds benchmark"), "",
        table(["mode", "kind", "req/s", "p50 ms", "p99 ms", "broker CPU ms / req", "errors", "req/s vs openai",
               "CPU vs openai"], rows), "",
    ]


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """No charts: the table carries it."""
    return {}
