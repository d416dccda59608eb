"""A merge is made when its expected bill beats the members' bills alone, or buys capacity under an RPM limit."""

from __future__ import annotations

import pytest

from mergebroker.merge.merge_cost import (
    RESPONSE_TAG_TOKENS,
    MemberTokens,
    MergeLayout,
    MergePolicy,
    MergeReason,
    alone_bill,
    break_even,
    decide,
    merge_size,
    merged_bill,
)
from mergebroker.merge.pricing import CacheStyle, ModelPrice
from mergebroker.merge.prompt import BLOCK_OVERHEAD_TOKENS
from mergebroker.merge.prompt_cache import ProviderCacheModel

FOUR_O = ModelPrice(input=2.50, cached_input=1.25, output=10.00, cache=CacheStyle.OPENAI)
CLAUDE = ModelPrice(input=3.00, cached_input=0.30, output=15.00, cache_write=3.75, cache=CacheStyle.ANTHROPIC)
HEADER = 77  # merge.prompt.DEFAULT_HEADER for 8 requests, in o200k_base tokens
FRAMING = 7  # chat-format tokens around the messages
OPENAI_CACHE = ProviderCacheModel.for_style("openai")


def _members(n: int, *, shared: int, question: int, output: int, cached: int = 0) -> list[MemberTokens]:
    return [MemberTokens(alone_prompt=shared + question + FRAMING, question=question, output=output,
                         alone_cached=cached) for _ in range(n)]


def _system_prompt_workload() -> tuple[list[MemberTokens], MergeLayout]:
    """The issue's first case: a 2,400-token system prompt the provider caches, 8 short questions."""
    cached = OPENAI_CACHE.cacheable(2400)
    members = _members(8, shared=2400, question=40, output=85, cached=cached)
    return members, MergeLayout(shared=2400, header=HEADER, framing=FRAMING, cached=cached)


def _short_question_layout() -> MergeLayout:
    return MergeLayout(shared=0, header=HEADER, framing=FRAMING)


def test_issue_cached_system_prompt_merged_bill_is_well_under_alone():
    """With the system prompt cached either way, one merged call still costs well under half of eight alone."""
    members, layout = _system_prompt_workload()
    decision = decide(FOUR_O, members, layout)
    assert (decision.size, decision.reason) == (8, MergeReason.CHEAPER)
    assert decision.merged_usd < 0.5 * decision.alone_usd
    assert decision.alone_usd == pytest.approx(alone_bill(FOUR_O, members))
    assert decision.merged_usd == pytest.approx(merged_bill(FOUR_O, members, layout))


def test_issue_short_questions_without_a_system_prompt_are_sent_alone():
    """When the tags cost more than what is shared, no merge pays: k == 1."""
    members = _members(8, shared=0, question=15, output=85)
    decision = decide(FOUR_O, members, _short_question_layout())
    assert (decision.size, decision.reason, decision.quoted) == (1, MergeReason.NOT_CHEAPER, 8)
    assert decision.merged_usd > decision.alone_usd
    assert break_even(FOUR_O, members[0], _short_question_layout()).min_members is None


def test_issue_unpriced_model_always_merges():
    """Without a price the broker merges every member, as before, and reports no bill."""
    members = _members(8, shared=0, question=15, output=85)
    decision = decide(None, members, _short_question_layout())
    assert (decision.size, decision.reason, decision.alone_usd, decision.merged_usd) == (
        8, MergeReason.UNPRICED, None, None)


def test_capacity_rule_accepts_a_small_premium_while_rpm_binds():
    """A merge 5% dearer than sending alone is refused normally and made when the RPM limit binds."""
    members = _members(8, shared=0, question=15, output=300)
    layout = _short_question_layout()
    assert merge_size(FOUR_O, members, layout) == 1
    decision = decide(FOUR_O, members, layout, rpm_pressure=0.95)
    assert (decision.size, decision.reason) == (8, MergeReason.CAPACITY)
    assert 1.0 < decision.merged_usd / decision.alone_usd <= 1.10
    assert merge_size(FOUR_O, members, layout, rpm_pressure=True) == 8


def test_capacity_rule_refuses_a_premium_above_the_limit():
    """Under RPM pressure a merge dearer than max_premium allows is still refused."""
    members = _members(8, shared=0, question=15, output=85)
    assert merge_size(FOUR_O, members, _short_question_layout(), rpm_pressure=1.0) == 1


