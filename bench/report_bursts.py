"""The bursts-under-load part of the benchmark report, from `bench/results/bursts.json`."""

from __future__ import annotations

from typing import Any

from bench.markdown import num, pct, run_line, table, target_row

ISSUE = "25"
GOAL_FEWER = 3.5
GOAL_SLOW = 0.02


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return result["meta"]["plan"]["per_burst"] < 30


DEFAULTS = "defaults"
"""The name `bench.bursts` gives the run of the broker's default similarity settings."""


def _row(result: dict[str, Any], host: str, backend_prefix: str) -> dict[str, Any] | None:
    return next((r for r in result["summary"] if r["host"] == host and r["backend"].startswith(backend_prefix)), None)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 25's 'bursts under load', judged on today's default similarity settings (worst repeat)."""
    row = _row(result, "loaded", DEFAULTS)
    if row is None:
        return []
    return [target_row(ISSUE, "bursts under load (defaults): upstream calls, x fewer (worst run)",
                       row["worst_x_fewer_calls"], ">=", GOAL_FEWER),
            target_row(ISSUE, "bursts under load (defaults): share sent unmerged as similarity_slow "
                              "(worst run)", row["worst_similarity_slow"], "<", GOAL_SLOW)]


def findings(result: dict[str, Any]) -> list[str]:
    """One line per backend: calls saved and similarity_slow, quiet host beside loaded host."""
    out = []
    for name in dict.fromkeys(r["backend"] for r in result["summary"]):
        quiet, loaded = _row(result, "quiet", name), _row(result, "loaded", name)
        if quiet is None or loaded is None:
            continue
        out.append(f"- Bursts, {name}: {num(quiet['x_fewer_calls'], 2)}x fewer upstream calls on a quiet host "
                   f"({pct(quiet['similarity_slow'])} similarity_slow), {num(loaded['x_fewer_calls'], 2)}x with "
                   f"two CPU burners ({pct(loaded['similarity_slow'])} similarity_slow, worst run "
                   f"{num(loaded['worst_x_fewer_calls'], 2)}x and {pct(loaded['worst_similarity_slow'])}).")
    return out


def sections(result: dict[str, Any], images: dict[str, str]) -> list[str]:
    """The summary table and how it was measured."""
    plan = result["meta"]["plan"]
    rows = [[r["host"], r["backend"], r["runs"], num(r["x_fewer_calls"], 2), num(r["worst_x_fewer_calls"], 2),
             pct(r["similarity_slow"]), pct(r["worst_similarity_slow"]), num(r["embedding_cpu_ms_per_request"], 2),
             num(r["p99_ms"], 0), r["errors"] + r["wrong_answers"], num(r["load_average"], 1)]
            for r in result["summary"]]
    return [
        "## Bursts under load (issue 25)", "",
        f"{plan['bursts']} bursts of {plan['per_burst']} decorated versions of one hot question, the standard tier "
        "with default settings, the simulator at 300 ms; broker, simulator and load generator on one 2-core host. "
        f"Loaded: {result['meta']['burners']} CPU burner processes run through the bursts. Each row is the median of "
        f"{plan['repeats']} runs on fresh brokers (worst run beside); calls saved = requests / upstream calls "
        "(at most 4, the tier's `max_batch`).", "",
        run_line(result["meta"], "bursts benchmark"), "",
        table(["host", "similarity model", "runs", "x fewer calls", "worst", "similarity_slow", "worst",
               "embedding CPU ms / request", "p99 ms", "errors + wrong answers", "load average"], rows), "",
    ]


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """No chart: the table says it."""
    return {}
