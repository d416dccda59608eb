"""What an upstream reply says it used: total and completion tokens, read defensively (pure)."""

from __future__ import annotations

from typing import Any


def usage_tokens(reply: Any) -> int | None:
    """Total tokens an upstream reply says it used (`usage.total_tokens`, else prompt + completion), or None."""
    usage = reply.get("usage") if isinstance(reply, dict) else None
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if _is_count(total):
        return total
    parts = [usage.get("prompt_tokens"), usage.get("completion_tokens", 0)]
    return sum(parts) if all(_is_count(p) for p in parts) else None


def completion_tokens(reply: Any) -> int:
    """The output tokens a reply reports (0 when it reports none, or is not a reply body)."""
    usage = reply.get("usage") if isinstance(reply, dict) else None
    count = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return count if _is_count(count) else 0


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