def test_capacity_rule_needs_pressure_at_the_threshold_and_the_setting_on():
    """Pressure below the threshold, or the rule switched off, leaves the cost rule alone."""
    members = _members(8, shared=0, question=15, output=300)
    layout = _short_question_layout()
    assert merge_size(FOUR_O, members, layout, rpm_pressure=0.5) == 1
    off = MergePolicy(capacity_merge=False)
    assert merge_size(FOUR_O, members, layout, policy=off, rpm_pressure=1.0) == 1


def test_merge_size_is_the_largest_paying_prefix_of_the_members():
    """Members that lose money merged are taken while the earlier ones' saving still covers them."""
    sharers = [MemberTokens(alone_prompt=1157, question=50, output=100)] * 2
    losers = [MemberTokens(alone_prompt=60, question=53, output=100)] * 20
    members = sharers + losers
    layout = MergeLayout(shared=1100, header=HEADER, framing=FRAMING)
    size = merge_size(FOUR_O, members, layout)
    assert size == 22
    assert merged_bill(FOUR_O, members[:size], layout) < alone_bill(FOUR_O, members[:size])
    for k in range(size + 1, len(members) + 1):
        assert merged_bill(FOUR_O, members[:k], layout) >= alone_bill(FOUR_O, members[:k])


def test_bills_follow_the_token_counts():
    """Alone and merged bills, worked by hand: cached tokens at the cached price, tags on both sides."""
    members = [MemberTokens(alone_prompt=1200, question=100, output=50, alone_cached=1024)] * 2
    layout = MergeLayout(shared=1100, header=HEADER, framing=FRAMING, cached=1024)
    assert alone_bill(FOUR_O, members) == pytest.approx(2 * (176 * 2.5 + 1024 * 1.25 + 50 * 10) / 1e6)
    assert merged_bill(FOUR_O, members, layout) == pytest.approx((372 * 2.5 + 1024 * 1.25 + 114 * 10) / 1e6)


def test_merged_cache_write_is_billed_at_the_write_price():
    """A merged Claude call that writes its shared prefix pays the write premium on it."""
    members = _members(2, shared=2400, question=40, output=10)
    layout = MergeLayout(shared=2400, header=HEADER, cache_write=2400)
    assert merged_bill(CLAUDE, members, layout) == pytest.approx((169 * 3.0 + 2400 * 3.75 + 34 * 15.0) / 1e6)


def test_break_even_says_where_merging_starts_to_pay():
    """With a short uncached system prompt, two members do not pay and three do, as F / (P - A) says."""
    members = _members(5, shared=100, question=40, output=85)
    layout = MergeLayout(shared=100, header=HEADER, framing=FRAMING)
    terms = break_even(FOUR_O, members[0], layout)
    assert terms.min_members == 3
    assert not terms.pays(2) and terms.pays(3)
    assert merge_size(FOUR_O, members[:2], layout) == 1
    assert merge_size(FOUR_O, members, layout) == 5


@pytest.mark.parametrize("question", [5, 40, 200])
def test_break_even_minimum_is_the_first_size_that_pays(question):
    """Across system-prompt sizes, min_members is exactly where `pays` turns true, and decide agrees."""
    for shared in range(0, 3000, 37):
        cached = OPENAI_CACHE.cacheable(shared)
        member = _members(1, shared=shared, question=question, output=85, cached=cached)[0]
        layout = MergeLayout(shared=shared, header=HEADER, framing=FRAMING, cached=cached)
        terms = break_even(FOUR_O, member, layout)
        if terms.min_members is None:
            assert not any(terms.pays(n) for n in range(2, 200))
            continue
        assert terms.pays(terms.min_members)
        assert terms.min_members == 2 or not terms.pays(terms.min_members - 1)
        assert merge_size(FOUR_O, [member] * terms.min_members, layout) == terms.min_members


def test_a_single_member_is_sent_alone():
    """One member has nothing to merge with."""
    members, layout = _system_prompt_workload()
    decision = decide(FOUR_O, members[:1], layout)
    assert (decision.size, decision.reason) == (1, MergeReason.SINGLE)


def test_invalid_inputs_are_refused():
    """No members, negative counts and a premium below 1 are errors."""
    with pytest.raises(ValueError, match="at least one member"):
        decide(FOUR_O, [], _short_question_layout())
    with pytest.raises(ValueError, match="question"):
        MemberTokens(alone_prompt=10, question=-1, output=5)
    with pytest.raises(ValueError, match="max_premium"):
        MergePolicy(max_premium=0.9)


def test_response_tag_default_matches_the_prompt_block_overhead():
    """The response tags' cost here is the one the merged call's token budget reserves."""
    assert RESPONSE_TAG_TOKENS == BLOCK_OVERHEAD_TOKENS
