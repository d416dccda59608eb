"""A reply's usage is read once into a typed value: counts, the cached part, and nothing invented."""

from __future__ import annotations

from mergebroker.broker.engine.chat.jobs import ChatOutcome
from mergebroker.output_budget import token_budget
from mergebroker.token_usage import TokenUsage


def test_openai_usage_with_cached_tokens_is_read_with_its_cached_part() -> None:
    usage = TokenUsage.from_body({"usage": {"prompt_tokens": 2000, "completion_tokens": 50, "total_tokens": 2050,
                                            "prompt_tokens_details": {"cached_tokens": 1920}}})
    assert usage == TokenUsage(2000, 50, cached_tokens=1920)
    assert usage.total_tokens == 2050
    assert usage.as_body()["prompt_tokens_details"] == {"cached_tokens": 1920}


def test_responses_and_anthropic_usage_read_to_the_same_counts_and_write_back_unchanged() -> None:
    responses = {"input_tokens": 3000, "output_tokens": 40, "total_tokens": 3040,
                 "input_tokens_details": {"cached_tokens": 2000, "cache_write_tokens": 500},
                 "output_tokens_details": {"reasoning_tokens": 10}}
    anthropic = {"input_tokens": 500, "output_tokens": 40, "cache_read_input_tokens": 2000,
                 "cache_creation_input_tokens": 500}
    from_responses, from_anthropic = TokenUsage.from_body({"usage": responses}), TokenUsage.from_body(anthropic)
    assert from_responses == TokenUsage(3000, 40, 2000, 500, reasoning_tokens=10)
    assert from_anthropic == TokenUsage(3000, 40, 2000, 500)  # Anthropic's input_tokens leaves the cache out
    assert from_responses.as_responses() == responses and from_anthropic.as_anthropic() == anthropic
    assert from_anthropic.uncached_prompt_tokens == 500


def test_a_body_without_usage_or_with_junk_counts_reports_none() -> None:
    assert TokenUsage.from_body({"choices": []}) is None
    assert TokenUsage.from_body({"usage": {"prompt_tokens": "12", "completion_tokens": -1}}) is None
    assert TokenUsage.from_body({"usage": None}) is None


def test_a_cached_count_larger_than_the_prompt_is_capped_at_the_prompt() -> None:
    usage = TokenUsage.from_body({"prompt_tokens": 10, "completion_tokens": 1,
                                  "prompt_tokens_details": {"cached_tokens": 99}})
    assert usage is not None and usage.cached_tokens == 10


def test_an_outcome_carries_its_bodys_usage_without_reparsing() -> None:
    outcome = ChatOutcome({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, "p", 0.0)
    assert outcome.usage == TokenUsage(3, 4)
    assert ChatOutcome({}, None, 0.0).usage is None


def test_the_completion_budget_prefers_max_completion_tokens_and_accepts_whole_floats() -> None:
    assert token_budget({"max_tokens": 10, "max_completion_tokens": 20}, 256) == 20
    assert token_budget({"max_tokens": 10}, 256) == 10
    assert token_budget({"max_tokens": 50.0}, 256) == 50
    assert token_budget({"max_tokens": 0}, 256) == 256
    assert token_budget({"max_tokens": True}, 256) == 256
    assert token_budget({}, 256) == 256
