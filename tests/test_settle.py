"""Settling a merged reply decides each member's answer, fallback reason or error, without a loop or HTTP."""

from __future__ import annotations

from typing import Any

import pytest

from mergebroker.errors import NotFound, UpstreamTimeout, UpstreamUnavailable
from mergebroker.merge.settle import (SettleMember, SettleOptions, apply_stop, settle, settle_block,
                                      settle_call_error)
from mergebroker.merge.split import BlockFailure

A, B = "aaaaaa", "bbbbbb"
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
    return f'<response id="{A}">\n{a}\n</response>\n<response id="{B}">\n{b}\n</response>'


def test_good_blocks_become_answers_with_apportioned_usage_and_tokens_saved():
    s = settle(reply(blocks("Paris, since the Franks.", "Eight legs, moved in pairs.")), members(), OPTIONS)
    assert {i: a.text for i, a in s.answers.items()} == {A: "Paris, since the Franks.", B: "Eight legs, moved in pairs."}
    assert s.fallbacks == {} and s.errors == {} and s.needed_fallback is False
    assert sum(a.usage["prompt_tokens"] for a in s.answers.values()) == 60
    assert sum(a.usage["completion_tokens"] for a in s.answers.values()) == 40
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
    (f'<response id="{A}">\nParis.\n</response>', "stop", "missing"),
    (blocks("Paris.", "   "), "stop", "empty"),
    (blocks("Paris.", "Eight.") + f'\n<response id="{B}">\nSix.\n</response>', "stop", "duplicated"),
    (f'<response id="{A}">\nParis.\n</response>\n<response id="{B}">\nEight legs', "stop", "malformed"),
    (f'<response id="{A}">\nParis.\n</response>\n<response id="{B}">\nEight legs', "length", "truncated"),
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
    assert settle_block(A, "Paris.", requests, OPTIONS).answer == "Paris."
    assert settle_block(A, BlockFailure.EMPTY, requests, OPTIONS).reason == "empty"
    assert settle_block(A, f"Re: {QUESTION_B}", requests, OPTIONS).reason == "leak"


@pytest.mark.parametrize("exc", [UpstreamUnavailable(3), NotFound("The model 'm' does not exist.")])
def test_a_refusal_each_member_would_meet_alone_fails_them_all_at_once(exc):
    s = settle_call_error(exc, members())
    assert s.errors == {A: exc, B: exc} and s.fallbacks == {} and s.needed_fallback is None


def test_any_other_failed_merged_call_sends_every_member_alone():
    s = settle_call_error(UpstreamTimeout("the merged call took too long"), members())
    assert s.fallbacks == {A: "merged_call_failed", B: "merged_call_failed"} and s.needed_fallback is True
