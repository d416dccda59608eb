"""Settling a merged reply decides each member's answer, fallback reason or error, without a loop or HTTP."""

from __future__ import annotations

from typing import Any

import pytest

from mergebroker.errors import NotFound, UpstreamTimeout, UpstreamUnavailable
from mergebroker.merge.settle import SettleMember, SettleOptions, apply_stop, settle, settle_block, settle_call_error
from mergebroker.merge.split import BlockFailure

A, B = "K42", "B07"
QUESTION_A = "What is the capital city of France and why did it become the capital"
QUESTION_B = "How many legs does a spider have and how does it use them to walk"
OPTIONS = SettleOptions(leak_min_words=6)


def members(stop: Any = None) -> list[SettleMember]:
    return [SettleMember(A, QUESTION_A, 14, 20, stop), SettleMember(B, QUESTION_B, 16, 22, stop)]


def reply(content: Any, finish_reason: str = "stop", prompt: int = 60, completion: int = 40) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def blocks(a: str, b: str) -> str:
    return f"<{A}>\n{a}\n</{A}>\n<{B}>\n{b}\n</{B}>"


def test_good_blocks_become_answers_with_apportioned_usage_and_tokens_saved():
    s = settle(reply(blocks("Paris, since the Franks.", "Eight legs, moved in pairs.")), members(), OPTIONS)
    assert {i: a.text for i, a in s.answers.items()} == {A: "Paris, since the Franks.", B: "Eight legs, moved in pairs."}
    assert s.fallbacks == {} and s.errors == {} and s.needed_fallback is False
    assert sum(a.usage.prompt_tokens for a in s.answers.values()) == 60
    assert sum(a.usage.completion_tokens for a in s.answers.values()) == 40
    assert s.tokens_saved == 0  # 20 + 22 alone is less than the 60 the merged prompt cost


def test_tokens_saved_is_what_the_members_would_have_cost_alone_less_the_merged_prompt():
    s = settle(reply(blocks("Paris.", "Eight."), prompt=30), members(), OPTIONS)
    assert s.tokens_saved == 20 + 22 - 30


def test_stop_sequences_cut_each_answer_as_the_upstream_would_have():
    s = settle(reply(blocks("Paris. END and more", "Eight END legs")), members(stop=["END"]), OPTIONS)
    assert [s.answers[i].text for i in (A, B)] == ["Paris. ", "Eight "]
    assert apply_stop("no sequence here", "STOP") == "no sequence here"


@pytest.mark.parametrize("content", [None, 42, {"text": "x"}])
def test_a_reply_without_text_sends_every_member_alone_as_bad_reply(content):
    s = settle(reply(content), members(), OPTIONS)
    assert s.fallbacks == {A: "bad_reply", B: "bad_reply"} and s.answers == {} and s.needed_fallback is True


def test_a_reply_of_the_wrong_shape_is_a_bad_reply():
    assert settle({"choices": [None]}, members(), OPTIONS).fallbacks == {A: "bad_reply", B: "bad_reply"}
    assert settle("not a dict", members(), OPTIONS).fallbacks == {A: "bad_reply", B: "bad_reply"}


@pytest.mark.parametrize(("content", "finish_reason", "reason"), [
    (f'<{A}>\nParis.\n</{A}>', "stop", "missing"),
    (blocks("Paris.", "   "), "stop", "empty"),
    (blocks("Paris.", "Eight.") + f"\n<{B}>\nSix.\n</{B}>", "stop", "duplicated"),
    (f'<{A}>\nParis.\n</{A}>\n<{B}>\nEight legs', "stop", "malformed"),
    (f'<{A}>\nParis.\n</{A}>\n<{B}>\nEight legs', "length", "truncated"),
    (blocks("Paris.", f"Eight, unlike {A}."), "stop", "foreign_id"),
])
def test_a_broken_block_sends_its_member_alone_with_the_blocks_reason(content, finish_reason, reason):
    s = settle(reply(content, finish_reason), members(), OPTIONS)
    assert s.fallbacks == {B: reason}
    assert s.answers[A].text == "Paris." and s.needed_fallback is True


def test_an_answer_quoting_another_members_request_is_a_leak():
    s = settle(reply(blocks("Paris.", f"You asked: {QUESTION_A}")), members(), OPTIONS)
    assert s.fallbacks == {B: "leak"} and list(s.answers) == [A]


