"""Structured output over an Anthropic upstream: native `output_config` for models that have it, else one forced
tool whose input comes back as `message.content` (plain and streamed); `json_object` with an open schema; a refusal
as `message.refusal`."""

from __future__ import annotations

import json

import pytest

from mergebroker.errors import UpstreamUnsupported
from mergebroker.providers.anthropic.reply import REFUSED, to_completion
from mergebroker.providers.anthropic.stream import StreamTranslator
from mergebroker.providers.anthropic.structured import JSON_TOOL, ReplyShape
from mergebroker.providers.anthropic.translate import to_messages
from tests.helpers.sse import event

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def call(model: str, response_format: dict, **body):
    return to_messages({"model": model, "messages": [{"role": "user", "content": "Who?"}],
                        "response_format": response_format, **body}, default_max_tokens=64)


def test_json_schema_goes_native_for_models_that_have_it():
    out = call("claude-sonnet-4-5", JSON_SCHEMA)
    assert out.body["output_config"] == {"format": {"type": "json_schema", "schema": SCHEMA}}
    assert "tools" not in out.body and out.shape == ReplyShape(structured=True)
    mapped = to_messages({"model": "fast", "messages": [{"role": "user", "content": "Who?"}],
                          "response_format": JSON_SCHEMA}, default_max_tokens=64, model_map={"fast": "claude-x"},
                         native_structured_output=["claude-x"])
    assert "output_config" in mapped.body  # matched on the Anthropic model name


def test_json_schema_takes_a_forced_tool_on_other_models():
    out = call("claude-3-5-haiku", JSON_SCHEMA)
    assert out.body["tools"] == [{"name": "person", "description": out.body["tools"][0]["description"],
                                  "input_schema": SCHEMA, "strict": True}]
    assert out.body["tool_choice"] == {"type": "tool", "name": "person"}
    assert out.shape == ReplyShape(json_tool="person", structured=True)


def test_json_object_takes_a_forced_tool_with_an_open_schema_on_every_model():
    out = call("claude-sonnet-4-5", {"type": "json_object"})
    assert out.body["tools"][0]["name"] == JSON_TOOL and out.body["tools"][0]["input_schema"] == {"type": "object"}
    assert out.body["tool_choice"] == {"type": "tool", "name": JSON_TOOL} and "output_config" not in out.body


@pytest.mark.parametrize("model, response_format, body, param", [
    ("claude-3-5-haiku", JSON_SCHEMA, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "response_format"),
    ("claude-3-5-haiku", {"type": "json_schema", "json_schema": {"name": "l", "schema": {"type": "array"}}}, {},
     "response_format.json_schema.schema"),
    ("claude-sonnet-4-5", {"type": "json_schema"}, {}, "response_format.json_schema"),
])
def test_structured_output_that_cannot_be_carried_is_refused_by_path(model, response_format, body, param):
    with pytest.raises(UpstreamUnsupported) as info:
        call(model, response_format, **body)
    assert info.value.param == param


def test_native_structured_output_may_keep_the_requests_own_tools():
    out = call("claude-opus-4-5", JSON_SCHEMA, tools=[{"type": "function", "function": {"name": "lookup"}}])
    assert [t["name"] for t in out.body["tools"]] == ["lookup"] and "output_config" in out.body


def message(content: list, stop_reason: str) -> dict:
    return {"id": "msg_1", "type": "message", "model": "claude-x", "content": content, "stop_reason": stop_reason,
            "usage": {"input_tokens": 3, "output_tokens": 4}}


def test_the_forced_tools_input_comes_back_as_the_content_with_finish_stop():
    reply = to_completion(message([{"type": "tool_use", "id": "t", "name": "person",
                                    "input": {"name": "Ada", "age": 36}}], "tool_use"),
                          created=0, shape=ReplyShape(json_tool="person", structured=True))
    choice = reply["choices"][0]
    assert json.loads(choice["message"]["content"]) == {"name": "Ada", "age": 36}
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


def test_a_refused_structured_request_answers_with_message_refusal():
    shape = ReplyShape(structured=True)
    said = to_completion(message([{"type": "text", "text": "I can't share that."}], "refusal"), created=0, shape=shape)
    assert said["choices"][0]["message"] == {"role": "assistant", "content": None, "refusal": "I can't share that."}
    assert said["choices"][0]["finish_reason"] == "stop"
    silent = to_completion(message([], "refusal"), created=0, shape=shape)
    assert silent["choices"][0]["message"]["refusal"] == REFUSED
    plain = to_completion(message([{"type": "text", "text": "no"}], "refusal"), created=0)
    assert plain["choices"][0]["message"]["content"] == "no" and plain["choices"][0]["finish_reason"] == "content_filter"


def test_a_streamed_forced_tool_streams_its_input_as_content():
    translator = StreamTranslator(created=0, shape=ReplyShape(json_tool="person", structured=True))
    chunks = []
    for raw in [event("message_start", message={"id": "m", "model": "c", "usage": {}}),
                event("content_block_start", index=0, content_block={"type": "tool_use", "id": "t", "name": "person",
                                                                     "input": {}}),
                event("content_block_delta", index=0, delta={"type": "input_json_delta", "partial_json": '{"name":'}),
                event("content_block_delta", index=0, delta={"type": "input_json_delta", "partial_json": '"Ada"}'}),
                event("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 5}),
                event("message_stop")]:
        chunks += translator.feed(raw)
    data = [json.loads(c[6:]) for c in chunks[:-1]]
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in data) == '{"name":"Ada"}'
    assert not any("tool_calls" in d["choices"][0]["delta"] for d in data)
    assert data[-1]["choices"][0]["finish_reason"] == "stop"
