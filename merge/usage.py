"""Apportion the usage of one merged call to its members, so per-member accounting adds up exactly.

The rule:
    * Prompt tokens. Each member is charged its own request tokens (`member_prompt_tokens`, counted by
      the broker). What the upstream reports beyond those (system prompt, header, tags: the shared
      part, reported prompt_tokens minus the members' own tokens, floored at 0) is split evenly.
      If the members' own counts exceed the report (the broker's tokenizer counted more than the
      upstream's), nothing is shared and the reported total is split in proportion to the own counts.
      If the upstream reported no prompt_tokens, the total is `shared_prompt_tokens` plus the own counts.
    * Completion tokens are split in proportion to `member_completion_weights` (e.g. each answer's
      length), evenly when every weight is 0.
    * Integers throughout, by largest-remainder rounding (ties go to the earlier member), so the
      members' prompt and completion tokens sum exactly to the reported totals.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def apportion_usage(
    usage: Mapping[str, Any],
    *,
    shared_prompt_tokens: int,
    member_prompt_tokens: Mapping[str, int],
    member_completion_weights: Mapping[str, int],
) -> dict[str, dict[str, int]]:
    """Return, per member ID, a usage dict with prompt_tokens, completion_tokens and total_tokens."""
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
    completions = largest_remainder(completion_total, weights)
    return {
        m: {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        for m, p, c in zip(members, prompts, completions)
    }


def _prompt_shares(total: int, own: list[int]) -> list[int]:
    if sum(own) > total:
        return largest_remainder(total, own)
    shared = largest_remainder(total - sum(own), [1] * len(own))
    return [o + s for o, s in zip(own, shared)]


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
