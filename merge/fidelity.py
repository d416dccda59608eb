"""How close a merged answer is to the answer the same request gets alone (pure; no I/O, no model).

`compare(merged, alone, cosine=...)` scores a pair from 0 (unrelated) to 1 (the same answer):

- short answers (both at most `SHORT_WORDS` words): normalised exact match, 1 or 0. Normalising folds
  Unicode (NFKC), case, surrounding quotes and markdown emphasis, trailing punctuation and whitespace, and
  reads numbers as numbers ("1,000.0" equals "1000");
- JSON answers (either one is a JSON object or array, a ```json fence allowed): equality of the parsed
  values, 1 or 0;
- prose (anything else): the cosine of the two answers' embeddings, computed by the caller with the
  already loaded similarity model and passed in (`needs_cosine` says when). Without it, the overlap of
  the two word sets stands in (Jaccard), which is cruder but needs no model;
- the length ratio (shorter / longer, in characters) is reported for every pair; for prose a merged
  answer much shorter or longer than alone (ratio under `LENGTH_TOLERANCE`) scores at most
  ratio / `LENGTH_TOLERANCE`, because a cut-short answer can still embed close to the full one.
"""

from __future__ import annotations

import enum
import json
import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

SHORT_WORDS = 8
LENGTH_TOLERANCE = 0.5

_WORD = re.compile(r"\w+")
_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.S)
_EDGE = " \t\r\n\"'`*_.,;:!?()[]{}"
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


class AnswerKind(enum.Enum):
    """Which rule compares a pair of answers."""

    SHORT = "short"
    JSON = "json"
    PROSE = "prose"


@dataclass(frozen=True)
class Fidelity:
    """The score of one merged answer against its alone answer (0..1), how it was judged, and the length ratio."""

    score: float
    kind: AnswerKind
    length_ratio: float


def normalise(text: str) -> str:
    """The comparable form of a short answer: NFKC, case-folded, edges stripped, whitespace collapsed,
    numbers written plainly ("1,000.50" -> "1000.5")."""
    folded = " ".join(unicodedata.normalize("NFKC", text).casefold().split()).strip(_EDGE)
    if _NUMBER.fullmatch(folded):
        value = float(folded.replace(",", ""))
        return str(int(value)) if value.is_integer() else repr(value)
    return folded


def same_short_answer(a: str, b: str) -> bool:
    """Whether two short answers are the same after `normalise`."""
    return normalise(a) == normalise(b)


def answer_kind(merged: str, alone: str) -> AnswerKind:
    """The rule that compares this pair (see the module docstring)."""
    if _json_value(merged) is not None or _json_value(alone) is not None:
        return AnswerKind.JSON
    if _word_count(merged) <= SHORT_WORDS and _word_count(alone) <= SHORT_WORDS:
        return AnswerKind.SHORT
    return AnswerKind.PROSE


def needs_cosine(merged: str, alone: str) -> bool:
    """Whether this pair is prose, where the caller should pass the embeddings' cosine to `compare`."""
    return answer_kind(merged, alone) is AnswerKind.PROSE


def compare(merged: str, alone: str, *, cosine: float | None = None) -> Fidelity:
    """Score `merged` against `alone` (see the module docstring); `cosine` is used for prose only."""
    kind = answer_kind(merged, alone)
    ratio = length_ratio(merged, alone)
    if kind is AnswerKind.JSON:
        a, b = _json_value(merged), _json_value(alone)
        score = 1.0 if a is not None and a == b else 0.0
    elif kind is AnswerKind.SHORT:
        score = 1.0 if same_short_answer(merged, alone) else 0.0
    else:
        similarity = _jaccard(merged, alone) if cosine is None or math.isnan(cosine) else cosine
        score = min(max(0.0, min(1.0, similarity)), ratio / LENGTH_TOLERANCE)
    return Fidelity(score, kind, ratio)


def length_ratio(a: str, b: str) -> float:
    """Shorter over longer length of the stripped texts (1 when both are empty)."""
    la, lb = len(a.strip()), len(b.strip())
    return 1.0 if max(la, lb) == 0 else min(la, lb) / max(la, lb)


def _json_value(text: str) -> Any:
    """The parsed JSON object or array in `text` (a code fence allowed), else None."""
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    if fenced:
        stripped = fenced.group(1).strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        value = json.loads(stripped)
    except ValueError:
        return None
    return value if isinstance(value, (dict, list)) else None


def _word_count(text: str) -> int:
    return len(_WORD.findall(text))


def _jaccard(a: str, b: str) -> float:
    wa, wb = {w.casefold() for w in _WORD.findall(a)}, {w.casefold() for w in _WORD.findall(b)}
    return 1.0 if not wa and not wb else len(wa & wb) / len(wa | wb)
