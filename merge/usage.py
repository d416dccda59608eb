"""Apportion the usage of one merged call to its members, so per-member accounting adds up exactly.

The rule:
    * Prompt tokens. Each member is charged its own request tokens (`member_prompt_tokens`, counted by
      the broker). What the upstream reports beyond those (system prompt, header, tags: the shared
      part, reported prompt_tokens minus the members' own tokens, floored at 0) is split evenly.
      If the members' own counts exceed the report (the broker's tokenizer counted more than the
      upstream's), nothing is shared and the reported total is split in proportion to the own counts.
    * Cached prompt tokens and cache-written ones are the provider's cache of the prompt's prefix: the
      shared part. They are split evenly, like the shared prompt tokens, never above a member's prompt
      share (its reads first, then its writes).
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

from mergebroker.token_usage import TokenUsage


def apportion_usage(
    usage: TokenUsage,
    *,
    member_prompt_tokens: Mapping[str, int],
    member_completion_weights: Mapping[str, int],
    member_completion_caps: Mapping[str, int] | None = None,
) -> dict[str, TokenUsage]:
    """Each member's share of a merged call's `usage`, by member ID (the rule in the module docstring)."""
    extra = [m for m in member_completion_weights if m not in member_prompt_tokens]
    members = [*member_prompt_tokens, *extra]
    if not members:
        return {}
    own = [max(0, int(member_prompt_tokens.get(m, 0))) for m in members]
    prompts = _prompt_shares(usage.prompt_tokens, own)
    weights = [max(0, int(member_completion_weights.get(m, 0))) for m in members]
    caps = [None if member_completion_caps is None or m not in member_completion_caps
            else max(0, int(member_completion_caps[m])) for m in members]
    completions = capped_shares(usage.completion_tokens, weights, caps)
    cached = _even_within(usage.cached_tokens, prompts)
    # Cache writes are the shared prefix too: split evenly within what each prompt share has left after its reads.
    written = _even_within(usage.cache_write_tokens, [p - c for p, c in zip(prompts, cached)])
    return {m: TokenUsage(p, c, k, w, counted=usage.counted)
            for m, p, c, k, w in zip(members, prompts, completions, cached, written)}


def _prompt_shares(total: int, own: list[int]) -> list[int]:
    if sum(own) > total:
        return largest_remainder(total, own)
    shared = largest_remainder(total - sum(own), [1] * len(own))
    return [o + s for o, s in zip(own, shared)]


def _even_within(total: int, room: list[int]) -> list[int]:
    """`total` split evenly, no share above its `room`."""
    return capped_shares(min(total, sum(room)), [1] * len(room), list(room))


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
