"""Tools cross the Anthropic translation both ways: function tools and every tool choice become Anthropic's forms,
`tool_use` replies become OpenAI `tool_calls` with JSON-string arguments, and streamed `input_json_delta`s become
tool-call deltas with the right index, and the id and name on each call's first chunk."""

from __future__ import annotations

import json

import pytest

from mergebroker.errors import UpstreamUnsupported
from mergebroker.providers.anthropic.reply import to_completion
from mergebroker.providers.anthropic.stream import DONE, StreamTranslator
from mergebroker.providers.anthropic.translate import to_messages
from tests.helpers.sse import event

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "strict": True,
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}


def translate(**body) -> dict:
    return to_messages({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
                       default_max_tokens=64).body


def test_function_tools_become_anthropic_tools():
    out = translate(tools=[WEATHER, NOW])
    assert out["tools"] == [
        {"name": "weather", "description": "Weather in a city", "strict": True,
         "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}},
        {"name": "now", "input_schema": {"type": "object", "properties": {}}}]
    assert "tool_choice" not in out  # auto is Anthropic's default too


@pytest.mark.parametrize("choice, parallel, expected", [
    ("auto", None, {"type": "auto"}), ("none", None, {"type": "none"}), ("required", None, {"type": "any"}),
    ({"type": "function", "function": {"name": "now"}}, None, {"type": "tool", "name": "now"}),
    (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
    ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
    ("none", False, {"type": "none"}),
])
def test_tool_choice_and_parallel_tool_calls_map_to_anthropic_forms(choice, parallel, expected):
    assert translate(tools=[WEATHER, NOW], tool_choice=choice, parallel_tool_calls=parallel)["tool_choice"] == expected


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice"),
])
def test_tools_without_a_translation_are_refused_by_path(body, param):
    with pytest.raises(UpstreamUnsupported) as info:
        translate(**body)
    assert info.value.param == param


def test_a_tool_use_reply_becomes_tool_calls_with_json_string_arguments():
    message = {"id": "msg_1", "type": "message", "model": "claude-x", "stop_reason": "tool_use",
               "content": [{"type": "text", "text": "Checking."},
                           {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
                           {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}],
               "usage": {"input_tokens": 9, "output_tokens": 20}}
    choice = to_completion(message, created=0)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"] == [
        {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "toolu_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    only_calls = to_completion({**message, "content": message["content"][1:]}, created=0)["choices"][0]["message"]
    assert only_calls["content"] is None and len(only_calls["tool_calls"]) == 2


def tool_start(index: int, tool_id: str, name: str) -> bytes:
    return event("content_block_start", index=index,
                 content_block={"type": "tool_use", "id": tool_id, "name": name, "input": {}})


def json_delta(index: int, piece: str) -> bytes:
    return event("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": piece})


PARALLEL_STREAM = [
    event("message_start", message={"id": "msg_2", "model": "claude-x", "usage": {"input_tokens": 5}}),
    event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    event("content_block_delta", index=0, delta={"type": "text_delta", "text": "On it."}),
    event("content_block_stop", index=0),
    tool_start(1, "toolu_a", "weather"), json_delta(1, ""), json_delta(1, '{"city": '), json_delta(1, '"Oslo"}'),
    event("content_block_stop", index=1),
    tool_start(2, "toolu_b", "now"), json_delta(2, "{}"), event("content_block_stop", index=2),
    event("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 30}),
    event("message_stop"),
]


def test_streamed_tool_use_becomes_tool_call_deltas_with_index_id_and_name_first():
    out = []
    translator = StreamTranslator(created=0)
    for raw in PARALLEL_STREAM:
        out += translator.feed(raw)
    assert out[-1] == DONE
    deltas = [json.loads(c[6:])["choices"][0]["delta"] for c in out[:-1]]
    assert deltas[1] == {"content": "On it."}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls == [
        {"index": 0, "id": "toolu_a", "type": "function", "function": {"name": "weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": '}}, {"index": 0, "function": {"arguments": '"Oslo"}'}},
        {"index": 1, "id": "toolu_b", "type": "function", "function": {"name": "now", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}}]
    assert json.loads(out[-2][6:])["choices"][0]["finish_reason"] == "tool_calls"
