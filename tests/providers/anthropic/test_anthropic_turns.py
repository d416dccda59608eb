"""Conversations become turns a strict Messages API accepts: tool calls and results paired and grouped, one role per
turn, a user turn first, system messages moved out of the way, and what cannot be paired refused by path."""

from __future__ import annotations

import pytest

from mergebroker.errors import UpstreamUnsupported
from mergebroker.providers.anthropic.turns import OPENING_USER_TURN, split_messages

CALLS = [{"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
         {"id": "call_b", "type": "function", "function": {"name": "time", "arguments": ""}}]


def test_a_tool_round_trip_becomes_tool_use_then_grouped_tool_results_first_in_the_next_user_turn():
    system, turns = split_messages([
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_a", "content": "Sunny, 21C"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "14:05"}]},
        {"role": "user", "content": "Thanks, and briefly please."}])
    assert system == []
    assert turns == [
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "call_a", "name": "weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "call_b", "name": "time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_a", "content": "Sunny, 21C"},
            {"type": "tool_result", "tool_use_id": "call_b", "content": "14:05"},
            {"type": "text", "text": "Thanks, and briefly please."}]}]


def test_turns_of_one_role_combine_and_a_mid_conversation_system_message_moves_to_system():
    system, turns = split_messages([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "One"},
        {"role": "developer", "content": "Now answer in French."}, {"role": "user", "content": "Two"},
        {"role": "assistant", "content": "Un"}, {"role": "assistant", "content": "Deux"}])
    assert system == ["Be brief.", "Now answer in French."]
    assert [t["role"] for t in turns] == ["user", "assistant"]
    assert turns[0]["content"] == [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}]
    assert turns[1]["content"] == [{"type": "text", "text": "Un"}, {"type": "text", "text": "Deux"}]


def test_a_conversation_opening_with_the_assistant_gets_a_user_turn_first_and_a_prefill_loses_trailing_space():
    _, turns = split_messages([{"role": "assistant", "content": "Hello! How can I help?"},
                               {"role": "user", "content": "Name a colour."},
                               {"role": "assistant", "content": "The colour is "}])
    assert turns == [{"role": "user", "content": OPENING_USER_TURN},
                     {"role": "assistant", "content": "Hello! How can I help?"},
                     {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


def test_an_assistant_turn_with_only_tool_calls_and_a_replayed_refusal_are_carried():
    _, turns = split_messages([{"role": "user", "content": "Go"},
                               {"role": "assistant", "content": None, "refusal": None, "tool_calls": CALLS[:1]},
                               {"role": "tool", "tool_call_id": "call_a", "content": ""},
                               {"role": "assistant", "content": None, "refusal": "I cannot help with that."}])
    assert turns[1]["content"] == [{"type": "tool_use", "id": "call_a", "name": "weather", "input": {"city": "Oslo"}}]
    assert turns[2]["content"] == [{"type": "tool_result", "tool_use_id": "call_a"}]  # empty result: no content
    assert turns[3] == {"role": "assistant", "content": "I cannot help with that."}


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_z", "content": "1"}],
     "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": CALLS},
      {"role": "tool", "tool_call_id": "call_a", "content": "1"}, {"role": "user", "content": "and?"}],
     "messages[1].tool_calls"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}]}], "messages[1].tool_calls[0].type"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "function_call": {"name": "f"}}],
     "messages[1].function_call"),
    ([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
     "messages[0].content[0].type"),
])
def test_what_cannot_be_paired_or_carried_is_refused_by_path(messages, param):
    with pytest.raises(UpstreamUnsupported) as info:
        split_messages(messages)
    assert info.value.param == param and info.value.status == 400
