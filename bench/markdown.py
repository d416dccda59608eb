"""Markdown building blocks for the benchmark report: tables, number formats, the targets table.

A target row is a dict `{"issue", "name", "value", "op", "target", "met"}`; `target_row` builds one and
judges it, so every part of the report states its goals the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COMPARE = {">=": float.__ge__, "<=": float.__le__, "<": float.__lt__, ">": float.__gt__, "==": float.__eq__}


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def num(value: float | None, digits: int = 2) -> str:
    """A number for a table cell: fixed digits, thousands kept readable; "n/a" for a missing value."""
    if value is None or value != value:
        return "n/a"
    return f"{value:,.{digits}f}"


def pct(value: float | None) -> str:
    """A share as a percentage with one decimal."""
    return "n/a" if value is None or value != value else f"{100 * value:.1f} %"


def ratio(a: float, b: float) -> float:
    """a / b, or 0 when b is 0."""
    return a / b if b else 0.0


def fewer(base: float, run: float) -> str:
    """How many times fewer `run` is than `base`, e.g. "5.1x fewer"."""
    return f"{base / run:.1f}x fewer" if run else "n/a"


def more_ms(base: float, run: float) -> str:
    """The difference `run - base` in ms, signed."""
    return f"{run - base:+,.0f} ms"


def secs(value: float | None) -> str:
    """Seconds with two decimals, or "never" for an event that did not happen."""
    return "never" if value is None else f"{value:.2f} s"


def target_row(issue: str, name: str, value: float | None, op: str, target: float) -> dict[str, Any]:
    """One target with its measured value, judged; a missing value (the event never happened) is missed."""
    met = value is not None and value == value and COMPARE[op](float(value), float(target))
    return {"issue": issue, "name": name, "value": None if value is None else round(float(value), 3), "op": op,
            "target": target, "met": bool(met)}


def targets_table(targets: Sequence[dict[str, Any]]) -> str:
    """Every target: issue, what is measured, the goal, the measured value and met / **missed**."""
    rows = [[t.get("issue", ""), t["name"], f"{t['op']} {t['target']:g}", num(t["value"], 2),
             "met" if t["met"] else "**missed**"] for t in targets]
    return table(["issue", "target", "goal", "measured", "result"], rows)


def run_line(meta: dict[str, Any] | None, what: str) -> str:
    """When, where and how long a benchmark ran, from its `meta`."""
    if not meta or "generated_at" not in meta:
        return ""
    code = f" of commit {meta['code']}" if meta.get("code") else ""
    probe = ""
    if meta.get("cpu_probe_ms_start") and meta.get("cpu_probe_ms_end"):
        probe = (f"; the host-speed probe (a fixed Python loop) took {meta['cpu_probe_ms_start']:g} ms at the start "
                 f"and {meta['cpu_probe_ms_end']:g} ms at the end")
    return (f"Run {meta['generated_at']}{code} on {meta['cpus']} CPUs (load average "
            f"{meta['load_average_at_end']:.1f} at the end), {meta['duration_s']:g} s for the {what}{probe}.")
