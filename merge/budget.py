"""A chat request's completion budget: the one rule for reading it from a body."""

from __future__ import annotations

from typing import Any, Mapping


def token_budget(body: Mapping[str, Any], default: int) -> int:
    """The output tokens a request may use: `max_completion_tokens` (OpenAI's current name) wins over the
    older `max_tokens`; `default` when neither is a positive whole number."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default
