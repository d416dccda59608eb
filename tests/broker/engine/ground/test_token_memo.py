"""Long texts are tokenized once: a conversation sent again every turn costs only its new messages."""

from __future__ import annotations

from mergebroker.broker.engine.ground import tokens
from mergebroker.broker.engine.ground.token_memo import TokenMemo

LONG = "The broker counts every prompt before it sends it, so that limits and prices hold. " * 8


def test_a_long_text_is_remembered_and_a_short_one_is_not() -> None:
    memo = TokenMemo(min_chars=100, max_chars=10_000)
    assert memo.get(LONG) is None
    kept = memo.put(LONG, [1, 2, 3])
    assert list(kept) == [1, 2, 3]
    assert list(memo.get("".join(list(LONG))) or []) == [1, 2, 3]  # found by its text, not by the object


def test_the_memo_holds_at_most_max_chars_dropping_the_least_recently_used() -> None:
    memo = TokenMemo(min_chars=1, max_chars=30)
    first, second, third = "a" * 10, "b" * 10, "c" * 10
    for text in (first, second, third):
        memo.put(text, [len(text)])
    assert memo.get(first) is not None  # now the most recent: `second` is the least recently used
    memo.put("d" * 10, [10])
    assert memo.get(second) is None and memo.get(first) is not None and memo.chars == 30
    memo.put("e" * 31, [31])  # larger than the whole memo: given back, never kept
    assert memo.get("e" * 31) is None and memo.chars == 30


def test_a_remembered_text_counts_what_the_tokenizer_counts(monkeypatch) -> None:
    calls: list[str] = []
    encode = tokens._encoder()
    assert encode is not None
    monkeypatch.setattr(tokens, "_encode", lambda text: calls.append(text) or encode(text))
    monkeypatch.setattr(tokens, "_MEMO", TokenMemo())
    conversation = [{"role": "system", "content": LONG}, {"role": "user", "content": "Short question?"}]
    first = tokens.estimate_prompt_tokens(conversation)
    again = tokens.estimate_prompt_tokens([dict(m) for m in conversation])
    assert first == again
    assert calls.count(LONG) == 1 and calls.count("Short question?") == 2  # short texts are not remembered
    assert tokens.count_text_tokens(LONG) == len(encode(LONG))


def test_a_conversation_grows_by_a_turn_and_its_earlier_tokens_stay_a_prefix() -> None:
    """What the provider's prefix cache is modelled on: the next turn begins with the tokens of the last."""
    conversation = [{"role": "system", "content": LONG}, {"role": "user", "content": "What is a token bucket?"},
                    {"role": "assistant", "content": "A rate limiter. " * 30}]
    before = list(tokens.prompt_token_ids(conversation))
    after = list(tokens.prompt_token_ids([*conversation, {"role": "user", "content": "And a leaky bucket?"}]))
    assert len(after) > len(before) and after[:len(before)] == before