def test_settle_block_judges_one_block_alone():
    requests = {A: QUESTION_A, B: QUESTION_B}
    member = members()[0]
    assert settle_block(member, "Paris.", requests, OPTIONS).answer == "Paris."
    assert settle_block(member, BlockFailure.EMPTY, requests, OPTIONS).reason == "empty"
    assert settle_block(member, f"Re: {QUESTION_B}", requests, OPTIONS).reason == "leak"


def count_words(text: str) -> int:
    """A tokenizer of whole words for readable budgets: trailing whitespace costs a token, as in BPE."""
    return len(text.split()) + (1 if text[-1:].isspace() else 0)


WORDS = SettleOptions(leak_min_words=6, count_tokens=count_words)


def budgeted(a: int | None, b: int | None, stop: Any = None) -> list[SettleMember]:
    return [SettleMember(A, QUESTION_A, 14, 20, stop, max_tokens=a), SettleMember(B, QUESTION_B, 16, 22, stop,
                                                                                max_tokens=b)]


def test_an_answer_longer_than_its_members_budget_is_cut_there_with_length():
    s = settle(reply(blocks("one two three four five six", "uno dos")), budgeted(3, 5), WORDS)
    assert (s.answers[A].text, s.answers[A].finish_reason) == ("one two three", "length")
    assert (s.answers[B].text, s.answers[B].finish_reason) == ("uno dos", "stop")
    assert s.fallbacks == {} and s.needed_fallback is False


def test_an_answer_of_exactly_its_budget_is_whole():
    s = settle(reply(blocks("one two three", "uno")), budgeted(3, 3), WORDS)
    assert (s.answers[A].text, s.answers[A].finish_reason) == ("one two three", "stop")


def test_a_block_cut_by_the_merged_limit_after_its_budget_is_answered_with_length():
    content = f'<{A}>\nalpha beta\n</{A}>\n<{B}>\nuno dos tres cuatro</B0'
    s = settle(reply(content, "length"), budgeted(10, 3), WORDS)
    assert (s.answers[B].text, s.answers[B].finish_reason) == ("uno dos tres", "length")
    assert s.fallbacks == {}


def test_a_block_cut_by_the_merged_limit_before_its_budget_is_re_sent_alone():
    content = f'<{A}>\nalpha beta\n</{A}>\n<{B}>\nuno dos'
    s = settle(reply(content, "length"), budgeted(10, 3), WORDS)
    assert s.fallbacks == {B: "truncated"} and list(s.answers) == [A]


def test_a_block_cut_by_the_merged_limit_after_its_stop_sequence_is_whole():
    content = f'<{A}>\nalpha beta\n</{A}>\n<{B}>\nuno END dos'
    s = settle(reply(content, "length"), budgeted(10, 30, stop="END"), WORDS)
    assert (s.answers[B].text, s.answers[B].finish_reason) == ("uno ", "stop")


def test_no_member_is_charged_more_completion_tokens_than_its_budget():
    s = settle(reply(blocks("one two three four five six", "uno dos"), completion=40), budgeted(3, 50), WORDS)
    assert s.answers[A].usage.completion_tokens == 3
    assert s.answers[B].usage.completion_tokens == 37  # the rest goes to the member with room
    capped = settle(reply(blocks("one two three four five six", "uno dos"), completion=40), budgeted(3, 5), WORDS)
    assert [capped.answers[i].usage.completion_tokens for i in (A, B)] == [3, 5]


def test_cached_prompt_tokens_are_shared_evenly_between_the_answers():
    cached = reply(blocks("Paris.", "Eight."))
    cached["usage"]["prompt_tokens_details"] = {"cached_tokens": 31}
    s = settle(cached, members(), OPTIONS)
    assert sorted(a.usage.cached_tokens for a in s.answers.values()) == [15, 16]
    assert "prompt_tokens_details" not in settle(reply(blocks("P.", "E.")), members(), OPTIONS).answers[A].usage.as_body()


@pytest.mark.parametrize("exc", [UpstreamUnavailable(3), NotFound("The model 'm' does not exist.")])
def test_a_refusal_each_member_would_meet_alone_fails_them_all_at_once(exc):
    s = settle_call_error(exc, members())
    assert s.errors == {A: exc, B: exc} and s.fallbacks == {} and s.needed_fallback is None


def test_any_other_failed_merged_call_sends_every_member_alone():
    s = settle_call_error(UpstreamTimeout("the merged call took too long"), members())
    assert s.fallbacks == {A: "merged_call_failed", B: "merged_call_failed"} and s.needed_fallback is True
