"""Only single-turn text requests are mergeable, and only compatible ones share a merged call."""

from __future__ import annotations

import pytest

from mergebroker.merge.shape import MergeShape, compatibility_key, merge_shape


def _body(**overrides):
    body = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a prime number."},
        ],
        "temperature": 0.0,
    }
    body.update(overrides)
    return body


def test_system_plus_user_text_is_mergeable():
    assert merge_shape(_body()) == MergeShape(system_prompt="Be brief.", user_text="Name a prime number.")


def test_lone_user_message_is_mergeable_without_system_prompt():
    shape = merge_shape(_body(messages=[{"role": "user", "content": "Hi there"}]))
    assert shape == MergeShape(system_prompt=None, user_text="Hi there")


def test_developer_role_and_text_parts_count_as_text():
    body = _body(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}]},
    ])
    assert merge_shape(body) == MergeShape(system_prompt="Be brief.", user_text="One\nTwo")


def test_explicit_defaults_do_not_block_merging():
    body = _body(n=1, stream=False, logprobs=False, tools=None, modalities=["text"])
    assert merge_shape(body) is not None


@pytest.mark.parametrize("change", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"tool_choice": "auto"},
    {"functions": [{"name": "f"}]},
    {"response_format": {"type": "json_object"}},
    {"logprobs": True},
    {"top_logprobs": 2},
    {"n": 2},
    {"stream": True},
    {"audio": {"voice": "alloy", "format": "wav"}},
    {"modalities": ["text", "audio"]},
    {"prediction": {"type": "content", "content": "x"}},
], ids=lambda c: next(iter(c)))
def test_requests_with_non_text_features_are_not_mergeable(change):
    assert merge_shape(_body(**change)) is None


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
    [{"role": "assistant", "content": "a"}],
    [],
], ids=["multi-turn", "two-users", "no-user", "system-last", "assistant-only", "empty"])
def test_anything_but_one_system_and_one_user_message_is_not_mergeable(messages):
    assert merge_shape(_body(messages=messages)) is None


def test_images_in_user_content_are_not_mergeable():
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]
    assert merge_shape(_body(messages=[{"role": "user", "content": parts}])) is None


def test_blank_or_missing_user_text_is_not_mergeable():
    assert merge_shape(_body(messages=[{"role": "user", "content": "  \n "}])) is None
    assert merge_shape(_body(messages=[{"role": "user", "content": None}])) is None
    assert merge_shape(_body(messages=[{"role": "user", "content": []}])) is None


def test_messages_carrying_tool_state_are_not_mergeable():
    message = {"role": "user", "content": "hi", "tool_call_id": "t1"}
    assert merge_shape(_body(messages=[message])) is None


def _key(body, **kwargs):
    kwargs.setdefault("scope_value", "tenant-a")
    return compatibility_key(body, merge_shape(body), **kwargs)


def test_compatible_requests_share_a_key_regardless_of_their_question():
    other = _body(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}])
    assert _key(_body()) == _key(other)


@pytest.mark.parametrize("change", [
    {"model": "gpt-4o"},
    {"temperature": 0.7},
    {"top_p": 0.5},
    {"stop": ["\n"]},
    {"seed": 3},
    {"messages": [{"role": "system", "content": "Be verbose."}, {"role": "user", "content": "Hi"}]},
    {"messages": [{"role": "user", "content": "Hi"}]},
], ids=["model", "temperature", "top_p", "stop", "seed", "system", "no-system"])
def test_incompatible_requests_get_different_keys(change):
    assert _key(_body(**change)) != _key(_body())


def test_scope_value_separates_keys():
    assert _key(_body(), scope_value="tenant-a") != _key(_body(), scope_value="tenant-b")


def test_tagged_mode_ignores_the_system_prompt():
    other = _body(messages=[{"role": "system", "content": "Be verbose."}, {"role": "user", "content": "Hi"}])
    assert _key(_body(), include_system=False) == _key(other, include_system=False)
    assert _key(_body()) != _key(other)


@pytest.mark.parametrize("change", [
    {"top_k": 5},
    {"min_p": 0.1},
    {"service_tier": "flex"},
    {"vendor_knob": {"mode": "fast"}},
    {"store": True},
    {"metadata": {"team": "x"}},
    {"safety_identifier": "u-1"},
], ids=lambda c: next(iter(c)))
def test_requests_differing_in_any_other_field_never_share_a_merged_call(change):
    assert _key(_body(**change)) != _key(_body())


@pytest.mark.parametrize("change", [
    {"max_tokens": 50},
    {"max_completion_tokens": 70},
    {"user": "alice"},
    {"stream": False},
    {"n": 1},
    {"logprobs": False},
    {"modalities": ["text"]},
    {"broker": {"tier": "batch"}},
], ids=lambda c: next(iter(c)))
def test_per_member_fields_and_explicit_defaults_do_not_keep_requests_apart(change):
    assert _key(_body(**change)) == _key(_body())
