"""The bulk-job part of the benchmark report (issue 16: Batch API), from `bench/results/bulk.json`."""

from __future__ import annotations

from typing import Any

from bench.markdown import num, run_line, table, target_row

ISSUE = "bulk jobs"


def smoke(result: dict[str, Any]) -> bool:
    """Whether the result comes from a smoke-sized (`--quick`) run."""
    return result["plan"]["lines"] < 1000


def _runs(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in result["runs"]}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Calls and tokens saved by compaction, and no wrong or missing answer."""
    pool = _runs(result)["compacted_pool"]
    wrong = sum(r["wrong_answers"] + r["missing"] for r in result["runs"])
    return [target_row(ISSUE, "upstream calls, line by line / compacted", pool["calls_ratio"], ">", 1),
            target_row(ISSUE, "prompt tokens, line by line / compacted", pool["prompt_tokens_ratio"], ">", 1),
            target_row(ISSUE, "wrong or missing answers (all runs)", wrong, "==", 0)]


def findings(result: dict[str, Any]) -> list[str]:
    """The savings in one sentence each."""
    runs = _runs(result)
    base, pool, api = runs["line_by_line"], runs["compacted_pool"], runs["compacted_batch_api"]
    return [f"- Bulk file of {base['lines']:,} lines ({result['distinct_lines']:,} distinct): compacted by the broker "
            f"it took {pool['upstream_calls']:,} upstream calls instead of {base['upstream_calls']:,} "
            f"({num(pool['calls_ratio'], 1)}x fewer) and {pool['prompt_tokens']:,} prompt tokens instead of "
            f"{base['prompt_tokens']:,} ({num(pool['prompt_tokens_ratio'], 1)}x fewer), in {num(pool['wall_s'], 1)} s "
            f"instead of {num(base['wall_s'], 1)} s at the same concurrency; through the provider's Batch API "
            f"{api['upstream_calls']:,} calls. Completion tokens rose from {base['completion_tokens']:,} to "
            f"{pool['completion_tokens']:,} (the response tags of merged replies). Every custom_id got its own "
            "answer in every run."]


def sections(result: dict[str, Any], images: dict[str, str]) -> list[str]:
    """The three runs side by side."""
    plan = result["plan"]
    rows = [[r["name"], r["upstream_calls"], r["merged_calls"], f"{r['prompt_tokens']:,}",
             f"{r['completion_tokens']:,}", num(r["wall_s"], 2), r["wrong_answers"] + r["missing"],
             num(r.get("calls_ratio", 1.0), 2), num(r.get("prompt_tokens_ratio", 1.0), 2),
             num(r.get("wall_ratio", 1.0), 2)] for r in result["runs"]]
    return ["## Bulk jobs (issue: Batch API)", "",
            f"One batch file of {plan['lines']:,} lines (two system prompts, short review items, about "
            f"{plan['duplicate_share']:.0%} repeated lines; {result['distinct_lines']:,} distinct) against the "
            "simulated upstream: sent line by line straight to the simulator, and uploaded to the broker's "
            "`/v1/files` + `/v1/batches` with the official SDK, executed through the provider pools or through the "
            f"provider's own Batch API; {plan['concurrency']} calls in flight (the simulator runs its own Batch API "
            "16 lines at a time, so that run's wall time is not comparable). Every answer is checked against its own "
            "custom_id's question.", "",
            run_line(result.get("meta"), "bulk benchmark"), "",
            table(["run", "upstream calls", "merged calls", "prompt tokens", "completion tokens", "wall s",
                   "wrong or missing", "calls x fewer", "prompt tokens x fewer", "wall x faster"], rows), ""]


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """No chart: the table says it."""
    return {}
