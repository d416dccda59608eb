"""An answer that quotes another member's question or names its ID is flagged as a leak; shared phrasing is not."""

from __future__ import annotations

import pytest

from mergebroker.merge.leak import find_leaks

REQUESTS = {
    "aaa111": "Please explain in simple terms how photosynthesis turns sunlight into chemical energy for plants.",
    "bbb222": "What were the main economic causes of the French Revolution in the late eighteenth century?",
}


def test_clean_answers_are_not_flagged():
    answers = {
        "aaa111": "Plants capture light with chlorophyll and store its energy in sugars.",
        "bbb222": "Debt from wars, bad harvests and an unfair tax system.",
    }
    assert find_leaks(answers, REQUESTS) == set()


def test_copied_eight_word_span_of_another_question_is_flagged():
    copied = "the main economic causes of the French Revolution in the late eighteenth century"
    answers = {"aaa111": f"Also, regarding {copied.upper()}: debt.", "bbb222": "Debt and taxes."}
    assert find_leaks(answers, REQUESTS) == {"aaa111"}


def test_comparison_ignores_case_and_punctuation():
    answers = {"aaa111": "What were the main, economic causes; of the French-Revolution?", "bbb222": "Debt."}
    assert find_leaks(answers, REQUESTS) == {"aaa111"}


def test_seven_word_span_is_below_the_default_threshold():
    answers = {"aaa111": "the main economic causes of the French", "bbb222": "Debt."}
    assert find_leaks(answers, REQUESTS) == set()
    assert find_leaks(answers, REQUESTS, min_words=5) == {"aaa111"}


def test_quoting_its_own_question_is_fine():
    answers = {"aaa111": "You asked how photosynthesis turns sunlight into chemical energy for plants: ...",
               "bbb222": "Debt."}
    assert find_leaks(answers, REQUESTS) == set()


def test_phrasing_shared_by_both_questions_does_not_trigger():
    shared = "could you please give me a short and clear summary of"
    requests = {
        "aaa111": f"{shared} the history of the Roman empire?",
        "bbb222": f"{shared} how vaccines train the immune system?",
    }
    answers = {
        "aaa111": f"You asked: {shared} the Roman empire. It rose and fell.",
        "bbb222": "Vaccines show the immune system a harmless piece of a pathogen.",
    }
    assert find_leaks(answers, requests) == set()


def test_naming_another_members_id_is_flagged():
    answers = {"aaa111": "As in request BBB222, light matters.", "bbb222": "Debt (see aaa111x for more)."}
    assert find_leaks(answers, REQUESTS) == {"aaa111"}


def test_min_words_must_be_positive():
    with pytest.raises(ValueError):
        find_leaks({}, {}, min_words=0)


def test_a_short_request_quoted_whole_is_a_leak_but_tiny_ones_are_not():
    requests = {"aaaaaa": "What is my account balance?", "bbbbbb": "tell me a joke please now",
                "cccccc": "Yes or no?"}
    answers = {"aaaaaa": "Your balance is private.",
               "bbbbbb": "Sure. Someone asked: what is my account balance. Also yes or no.",
               "cccccc": "Yes."}
    assert find_leaks(answers, requests, min_words=8) == {"bbbbbb"}


def test_a_short_request_is_not_a_leak_when_the_answering_member_asked_it_too():
    requests = {"aaaaaa": "What is my account balance?", "bbbbbb": "What is my account balance? And my limit?"}
    answers = {"aaaaaa": "x", "bbbbbb": "You asked: what is my account balance and my limit."}
    assert find_leaks(answers, requests, min_words=8) == set()
