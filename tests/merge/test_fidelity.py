"""A merged answer is scored against the same request's answer alone: exact for short answers, equal for JSON,
by embedding cosine for prose, with a too-short merged answer marked down."""

from __future__ import annotations

import pytest

from mergebroker.merge.fidelity import AnswerKind, compare, length_ratio, needs_cosine, normalise


@pytest.mark.parametrize(("merged", "alone"), [
    ("Paris", "paris."),
    ("**Paris**", " Paris "),
    ("1,000", "1000.0"),
    ('"Tuesday"', "tuesday!"),
    ("ｐａｒｉｓ", "Paris"),  # fullwidth letters fold under NFKC
])
def test_short_answers_that_differ_only_in_form_match(merged, alone):
    result = compare(merged, alone)
    assert (result.kind, result.score) == (AnswerKind.SHORT, 1.0)


@pytest.mark.parametrize(("merged", "alone"), [("Paris", "Lyon"), ("41", "42"), ("-3", "3")])
def test_short_answers_that_differ_in_content_score_zero(merged, alone):
    assert compare(merged, alone).score == 0.0


def test_numbers_are_read_as_numbers():
    assert normalise("12.50") == "12.5"
    assert normalise("-7") == "-7"


def test_json_answers_compare_as_values_whatever_their_layout():
    assert compare('```json\n{"a": 1, "b": [1, 2]}\n```', '{"b":[1,2],"a":1}').score == 1.0
    result = compare('{"a": 1}', '{"a": 2}')
    assert (result.kind, result.score) == (AnswerKind.JSON, 0.0)
    assert compare("not json at all", '{"a": 1}').score == 0.0


def test_prose_uses_the_callers_cosine_and_marks_down_a_cut_short_answer():
    alone = "The treaty was signed in 1648 and ended thirty years of war across central Europe, " * 2
    merged = alone[: len(alone) // 4]
    assert needs_cosine(alone, alone)
    assert compare(alone, alone, cosine=0.97).score == pytest.approx(0.97)
    short = compare(merged, alone, cosine=0.95)
    assert short.kind is AnswerKind.PROSE
    assert short.length_ratio == pytest.approx(length_ratio(merged, alone))
    assert short.score == pytest.approx(short.length_ratio / 0.5)


def test_prose_without_a_cosine_falls_back_to_word_overlap():
    a = "one two three four five six seven eight nine ten"
    b = "one two three four five six seven eight nine eleven"
    assert compare(a, b).score == pytest.approx(9 / 11)
