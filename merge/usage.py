"""Apportion the usage of one merged call to its members, so per-member accounting adds up exactly.

The rule:
    * Prompt tokens. Each member is charged its own request tokens (`member_prompt_tokens`, counted by
      the broker). What the upstream reports beyond those (system prompt, header, tags: the shared
      part, reported prompt_tokens minus the members' own tokens, floored at 0) is split evenly.
      If the members' own counts exceed the report (the broker's tokenizer counted more than the
      upstream's), nothing is shared and the reported total is split in proportion to the own counts.
      If the upstream reported no prompt_tokens, the total is `shared_prompt_tokens` plus the own counts.
    * Cached prompt tokens (`prompt_tokens_details.cached_tokens`) are the provider's cache of the
      prompt's prefix: the shared part. They are split evenly, like the shared prompt tokens, never
      above a member's prompt share; a member's usage names them only when the call reported some.
    * Completion tokens are split in proportion to `member_completion_weights` (e.g. each answer's
      length), evenly when every weight is 0. A member never gets more than its cap
      (`member_completion_caps`, its own `max_tokens`: what it may cost): what a share holds above the cap
      goes to the members still below theirs, in proportion to their weights, and what no member has
      room for (the tags and the text cut off past every budget) is the merge's own cost, left out.
    * Integers throughout, by largest-remainder rounding (ties go to the earlier member), so the
      members' prompt and completion tokens sum exactly to the reported totals (completion tokens:
      unless every member reached its cap).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def apportion_usage(
    usage: Mapping[str, Any],
    *,
    shared_prompt_tokens: int,
    member_prompt_tokens: Mapping[str, int],
    member_completion_weights: Mapping[str, int],
    member_completion_caps: Mapping[str, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Return, per member ID, a usage dict with prompt_tokens, completion_tokens and total_tokens (and
    `prompt_tokens_details.cached_tokens` when the call reported cached tokens)."""
    extra = [m for m in member_completion_weights if m not in member_prompt_tokens]
    members = [*member_prompt_tokens, *extra]
    if not members:
        return {}
    own = [max(0, int(member_prompt_tokens.get(m, 0))) for m in members]
    reported = usage.get("prompt_tokens")
    if reported is None:
        reported = shared_prompt_tokens + sum(own)
    prompt_total = max(0, int(reported))
    completion_total = max(0, int(usage.get("completion_tokens") or 0))
    prompts = _prompt_shares(prompt_total, own)
    weights = [max(0, int(member_completion_weights.get(m, 0))) for m in members]
    caps = [None if member_completion_caps is None or m not in member_completion_caps
            else max(0, int(member_completion_caps[m])) for m in members]
    completions = capped_shares(completion_total, weights, caps)
    cached = _cached_shares(_cached_total(usage), prompts)
    result: dict[str, dict[str, Any]] = {}
    for m, p, c, k in zip(members, prompts, completions, cached):
        result[m] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if k is not None:
            result[m]["prompt_tokens_details"] = {"cached_tokens": k}
    return result


def _prompt_shares(total: int, own: list[int]) -> list[int]:
    if sum(own) > total:
        return largest_remainder(total, own)
    shared = largest_remainder(total - sum(own), [1] * len(own))
    return [o + s for o, s in zip(own, shared)]


def _cached_total(usage: Mapping[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if isinstance(cached, bool) or not isinstance(cached, (int, float)) or cached < 0:
        return None
    return int(cached)


def _cached_shares(total: int | None, prompts: list[int]) -> list[int | None]:
    if total is None:
        return [None] * len(prompts)
    return capped_shares(min(total, sum(prompts)), [1] * len(prompts), list(prompts))  # type: ignore[return-value]


def capped_shares(total: int, weights: Sequence[int], caps: Sequence[int | None]) -> list[int]:
    """Split `total` in proportion to `weights` (`largest_remainder`), no share above its cap (None: no cap):
    what a capped share would hold beyond its cap goes to the others with room, by their weights, until
    none is left or no share has room. The shares sum to `total` unless every share reached its cap."""
    shares = [0] * len(weights)
    left = total
    open_ = [i for i in range(len(weights)) if caps[i] is None or caps[i] > 0]  # type: ignore[operator]
    while left > 0 and open_:
        split = largest_remainder(left, [weights[i] for i in open_])
        left = 0
        for i, share in zip(open_, split):
            room = share if caps[i] is None else min(share, caps[i] - shares[i])  # type: ignore[operator]
            shares[i] += room
            left += share - room
        open_ = [i for i in open_ if caps[i] is None or shares[i] < caps[i]]  # type: ignore[operator]
    return shares


def largest_remainder(total: int, weights: Sequence[int]) -> list[int]:
    """Split `total` (>= 0) in proportion to `weights` (>= 0; all zero means evenly) into integers that
    sum to `total`, by largest remainder with ties to the earlier index."""
    if not weights or total <= 0:
        return [0] * len(weights)
    if sum(weights) <= 0:
        weights = [1] * len(weights)
    weight_sum = sum(weights)
    floors = [total * w // weight_sum for w in weights]
    remainders = [total * w % weight_sum for w in weights]
    leftover = total - sum(floors)
    order = sorted(range(len(weights)), key=lambda i: -remainders[i])
    for i in order[:leftover]:
        floors[i] += 1
    return floors
