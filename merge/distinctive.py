"""Distinctive tokens: the parts of a request worth stealing (PINs, account numbers, emails, URLs, IDs).

A model told to "repeat the other requests" can disguise what it copies: joined with underscores,
interleaved with other words, cut into short chunks, reversed, spaced out letter by letter, reduced to
its digits or encoded in base64. Word-run checks (`merge.leak`) miss most of these, but the valuable
part of a request is usually one distinctive token, and that survives every disguise once case,
spacing and separators are removed. So each request's distinctive tokens are squashed (look-alikes
folded, lower-cased, only letters and digits kept) and looked for in the squashed answer, in its
reversal, and in whatever base64 runs in the answer decode to.

Distinctive: a run of 4 or more digits (separators between them allowed), an email address, a URL,
or an alphanumeric ID of 8 or more characters holding both letters and digits.
"""

from __future__ import annotations

import base64
import binascii
import re

from mergebroker.confusables import fold

_DIGIT_RUN = re.compile(r"\d(?:[\s\-_./]*\d){3,}")
_EMAIL = re.compile(r"[\w.+\-]+@[\w\-]+(?:\.[\w\-]+)+")
_URL = re.compile(r"(?:[a-z][a-z0-9+.\-]*://|www\.)[^\s<>\"']+", re.IGNORECASE)
_ID = re.compile(r"\b(?=[\w\-]*\d)(?=[\w\-]*[a-zA-Z])[\w\-]{8,}\b")
_NOT_ALNUM = re.compile(r"[^a-z0-9]+")
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_\-]{12,}={0,2}")


def squash(text: str) -> str:
    """`text` folded, lower-cased, with everything but ASCII letters and digits removed."""
    return _NOT_ALNUM.sub("", fold(text).lower())


def distinctive_tokens(text: str) -> set[str]:
    """The squashed distinctive tokens of `text` (see the module docstring)."""
    folded = fold(text)
    found: set[str] = set()
    for pattern in (_DIGIT_RUN, _EMAIL, _URL, _ID):
        found.update(squash(m.group()) for m in pattern.finditer(folded))
    return {token for token in found if len(token) >= 4}


def answer_views(answer: str) -> list[str]:
    """The squashed forms a token may hide in: the answer, its reversal and its decoded base64 runs."""
    flat = squash(answer)
    views = [flat, flat[::-1]]
    for run in _BASE64_RUN.findall(fold(answer)):
        decoded = _decode_base64(run)
        if decoded:
            views.append(squash(decoded))
    return views


def stolen_tokens(answer: str, own_request: str, others: set[str]) -> set[str]:
    """The tokens of `others` found in `answer` that its own request does not contain itself."""
    if not others:
        return set()
    own = squash(own_request)
    candidates = {t for t in others if t not in own}
    if not candidates:
        return set()
    views = answer_views(answer)
    return {t for t in candidates if any(t in view for view in views)}


def _decode_base64(run: str) -> str | None:
    padded = run + "=" * (-len(run) % 4)
    for decode in (base64.b64decode, base64.urlsafe_b64decode):
        try:
            return decode(padded).decode("utf-8")
        except (binascii.Error, ValueError):
            continue
    return None
