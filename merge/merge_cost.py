"""When merging pays: the expected bill of a merged call against the same members sent alone.

A merged call sends the shared part (the system prompt), the header and chat framing once, then each
member's question inside request tags, and gets each answer back inside response tags. Sent alone, each
member pays for its whole prompt, though the provider's prompt cache may bill a repeated system prompt at
the cached price. Answers cost the same either way, so merging pays when the shared input saved beats the
tags added. `break_even` gives the terms for identical members (F, A and P, in USD):

    F = the merged call's once-only input (shared + header + framing, its cached part at the cached price)
    A = what each member adds to it beyond its answer (question + request tag in, response tag out)
    P = each member's own input sent alone (its cached part at the cached price)
    merging n members pays  <=>  F + n*A < n*P  <=>  P > A and n > F / (P - A)

The decision (`decide`, `merge_size`), for members in the order given:

- Unpriced model (price None): merge all of them, as the broker did before it knew prices.
- Otherwise merge the first k, for the largest k >= 2 whose merged bill is below their bill alone.
- Capacity rule: when the caller reports that a requests-per-minute limit binds (`rpm_pressure`, the
  fraction of the binding RPM limit in use, at or above `MergePolicy.pressure_threshold`) and
  `MergePolicy.capacity_merge` is on, the largest k whose merged bill is at most `max_premium` times its
  bill alone is taken instead: one call for k members frees k - 1 requests of the limit, and the policy
  says how much more that may cost.
- Otherwise k = 1: send each member alone.

The bills are estimates: outputs are each member's expected answer (its max_tokens or an estimate), and the
cached tokens come from the caller's model of the provider cache (`prompt_cache`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from mergebroker.merge.pricing import ModelPrice, cost_usd

REQUEST_TAG_TOKENS = 6
"""Input tokens one member's `<K42>...</K42>` block adds beyond its question (o200k_base, separator included;
measured in tests/merge/test_prompt.py)."""
RESPONSE_TAG_TOKENS = 7
"""Output tokens one `<K42>...</K42>` answer block adds beyond its answer: `merge.prompt.BLOCK_OVERHEAD_TOKENS`
(repeated here because this module imports only pricing; a test keeps the two equal)."""


@dataclass(frozen=True, slots=True)
class MemberTokens:
    """One member's token counts: its prompt sent alone, its question inside a merged call, its expected answer,
    and what the provider's cache would read (and, for Anthropic, write) of its prompt sent alone."""

    alone_prompt: int
    question: int
    output: int
    alone_cached: int = 0
    alone_cache_write: int = 0

    def __post_init__(self) -> None:
        _check_counts(self, ("alone_prompt", "question", "output", "alone_cached", "alone_cache_write"))


@dataclass(frozen=True, slots=True)
class MergeLayout:
    """The merged call's own tokens: the shared part counted once, the header, the chat framing, the tags per
    member, and what the provider's cache would read (the shared prefix, when it is at least the cache's
    minimum and was sent recently) and write (Anthropic) of the merged prompt."""

    shared: int
    header: int
    framing: int = 0
    request_tag: int = REQUEST_TAG_TOKENS
    response_tag: int = RESPONSE_TAG_TOKENS
    cached: int = 0
    cache_write: int = 0

    def __post_init__(self) -> None:
        _check_counts(self, ("shared", "header", "framing", "request_tag", "response_tag", "cached", "cache_write"))

    @property
    def fixed(self) -> int:
        """Prompt tokens the merged call sends once, whatever its size."""
        return self.shared + self.header + self.framing


@dataclass(frozen=True, slots=True)
class MergePolicy:
    """The capacity rule's settings (see the module docstring)."""

    capacity_merge: bool = True
    pressure_threshold: float = 0.9
    max_premium: float = 1.10

    def __post_init__(self) -> None:
        if self.max_premium < 1 or not 0 <= self.pressure_threshold <= 1:
            raise ValueError("need max_premium >= 1 and 0 <= pressure_threshold <= 1")


class MergeReason(StrEnum):
    """Why `decide` chose its size."""

    UNPRICED = "unpriced"  # no price known: merged as before prices
    CHEAPER = "cheaper"  # the merged call is expected to cost less
    CAPACITY = "capacity"  # costs more, within max_premium, while the RPM limit binds
    NOT_CHEAPER = "not_cheaper"  # no merge of two or more would pay: sent alone
    SINGLE = "single"  # only one member


@dataclass(frozen=True, slots=True)
class MergeDecision:
    """How many members to merge (taken in order; 1 means send alone), why, and the expected bills of the
    first `quoted` members: the merged ones when merging, else all of them (the merge that was refused).
    The bills are None for an unpriced model."""

    size: int
    reason: MergeReason
    alone_usd: float | None
    merged_usd: float | None
    quoted: int


