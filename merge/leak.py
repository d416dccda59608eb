"""Detect answers of a merged call that leaked another member's request.

An answer leaks when it contains another member's ID, or a verbatim run of at least `min_words`
consecutive words of another member's request that does not also occur in the answering member's own
request (so two questions that share a phrase do not trip it). A request shorter than `min_words` (but of
at least `SHORT_FLOOR` words) is protected as a whole: its full word sequence quoted in another member's
answer is a leak too. Words are compared lower-cased with punctuation stripped; each text is cut into
word n-grams once per length in use, so the check stays linear in total words.

An answer also leaks when it holds another member's distinctive token (a PIN, an email, a URL, an ID)
that its own request does not hold, however disguised: see `merge.distinctive`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence

from mergebroker.merge.distinctive import distinctive_tokens, stolen_tokens

_WORD = re.compile(r"\w+")
SHORT_FLOOR = 4  # below this, a whole request is too common a phrase to call quoting it a leak


def find_leaks(answers: Mapping[str, str], requests: Mapping[str, str], *, min_words: int = 8) -> set[str]:
    """Return the IDs of members whose answer quotes another member's request or names its ID."""
    if min_words < 1:
        raise ValueError("min_words must be at least 1")
    words = {member: _words(text) for member, text in requests.items()}
    sources = _protected_runs(words, min_words)
    all_ids = {i.lower() for i in (*requests, *answers)}
    tokens = {member: distinctive_tokens(text) for member, text in requests.items()}
    leaked: set[str] = set()
    for member, answer in answers.items():
        if _names_other_id(answer, member, all_ids) or _quotes_other(
                _words(answer), words.get(member, []), member, sources):
            leaked.add(member)
            continue
        others = set().union(*(t for other, t in tokens.items() if other != member))
        if stolen_tokens(answer, requests.get(member, ""), others):
            leaked.add(member)
    return leaked


def _protected_runs(words: Mapping[str, list[str]], min_words: int) -> dict[int, dict[tuple[str, ...], set[str]]]:
    """Run length -> word run -> the members whose request it comes from."""
    sources: dict[int, dict[tuple[str, ...], set[str]]] = {}
    for member, ws in words.items():
        if len(ws) >= min_words:
            runs = _ngrams(ws, min_words)
        elif len(ws) >= SHORT_FLOOR:
            runs = iter([tuple(ws)])
        else:
            continue
        table = sources.setdefault(len(ws) if len(ws) < min_words else min_words, {})
        for run in runs:
            table.setdefault(run, set()).add(member)
    return sources


def _quotes_other(answer: Sequence[str], own: Sequence[str], member: str,
                  sources: Mapping[int, Mapping[tuple[str, ...], set[str]]]) -> bool:
    for n, table in sources.items():
        own_runs = set(_ngrams(own, n))  # the member's own words are never a leak
        for run in _ngrams(answer, n):
            holders = table.get(run)
            if holders and member not in holders and run not in own_runs:
                return True
    return False


def _names_other_id(answer: str, member: str, all_ids: set[str]) -> bool:
    """`all_ids` lower-case: one set intersection per answer, not one lookup per member (bulk calls carry many)."""
    named = {w.lower() for w in _WORD.findall(answer)} & all_ids
    return bool(named - {member.lower()})


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _ngrams(words: Sequence[str], n: int) -> Iterator[tuple[str, ...]]:
    return (tuple(words[i:i + n]) for i in range(len(words) - n + 1))
