"""A chat request's completion budget: the one rule for reading it from a body, and what a merged call's
members cost the model's context window."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from mergebroker.merge.merge_cost import REQUEST_TAG_TOKENS
from mergebroker.merge.prompt import BLOCK_OVERHEAD_TOKENS


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


def context_shares(reserved: Sequence[int], *, window: int, shared: int, header: int) -> tuple[list[int], int]:
    """What each member of a merged call costs the model's context window, and the window they share.

    The shared prefix (the system prompt and the header) is sent once, so it comes off the window, not off
    each member: a member costs its whole request (`reserved`: its prompt sent alone plus its output budget)
    less that prefix, plus its request and response tags. For `merge.grouping.group_by_similarity`'s
    `costs` and `budget`."""
    tags = BLOCK_OVERHEAD_TOKENS + REQUEST_TAG_TOKENS
    return [max(1, r - shared + tags) for r in reserved], max(window - shared - header, 1)