def alone_bill(price: ModelPrice, members: Sequence[MemberTokens]) -> float:
    """USD for sending each member on its own, with the provider's cache as estimated per member."""
    return sum(_alone_cost(price, m) for m in members)


def merged_bill(price: ModelPrice, members: Sequence[MemberTokens], layout: MergeLayout) -> float:
    """USD for one merged call carrying `members`."""
    questions = sum(m.question + layout.request_tag for m in members)
    outputs = sum(m.output + layout.response_tag for m in members)
    return _merged_cost(price, layout, questions, outputs)


def merge_size(price: ModelPrice | None, members: Sequence[MemberTokens], layout: MergeLayout, *,
               policy: MergePolicy = MergePolicy(), rpm_pressure: float = 0.0) -> int:
    """`decide(...).size`: how many of `members`, from the first, to merge (1: send alone)."""
    return decide(price, members, layout, policy=policy, rpm_pressure=rpm_pressure).size


def decide(price: ModelPrice | None, members: Sequence[MemberTokens], layout: MergeLayout, *,
           policy: MergePolicy = MergePolicy(), rpm_pressure: float = 0.0) -> MergeDecision:
    """The merge decision of the module docstring. `rpm_pressure` is the fraction of the binding
    requests-per-minute limit in use (True counts as 1.0)."""
    n = len(members)
    if n == 0:
        raise ValueError("a merge decision needs at least one member")
    if price is None:
        return MergeDecision(n, MergeReason.UNPRICED, None, None, n)
    quotes = _quotes(price, members, layout)
    if n == 1:
        return MergeDecision(1, MergeReason.SINGLE, quotes[0][0], quotes[0][1], 1)
    pressed = policy.capacity_merge and float(rpm_pressure) >= policy.pressure_threshold
    for k in range(n, 1, -1):
        alone, merged = quotes[k - 1]
        if merged < alone or (pressed and merged <= alone * policy.max_premium):
            reason = MergeReason.CHEAPER if merged < alone else MergeReason.CAPACITY
            return MergeDecision(k, reason, alone, merged, k)
    return MergeDecision(1, MergeReason.NOT_CHEAPER, quotes[-1][0], quotes[-1][1], n)


def _quotes(price: ModelPrice, members: Sequence[MemberTokens], layout: MergeLayout) -> list[tuple[float, float]]:
    """(alone, merged) bills of the first k members, for k = 1..n, in one pass."""
    alone = 0.0
    questions = outputs = 0
    quotes: list[tuple[float, float]] = []
    for member in members:
        alone += _alone_cost(price, member)
        questions += member.question + layout.request_tag
        outputs += member.output + layout.response_tag
        quotes.append((alone, _merged_cost(price, layout, questions, outputs)))
    return quotes


def _alone_cost(price: ModelPrice, member: MemberTokens) -> float:
    return cost_usd(price, member.alone_prompt, member.alone_cached, member.alone_cache_write, member.output)


def _merged_cost(price: ModelPrice, layout: MergeLayout, questions: int, outputs: int) -> float:
    prompt = layout.fixed + questions
    # The cache cannot read or write more of the merged prompt than there is of it.
    cached = min(layout.cached, prompt)
    write = min(layout.cache_write, prompt - cached)
    return cost_usd(price, prompt, cached, write, outputs)


@dataclass(frozen=True, slots=True)
class BreakEven:
    """The terms of the break-even formula in the module docstring, in USD, for identical members.

    `min_members` is the smallest n >= 2 with F + n*A < n*P, or None when P <= A (merging never pays).
    """

    fixed_usd: float
    added_usd: float
    alone_input_usd: float
    min_members: int | None

    def pays(self, n: int) -> bool:
        """Whether merging `n` such members costs less than sending them alone."""
        return self.fixed_usd + n * self.added_usd < n * self.alone_input_usd


def break_even(price: ModelPrice, member: MemberTokens, layout: MergeLayout) -> BreakEven:
    """F, A and P for members like `member` (its answer cancels out: it is billed the same either way)."""
    cached = min(layout.cached, layout.fixed)
    fixed = cost_usd(price, layout.fixed, cached, min(layout.cache_write, layout.fixed - cached))
    added = cost_usd(price, member.question + layout.request_tag, completion_tokens=layout.response_tag)
    alone = cost_usd(price, member.alone_prompt, member.alone_cached, member.alone_cache_write)
    saving = alone - added
    if saving <= 0:
        return BreakEven(fixed, added, alone, None)
    terms = BreakEven(fixed, added, alone, None)
    # F / (P - A) can land a rounding error off an exact tie: start just below it and let `pays` decide.
    n = max(2, math.floor(fixed / saving) - 1)
    while not terms.pays(n):
        n += 1
    return BreakEven(fixed, added, alone, n)


def _check_counts(obj: object, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a non-negative integer, got {value!r}")
