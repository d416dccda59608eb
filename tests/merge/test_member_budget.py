"""A member's own budget inside a merged call: where its text is cut, and when a growing text has gone past it."""

from __future__ import annotations

from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.merge.member_budget import BudgetWatch, cut_to_budget, estimate_tokens, reached_budget
from mergebroker.merge.split import truncated_block, without_tag_prefix
from mergebroker.merge.usage import capped_shares

TEXT = "Answer qrstuvwxyz: lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor."


def test_text_within_its_budget_is_whole_and_longer_text_is_cut_at_the_budget():
    whole = count_text_tokens(TEXT)
    assert cut_to_budget(TEXT, whole, count_text_tokens).finish_reason == "stop"
    assert cut_to_budget(TEXT, None, count_text_tokens).text == TEXT
    for budget in (1, 5, whole - 1):
        cut = cut_to_budget(TEXT, budget, count_text_tokens)
        assert cut.finish_reason == "length" and TEXT.startswith(cut.text)
        assert count_text_tokens(cut.text) <= budget < count_text_tokens(TEXT[:len(cut.text) + 1])


def test_the_cut_falls_within_a_word_of_where_a_provider_cutting_at_max_tokens_cuts():
    import bpe_openai

    encoding = bpe_openai.get_encoding("o200k_base")
    for budget in (3, 8, 13):
        provider = encoding.decode(encoding.encode(TEXT)[:budget])
        cut = cut_to_budget(TEXT, budget, count_text_tokens).text
        assert TEXT.startswith(cut) and abs(len(cut) - len(provider)) <= len(" adipiscing")


def test_reached_budget_means_nothing_more_could_follow():
    words = lambda text: len(text.split())  # noqa: E731
    assert reached_budget("one two", 2, words) and not reached_budget("one", 2, words)
    assert not reached_budget(TEXT, None, estimate_tokens)


def test_a_watch_tells_once_the_text_is_past_its_budget_and_counts_rarely():
    counted: list[str] = []

    def count(text: str) -> int:
        counted.append(text)
        return count_text_tokens(text)

    watch = BudgetWatch(50, count)
    text, crossed = "", None
    for word in (TEXT + " ") * 10:  # one character per delta
        text += word
        if watch.exceeded(text):
            crossed = text
            break
    assert crossed is not None and count_text_tokens(crossed) == 51 and count_text_tokens(crossed[:-1]) <= 50
    assert len(counted) < 30  # not once per delta
    assert not BudgetWatch(None, count).exceeded(TEXT * 100)


def test_the_block_a_length_finish_cut_is_found_with_its_text_so_far():
    content = "<K42>\nfirst\n</K42>\n<B07>\n  half an answer </B0"
    assert truncated_block(content, ["K42", "B07"], finish_reason="length") == ("B07", "half an answer ")
    assert truncated_block(content, ["K42", "B07"], finish_reason="stop") is None
    assert truncated_block(content.replace("</B0", "</B07>"), ["K42", "B07"], finish_reason="length") is None
    assert without_tag_prefix("text <") == "text " and without_tag_prefix("a < b") == "a < b"


def test_capped_shares_give_what_a_cap_refuses_to_the_others_and_never_exceed_a_cap():
    assert capped_shares(100, [1, 1], [10, None]) == [10, 90]
    assert capped_shares(100, [3, 1, 1], [10, 20, 200]) == [10, 20, 70]
    assert capped_shares(100, [1, 1], [10, 20]) == [10, 20]  # no room left: the rest is the merge's own
    assert capped_shares(7, [0, 0, 0], [None, None, None]) == [3, 2, 2]
