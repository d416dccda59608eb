"""A merged call's usage is apportioned to members in whole tokens that add up exactly to the reported totals."""

from __future__ import annotations

import random

from mergebroker.merge.usage import apportion_usage, largest_remainder


def _sums(result):
    return (
        sum(u["prompt_tokens"] for u in result.values()),
        sum(u["completion_tokens"] for u in result.values()),
    )


def test_shared_tokens_split_evenly_and_own_tokens_kept():
    result = apportion_usage(
        {"prompt_tokens": 130, "completion_tokens": 90},
        shared_prompt_tokens=99,
        member_prompt_tokens={"a": 10, "b": 20, "c": 0},
        member_completion_weights={"a": 1, "b": 1, "c": 1},
    )
    assert [result[m]["prompt_tokens"] for m in "abc"] == [44, 53, 33]
    assert [result[m]["completion_tokens"] for m in "abc"] == [30, 30, 30]
    assert result["a"]["total_tokens"] == 74


def test_completion_tokens_follow_weights_with_largest_remainder():
    result = apportion_usage(
        {"prompt_tokens": 3, "completion_tokens": 10},
        shared_prompt_tokens=3,
        member_prompt_tokens={"a": 0, "b": 0, "c": 0},
        member_completion_weights={"a": 1, "b": 1, "c": 1},
    )
    assert [result[m]["completion_tokens"] for m in "abc"] == [4, 3, 3]
    weighted = apportion_usage(
        {"prompt_tokens": 0, "completion_tokens": 100},
        shared_prompt_tokens=0,
        member_prompt_tokens={"a": 0, "b": 0},
        member_completion_weights={"a": 300, "b": 100},
    )
    assert (weighted["a"]["completion_tokens"], weighted["b"]["completion_tokens"]) == (75, 25)


def test_own_counts_above_the_report_are_scaled_down_to_the_report():
    result = apportion_usage(
        {"prompt_tokens": 50, "completion_tokens": 0},
        shared_prompt_tokens=10,
        member_prompt_tokens={"a": 40, "b": 60},
        member_completion_weights={},
    )
    assert (result["a"]["prompt_tokens"], result["b"]["prompt_tokens"]) == (20, 30)


def test_missing_prompt_report_falls_back_to_the_broker_counts():
    result = apportion_usage(
        {"completion_tokens": 5},
        shared_prompt_tokens=4,
        member_prompt_tokens={"a": 3, "b": 7},
        member_completion_weights={"a": 0, "b": 0},
    )
    assert _sums(result) == (14, 5)
    assert result["a"]["prompt_tokens"] == 5


def test_no_members_gives_no_usage():
    assert apportion_usage({"prompt_tokens": 5}, shared_prompt_tokens=0,
                           member_prompt_tokens={}, member_completion_weights={}) == {}


def test_random_usages_always_sum_exactly_to_the_report():
    rng = random.Random(42)
    for _ in range(300):
        n = rng.randint(1, 8)
        own = {f"m{i}": rng.randint(0, 200) for i in range(n)}
        weights = {f"m{i}": rng.choice([0, rng.randint(1, 500)]) for i in range(n)}
        usage = {"prompt_tokens": rng.randint(0, 2000), "completion_tokens": rng.randint(0, 3000)}
        result = apportion_usage(usage, shared_prompt_tokens=rng.randint(0, 100),
                                 member_prompt_tokens=own, member_completion_weights=weights)
        assert _sums(result) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] >= 0 for u in result.values())


def test_largest_remainder_splits_evenly_when_all_weights_are_zero():
    assert largest_remainder(7, [0, 0, 0]) == [3, 2, 2]
    assert largest_remainder(0, [1, 2]) == [0, 0]
