"""A merged call's usage is apportioned to members in whole tokens that add up exactly to the reported totals."""

from __future__ import annotations

import random

from mergebroker.merge.usage import apportion_usage, largest_remainder
from mergebroker.token_usage import TokenUsage


def _sums(result: dict[str, TokenUsage]) -> tuple[int, int]:
    return sum(u.prompt_tokens for u in result.values()), sum(u.completion_tokens for u in result.values())


def test_shared_tokens_split_evenly_and_own_tokens_kept():
    result = apportion_usage(TokenUsage(130, 90), member_prompt_tokens={"a": 10, "b": 20, "c": 0},
                             member_completion_weights={"a": 1, "b": 1, "c": 1})
    assert [result[m].prompt_tokens for m in "abc"] == [44, 53, 33]
    assert [result[m].completion_tokens for m in "abc"] == [30, 30, 30]
    assert result["a"].total_tokens == 74


def test_completion_tokens_follow_weights_with_largest_remainder():
    result = apportion_usage(TokenUsage(3, 10), member_prompt_tokens={"a": 0, "b": 0, "c": 0},
                             member_completion_weights={"a": 1, "b": 1, "c": 1})
    assert [result[m].completion_tokens for m in "abc"] == [4, 3, 3]
    weighted = apportion_usage(TokenUsage(0, 100), member_prompt_tokens={"a": 0, "b": 0},
                               member_completion_weights={"a": 300, "b": 100})
    assert (weighted["a"].completion_tokens, weighted["b"].completion_tokens) == (75, 25)


def test_own_counts_above_the_report_are_scaled_down_to_the_report():
    result = apportion_usage(TokenUsage(50, 0), member_prompt_tokens={"a": 40, "b": 60}, member_completion_weights={})
    assert (result["a"].prompt_tokens, result["b"].prompt_tokens) == (20, 30)


def test_cache_reads_and_writes_are_shared_evenly_within_each_prompt_share():
    """The provider's cache holds the shared prefix: its reads and writes are split evenly, never past a share."""
    result = apportion_usage(TokenUsage(300, 20, cached_tokens=200, cache_write_tokens=60),
                             member_prompt_tokens={"a": 10, "b": 30}, member_completion_weights={"a": 1, "b": 1})
    assert [result[m].cached_tokens for m in "ab"] == [100, 100]
    assert [result[m].cache_write_tokens for m in "ab"] == [30, 30]
    assert all(u.cached_tokens + u.cache_write_tokens <= u.prompt_tokens for u in result.values())
    assert result["a"].as_body()["prompt_tokens_details"] == {"cached_tokens": 100}


def test_counted_usage_stays_marked_as_counted():
    result = apportion_usage(TokenUsage(12, counted=True), member_prompt_tokens={"a": 2, "b": 2},
                             member_completion_weights={})
    assert all(u.counted for u in result.values()) and _sums(result) == (12, 0)


def test_no_members_gives_no_usage():
    assert apportion_usage(TokenUsage(5), member_prompt_tokens={}, member_completion_weights={}) == {}


def test_random_usages_always_sum_exactly_to_the_report():
    rng = random.Random(42)
    for _ in range(300):
        n = rng.randint(1, 8)
        own = {f"m{i}": rng.randint(0, 200) for i in range(n)}
        weights = {f"m{i}": rng.choice([0, rng.randint(1, 500)]) for i in range(n)}
        prompt = rng.randint(0, 2000)
        usage = TokenUsage(prompt, rng.randint(0, 3000), cached_tokens=rng.randint(0, prompt))
        result = apportion_usage(usage, member_prompt_tokens=own, member_completion_weights=weights)
        assert _sums(result) == (usage.prompt_tokens, usage.completion_tokens)
        assert sum(u.cached_tokens for u in result.values()) == usage.cached_tokens
        assert all(0 <= u.cached_tokens <= u.prompt_tokens for u in result.values())


def test_largest_remainder_splits_evenly_when_all_weights_are_zero():
    assert largest_remainder(7, [0, 0, 0]) == [3, 2, 2]
    assert largest_remainder(0, [1, 2]) == [0, 0]
