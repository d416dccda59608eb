"""The built-in short-answer question set: generated from a seed, every answer computed by code (pure).

Six kinds of question, each from one template, so `solve` can read any of them back and compute the
answer (the simulated upstream's quiz mode answers with it): arithmetic, unit conversions, capitals from
a fixed table, letter counting, the weekday of a date, and reversing a word. Nothing is copied from a
dataset. `mergebroker eval` uses the set to measure merged against alone answers on any upstream.
"""

from __future__ import annotations

import datetime
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasilia", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw",
    "Austria": "Vienna", "Greece": "Athens", "Ireland": "Dublin", "Peru": "Lima", "Chile": "Santiago",
    "Argentina": "Buenos Aires", "Mexico": "Mexico City", "India": "New Delhi", "China": "Beijing",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Turkey": "Ankara", "Morocco": "Rabat", "Hungary": "Budapest",
    "Denmark": "Copenhagen",
}
UNITS = {  # (from, to): factor
    ("kilometers", "meters"): 1000, ("hours", "minutes"): 60, ("minutes", "seconds"): 60,
    ("kilograms", "grams"): 1000, ("feet", "inches"): 12, ("days", "hours"): 24, ("weeks", "days"): 7,
    ("liters", "milliliters"): 1000, ("yards", "feet"): 3, ("meters", "centimeters"): 100,
}
WORDS = (
    "strawberry", "banana", "mississippi", "letter", "committee", "bookkeeper", "balloon", "parallel",
    "assessment", "possession", "engineering", "programming", "coffee", "tomorrow", "occurrence", "planet",
    "harbor", "lantern", "whisper", "marble", "orchard", "velvet", "candle", "meadow", "compass",
)
_OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b,
                                              "*": lambda a, b: a * b}
KINDS = ("arithmetic", "units", "capital", "letters", "weekday", "reverse")


@dataclass(frozen=True)
class QuizItem:
    """One question of the built-in set, its expected answer and its kind."""

    question: str
    expected: str
    kind: str


def builtin_set(n: int = 200, *, seed: int = 0) -> list[QuizItem]:
    """`n` distinct questions, the kinds in turn, drawn from `seed` (same seed, same set)."""
    rng = random.Random(seed)
    makers = (_ARITHMETIC, _UNITS, _CAPITAL, _LETTERS, _WEEKDAY, _REVERSE)
    items: list[QuizItem] = []
    seen: set[str] = set()
    # Kinds in turn; a kind whose small table is used up (capitals, words) just yields its turn.
    for attempt in range(50 * n):
        if len(items) == n:
            break
        question = makers[attempt % len(makers)].make(rng)
        if question not in seen:
            seen.add(question)
            items.append(QuizItem(question, solve(question) or "", KINDS[attempt % len(KINDS)]))
    if len(items) < n:
        raise ValueError(f"the built-in set has fewer than {n} distinct questions")
    return items


def solve(question: str) -> str | None:
    """The computed answer to a question of the built-in set (whitespace and case tolerant), else None."""
    text = " ".join(question.split())
    for template in (_ARITHMETIC, _UNITS, _CAPITAL, _LETTERS, _WEEKDAY, _REVERSE):
        match = template.pattern.fullmatch(text)
        if match:
            return template.answer(match)
    return None


@dataclass(frozen=True)
class _Template:
    pattern: re.Pattern[str]
    make: Callable[[random.Random], str]
    answer: Callable[[re.Match[str]], str | None]


def _make_arithmetic(rng: random.Random) -> str:
    op = rng.choice(list(_OPS))
    a, b = (rng.randint(2, 99), rng.randint(2, 99)) if op == "*" else (rng.randint(10, 999), rng.randint(10, 999))
    return f"What is {a} {op} {b}? Answer with the number only."


def _make_units(rng: random.Random) -> str:
    (src, dst) = rng.choice(list(UNITS))
    return f"How many {dst} are in {rng.randint(2, 60)} {src}? Answer with the number only."


def _make_letters(rng: random.Random) -> str:
    word = rng.choice(WORDS)
    return f"How many times does the letter '{rng.choice(sorted(set(word)))}' appear in '{word}'? " \
           "Answer with the number only."


def _make_weekday(rng: random.Random) -> str:
    day = datetime.date(1990, 1, 1) + datetime.timedelta(days=rng.randint(0, 15000))
    return f"What day of the week was {day.isoformat()}? Answer with the weekday name only."


def _units_answer(m: re.Match[str]) -> str | None:
    factor = UNITS.get((m["src"].lower(), m["dst"].lower()))
    return None if factor is None else str(int(m["n"]) * factor)


def _weekday_answer(m: re.Match[str]) -> str | None:
    try:
        return datetime.date.fromisoformat(m["date"]).strftime("%A")
    except ValueError:
        return None


_I = re.IGNORECASE
_ARITHMETIC = _Template(
    re.compile(r"What is (?P<a>-?\d+) (?P<op>[-+*]) (?P<b>-?\d+)\? Answer with the number only\.", _I),
    _make_arithmetic, lambda m: str(_OPS[m["op"]](int(m["a"]), int(m["b"]))))
_UNITS = _Template(
    re.compile(r"How many (?P<dst>\w+) are in (?P<n>\d+) (?P<src>\w+)\? Answer with the number only\.", _I),
    _make_units, _units_answer)
_CAPITAL = _Template(
    re.compile(r"What is the capital of (?P<country>[\w ]+)\? Answer with the city name only\.", _I),
    lambda rng: f"What is the capital of {rng.choice(sorted(CAPITALS))}? Answer with the city name only.",
    lambda m: next((c for k, c in CAPITALS.items() if k.lower() == m["country"].lower()), None))
_LETTERS = _Template(
    re.compile(r"How many times does the letter '(?P<ch>\w)' appear in '(?P<word>\w+)'\? "
               r"Answer with the number only\.", _I),
    _make_letters, lambda m: str(m["word"].lower().count(m["ch"].lower())))
_WEEKDAY = _Template(
    re.compile(r"What day of the week was (?P<date>\d{4}-\d{2}-\d{2})\? Answer with the weekday name only\.", _I),
    _make_weekday, _weekday_answer)
_REVERSE = _Template(
    re.compile(r"Reverse the word '(?P<word>\w+)'\. Answer with the reversed word only\.", _I),
    lambda rng: f"Reverse the word '{rng.choice(WORDS)}'. Answer with the reversed word only.",
    lambda m: m["word"][::-1])
