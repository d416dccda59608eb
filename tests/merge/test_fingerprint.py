"""Fingerprints are equal exactly when two requests would get the same answer from an upstream."""

from __future__ import annotations

import pytest

from mergebroker.merge.fingerprint import chat_fingerprint, embedding_fingerprint, normalize_text


def _body(**overrides):
    body = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "temperature": 0.2,
    }
    body.update(overrides)
    return body


def test_normalize_text_strips_collapses_whitespace_and_optionally_lowercases():
    assert normalize_text("  Hello \n\t World  ", lowercase=False) == "Hello World"
    assert normalize_text("  Hello \n\t World  ", lowercase=True) == "hello world"


def test_whitespace_and_case_variants_share_a_fingerprint():
    variant = _body(messages=[
        {"role": "system", "content": "  you are   TERSE. "},
        {"role": "user", "content": "what is the\ncapital of   france?"},
    ])
    assert chat_fingerprint(variant) == chat_fingerprint(_body())


def test_case_matters_when_lowercasing_is_off():
    upper = _body(messages=[{"role": "user", "content": "HELLO"}])
    lower = _body(messages=[{"role": "user", "content": "hello"}])
    assert chat_fingerprint(upper, lowercase=False) != chat_fingerprint(lower, lowercase=False)
    assert chat_fingerprint(upper) == chat_fingerprint(lower)


def test_absent_and_null_fields_share_a_fingerprint():
    assert chat_fingerprint(_body(seed=None, stop=None, tools=None)) == chat_fingerprint(_body())


def test_max_completion_tokens_stands_in_for_max_tokens():
    assert chat_fingerprint(_body(max_tokens=50)) == chat_fingerprint(_body(max_completion_tokens=50))
    assert chat_fingerprint(_body(max_tokens=50)) != chat_fingerprint(_body(max_tokens=51))


def test_integral_float_equals_int_and_single_stop_equals_list():
    assert chat_fingerprint(_body(temperature=1)) == chat_fingerprint(_body(temperature=1.0))
    assert chat_fingerprint(_body(stop="END")) == chat_fingerprint(_body(stop=["END"]))


@pytest.mark.parametrize("change", [
    {"temperature": 0.3},
    {"model": "gpt-4o"},
    {"seed": 7},
    {"top_p": 0.5},
    {"n": 2},
    {"stop": ["\n"]},
    {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"logprobs": True},
])
def test_answer_changing_fields_change_the_fingerprint(change):
    assert chat_fingerprint(_body(**change)) != chat_fingerprint(_body())


def test_cache_version_changes_the_fingerprint():
    assert chat_fingerprint(_body(), cache_version="2") != chat_fingerprint(_body())


def test_role_name_and_message_order_change_the_fingerprint():
    base = _body()
    named = _body(messages=[base["messages"][0], {**base["messages"][1], "name": "alice"}])
    swapped = _body(messages=list(reversed(base["messages"])))
    assert len({chat_fingerprint(base), chat_fingerprint(named), chat_fingerprint(swapped)}) == 3


def test_text_parts_are_normalised_and_other_parts_kept():
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}}
    a = _body(messages=[{"role": "user", "content": [{"type": "text", "text": "Look  HERE"}, image]}])
    b = _body(messages=[{"role": "user", "content": [{"type": "text", "text": "look here "}, image]}])
    other = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/b.png"}}
    c = _body(messages=[{"role": "user", "content": [{"type": "text", "text": "look here"}, other]}])
    assert chat_fingerprint(a) == chat_fingerprint(b) != chat_fingerprint(c)


def test_tool_turn_state_changes_the_fingerprint():
    call = lambda i: [{"role": "tool", "tool_call_id": i, "content": "42"}]  # noqa: E731
    assert chat_fingerprint(_body(messages=call("a"))) != chat_fingerprint(_body(messages=call("b")))


def test_fingerprint_is_hex_sha256():
    fp = chat_fingerprint(_body())
    assert len(fp) == 64 and int(fp, 16) >= 0


def test_embedding_fingerprint_depends_on_model_text_dimensions_and_version():
    base = embedding_fingerprint("m", "Hello  world", dimensions=None, cache_version="1")
    assert base == embedding_fingerprint("m", " Hello world ", dimensions=None, cache_version="1")
    assert base != embedding_fingerprint("m", "hello world", dimensions=None, cache_version="1")
    lowered = embedding_fingerprint("m", "HELLO world", dimensions=None, cache_version="1", lowercase=True)
    assert lowered == embedding_fingerprint("m", "hello world", dimensions=None, cache_version="1", lowercase=True)
    others = {
        embedding_fingerprint("m2", "Hello world", dimensions=None, cache_version="1"),
        embedding_fingerprint("m", "Hello world", dimensions=256, cache_version="1"),
        embedding_fingerprint("m", "Hello world", dimensions=None, cache_version="2"),
    }
    assert base not in others and len(others) == 3


def test_chat_and_embedding_fingerprints_never_collide():
    assert chat_fingerprint({"model": "m"}) != embedding_fingerprint("m", "", dimensions=None, cache_version="1")


@pytest.mark.parametrize("change", [
    {"top_k": 5},
    {"min_p": 0.1},
    {"service_tier": "flex"},
    {"repetition_penalty": 1.2},
    {"extra_body_vendor_knob": {"mode": "fast"}},
], ids=lambda c: next(iter(c)))
def test_unknown_body_fields_change_the_fingerprint(change):
    assert chat_fingerprint(_body(**change)) != chat_fingerprint(_body())


@pytest.mark.parametrize("change", [
    {"user": "alice"},
    {"safety_identifier": "u-1"},
    {"stream": False},
    {"stream_options": {"include_usage": True}},
    {"store": True},
    {"metadata": {"team": "x"}},
    {"prompt_cache_key": "k"},
    {"broker": {"tier": "batch"}},
], ids=lambda c: next(iter(c)))
def test_fields_that_cannot_change_the_answer_leave_the_fingerprint_alone(change):
    assert chat_fingerprint(_body(**change)) == chat_fingerprint(_body())


def test_a_body_field_named_like_an_internal_key_cannot_collide_with_it():
    assert chat_fingerprint(_body(cache_version="2")) != chat_fingerprint(_body(), cache_version="2")


def test_unknown_message_fields_change_the_fingerprint():
    base = _body()
    tagged = _body(messages=[base["messages"][0], {**base["messages"][1], "cache_control": {"type": "ephemeral"}}])
    assert chat_fingerprint(tagged) != chat_fingerprint(base)


def test_without_whitespace_collapsing_only_the_ends_are_stripped():
    assert normalize_text("  def f():\n    return 1\n", lowercase=False, collapse_whitespace=False) == (
        "def f():\n    return 1")
    indented = _body(messages=[{"role": "user", "content": "if x:\n    y()"}])
    flat = _body(messages=[{"role": "user", "content": "if x: y()"}])
    assert chat_fingerprint(indented) == chat_fingerprint(flat)
    assert chat_fingerprint(indented, collapse_whitespace=False) != chat_fingerprint(flat, collapse_whitespace=False)
    padded = _body(messages=[{"role": "user", "content": "  if x:\n    y()\n"}])
    assert chat_fingerprint(padded, collapse_whitespace=False) == chat_fingerprint(indented, collapse_whitespace=False)
