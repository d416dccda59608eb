"""A request's output budget: the one rule for reading it from a body, whatever API the body speaks.

`max_completion_tokens` (OpenAI chat's current name) wins over the older `max_tokens`; the Responses
API names it `max_output_tokens`. The merge planner, the rate limits, the pools' read timeouts and the
provider translations all read it here, so a request is reserved, timed and sent with the same number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BUDGET_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def token_budget(body: Mapping[str, Any], default: int) -> int:
    """The output tokens a request may use; `default` when no budget field is a positive whole number."""
    # Asked of every request several times on its way: a body naming no budget is answered by one check in C.
    if body.keys().isdisjoint(BUDGET_FIELDS):
        return default
    for name in BUDGET_FIELDS:
        value = body.get(name)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default
