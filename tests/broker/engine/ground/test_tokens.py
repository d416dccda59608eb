"""Token estimates match the o200k_base tokenizer under OpenAI's chat accounting, and the fallback stays close."""

from __future__ import annotations

import warnings

import pytest

from mergebroker.broker.engine.ground import tokens

with warnings.catch_warnings():  # bpe_openai's table loader uses a deprecated importlib call
    warnings.simplefilter("ignore", DeprecationWarning)
    import bpe_openai

    ENCODING = bpe_openai.get_encoding("o200k_base")

SAMPLES = [
    "Hello! How are you today?",
    "Summarise the causes of the First World War in three bullet points.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'SELECT name, COUNT(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC;',
    "3.14159265358979 2.718281828 1234567890 0xDEADBEEF 1e-9",
    "東京は日本の首都で、人口は約千四百万人です。",
    "Привет, мир! Как дела у тебя сегодня?",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Emoji and symbols: 🚀✨ → ≤ ≥ ∑ ∫ €100",
    '{"user": {"id": 42, "tags": ["a", "b"], "active": true}}',
]

PROSE = (
    "The quick brown fox jumps over the lazy dog. Rate limiting protects shared services from bursts of "
    "traffic, and token buckets are a simple way to express a sustained rate with a bounded burst. When a "
    "client exceeds its allowance, the server answers with a 429 status and tells the caller when to retry. "
    "Good estimates before dispatch let the broker reserve roughly what the provider will later report."
)


def truth(text: str) -> int:
    return len(ENCODING.encode_ordinary(text))


@pytest.mark.parametrize("text", SAMPLES)
def test_count_text_tokens_equals_the_real_tokenizer(text: str) -> None:
    assert tokens.count_text_tokens(text) == truth(text)


@pytest.mark.parametrize("text", SAMPLES)
def test_prompt_estimate_follows_the_openai_message_rule(text: str) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]
    expected = 3 + sum(3 + truth(m["role"]) + truth(m["content"]) for m in messages)
    assert tokens.estimate_prompt_tokens(messages) == expected


def test_single_hi_message_costs_the_eight_tokens_openai_reports() -> None:
    assert tokens.estimate_prompt_tokens([{"role": "user", "content": "hi"}]) == 8


def test_text_parts_count_like_text_and_images_get_flat_estimates() -> None:
    parts = [{"type": "text", "text": SAMPLES[1]},
             {"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}},
             {"type": "image_url", "image_url": {"url": "data:,"}}]
    got = tokens.estimate_prompt_tokens([{"role": "user", "content": parts}])
    assert got == 3 + 3 + truth("user") + truth(SAMPLES[1]) + tokens.IMAGE_TOKENS_LOW_DETAIL + tokens.IMAGE_TOKENS_DEFAULT


def test_a_name_costs_its_tokens_plus_one() -> None:
    plain = tokens.estimate_prompt_tokens([{"role": "user", "content": "hello"}])
    named = tokens.estimate_prompt_tokens([{"role": "user", "content": "hello", "name": "alice"}])
    assert named - plain == truth("alice") + 1


def test_special_token_text_is_counted_as_ordinary_text() -> None:
    assert tokens.count_text_tokens("<|endoftext|>") == truth("<|endoftext|>") > 1


def test_embedding_inputs_count_strings_and_token_arrays() -> None:
    assert tokens.estimate_embedding_tokens(SAMPLES[0]) == truth(SAMPLES[0])
    assert tokens.estimate_embedding_tokens(SAMPLES[:3]) == sum(truth(s) for s in SAMPLES[:3])
    assert tokens.estimate_embedding_tokens([1, 2, 3, 4]) == 4
    assert tokens.estimate_embedding_tokens([[1, 2], [3, 4, 5]]) == 5
    assert tokens.estimate_embedding_tokens([]) == 0


def test_fallback_is_within_35_percent_on_english_prose() -> None:
    estimate = tokens.fallback_text_tokens(PROSE)
    assert abs(estimate - truth(PROSE)) <= 0.35 * truth(PROSE)
    assert tokens.fallback_text_tokens("abcde") == 2


def test_prompt_estimate_uses_the_fallback_when_the_tokenizer_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "_encoder", lambda: None)
    got = tokens.estimate_prompt_tokens([{"role": "user", "content": PROSE}])
    assert got == 3 + 3 + tokens.fallback_text_tokens("user") + tokens.fallback_text_tokens(PROSE)


@pytest.mark.parametrize("text", ["word " * 250_000, "hello world " * 100_000], ids=["over_200k_tokens", "1M_chars"])
def test_a_text_too_long_for_the_tokenizer_is_estimated_instead_of_failing(text: str) -> None:
    assert tokens.count_text_tokens(text) == tokens.fallback_text_tokens(text)
    messages = [{"role": "user", "content": text}]
    assert tokens.estimate_prompt_tokens(messages) >= tokens.fallback_text_tokens(text)
    assert tokens.estimate_embedding_tokens([text, "short"]) == tokens.fallback_text_tokens(text) + truth("short")


def test_the_prompt_token_bound_is_never_under_the_prompts_tokens() -> None:
    """What lets a short prompt skip tokenization for the prompt-cache model: the bound never undercounts,
    whatever the script (CJK, emoji and Arabic take several bytes, and often several tokens, a character)."""
    for text in [*SAMPLES, "🚀" * 50, "\u0301" * 40, ""]:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        assert tokens.prompt_token_bound(messages) >= len(tokens.prompt_token_ids(messages))
