"""What a merged call's members cost the model's context window (`token_budget`, the one rule for a
request's output budget, lives in `mergebroker.output_budget` and is re-exported here)."""

from __future__ import annotations

from collections.abc import Sequence

from mergebroker.merge.merge_cost import REQUEST_TAG_TOKENS
from mergebroker.merge.prompt import BLOCK_OVERHEAD_TOKENS
from mergebroker.output_budget import token_budget

__all__ = ["context_shares", "token_budget"]


def context_shares(reserved: Sequence[int], *, window: int, shared: int, header: int) -> tuple[list[int], int]:
    """What each member of a merged call costs the model's context window, and the window they share.

    The shared prefix (the system prompt and the header) is sent once, so it comes off the window, not off
    each member: a member costs its whole request (`reserved`: its prompt sent alone plus its output budget)
    less that prefix, plus its request and response tags. For `merge.grouping.group_by_similarity`'s
    `costs` and `budget`."""
    tags = BLOCK_OVERHEAD_TOKENS + REQUEST_TAG_TOKENS
    return [max(1, r - shared + tags) for r in reserved], max(window - shared - header, 1)
