"""A member's own output budget inside a merged call: the one rule for where its answer ends (pure).

A caller's `max_tokens` is a cost and latency contract, whether its request was sent alone or merged.
Alone, the provider stops at it; merged, the model writes every member's block without knowing the
members' budgets, so the broker cuts each member's text where the provider would have: at the longest
prefix that counts at most `budget` tokens, with `finish_reason: "length"`. The same rule serves a
whole merged reply (`merge.settle`), an answer released early and a member's own stream.

Tokens are counted by a callable (`count_tokens(text) -> int`): the broker passes its tokenizer
(`broker.engine.tokens.count_text_tokens`), which this layer may not import. `estimate_tokens` stands in
where none is given (tests, and the rare caller without a tokenizer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

TokenCounter = Callable[[str], int]

STOP = "stop"
LENGTH = "length"


def estimate_tokens(text: str) -> int:
    """Tokens of `text` without a tokenizer: one per 4 characters, rounded up (OpenAI's rule of thumb)."""
    return math.ceil(len(text) / 4)


@dataclass(frozen=True)
class BudgetCut:
    """A member's text as its budget leaves it, and why it ends."""

    text: str
    finish_reason: str  # STOP: within budget; LENGTH: cut at (or ended exactly at) the budget


def cut_to_budget(text: str, budget: int | None, count_tokens: TokenCounter) -> BudgetCut:
    """`text` if it fits in `budget` tokens, else its longest prefix that does, finishing with "length".

    Token counts of prefixes grow with their length (closely enough for BPE), so the cut is found by
    bisection: about log2(len(text)) counts. `budget` None (or below 1) means no budget of its own.
    """
    if budget is None or budget < 1 or count_tokens(text) <= budget:
        return BudgetCut(text, STOP)
    low, high = 0, len(text)  # count(text[:low]) <= budget < count(text[:high])
    while high - low > 1:
        middle = (low + high) // 2
        if count_tokens(text[:middle]) <= budget:
            low = middle
        else:
            high = middle
    return BudgetCut(text[:low], LENGTH)


def reached_budget(text: str, budget: int | None, count_tokens: TokenCounter) -> bool:
    """Whether `text` (a member's answer so far) has used its whole budget: nothing more could follow it."""
    return budget is not None and budget >= 1 and count_tokens(text) >= budget


class BudgetWatch:
    """Tells, as a member's text streams in, when it has gone past its budget, counting its tokens rarely.

    Past, not at: text that counts exactly `budget` tokens may still end inside its last word, so the
    member's end is decided once the text holds more than its budget, where `cut_to_budget` then cuts.
    A token is at least one character, so text of `n` tokens needs `budget + 1 - n` more characters
    before it can exceed `budget` (less one for a token that may span the seam): it is counted again
    only once it has grown that much, so a stream of thousands of deltas is counted a few times.
    """

    def __init__(self, budget: int | None, count_tokens: TokenCounter) -> None:
        self._budget = budget if budget is not None and budget >= 1 else None
        self._count = count_tokens
        self._next_check = 0 if self._budget is None else self._budget  # characters

    def exceeded(self, text: str) -> bool:
        """Whether `text` (the member's whole text so far, not a delta) holds more tokens than its budget."""
        if self._budget is None or len(text) < self._next_check:
            return False
        tokens = self._count(text)
        if tokens > self._budget:
            return True
        self._next_check = len(text) + max(1, self._budget - tokens)
        return False
