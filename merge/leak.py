"""Detect answers of a merged call that leaked another member's request.

An answer leaks when it contains another member's ID, or a verbatim run of at least `min_words`
consecutive words of another member's request that does not also occur in the answering member's own
request (so two questions that share a phrase do not trip it). Words are compared lower-cased with
punctuation stripped. Each text is cut into word n-grams once, so the check is linear in total words.
"""

from __future__ import annotations

import re
from typing import Iterator, Mapping

_WORD = re.compile(r"\w+")


def find_leaks(answers: Mapping[str, str], requests: Mapping[str, str], *, min_words: int = 8) -> set[str]:
    """Return the IDs of members whose answer quotes another member's request or names its ID."""
    if min_words < 1:
        raise ValueError("min_words must be at least 1")
    owners: dict[tuple[str, ...], set[str]] = {}
    for member, text in requests.items():
        for gram in _ngrams(text, min_words):
            owners.setdefault(gram, set()).add(member)
    all_ids = set(requests) | set(answers)
    leaked: set[str] = set()
    for member, answer in answers.items():
        if _names_other_id(answer, member, all_ids) or _quotes_other(answer, member, owners, min_words):
            leaked.add(member)
    return leaked


def _quotes_other(answer: str, member: str, owners: dict[tuple[str, ...], set[str]], n: int) -> bool:
    for gram in _ngrams(answer, n):
        holders = owners.get(gram)
        if holders and member not in holders:
            return True
    return False


def _names_other_id(answer: str, member: str, all_ids: set[str]) -> bool:
    tokens = {w.lower() for w in _WORD.findall(answer)}
    return any(other.lower() in tokens for other in all_ids if other != member)


def _ngrams(text: str, n: int) -> Iterator[tuple[str, ...]]:
    words = [w.lower() for w in _WORD.findall(text)]
    return (tuple(words[i:i + n]) for i in range(len(words) - n + 1))
