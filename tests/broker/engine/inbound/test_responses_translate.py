"""The Responses <-> Chat Completions translation: request checks, the chat body, the Response for a chat
reply, the listed input items and the native stream's final frame, each checked against the SDK's types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseItem, ResponseUsage
from pydantic import TypeAdapter

from mergebroker.broker.engine.apis.responses import (
    completed_response,
    flat_name,
    from_chat,
    input_items,
    parse_request,
    stream_usage,
    to_chat,
)
from mergebroker.errors import InvalidRequest
from mergebroker.token_usage import TokenUsage

_ITEM = TypeAdapter(ResponseItem)


def validated(response: dict[str, Any]) -> Response:
    """The Response as the SDK reads it, strictly. Its `usage` is checked on its own (the SDK's usage type is
    stricter than the Response's)."""
    model = Response.model_validate({**response, "usage": None}, strict=True)
    assert response["usage"] == TokenUsage.from_body(response).as_responses()
    return model


def _function(name: str, props: dict[str, Any], description: str = "") -> dict[str, Any]:
    return {"type": "function", "name": name, "description": description or f"{name} tool", "strict": False,
            "parameters": {"type": "object", "properties": props, "required": list(props)}}


CODEX_TOOLS = [
    _function("exec_command", {"cmd": {"type": "string"}}, "Runs a shell command"),
    {"type": "namespace", "name": "mcp__github", "description": "GitHub through MCP",
     "tools": [_function(name, {"q": {"type": "string"}}) for name in
               ("search_issues", "get_issue", "create_issue", "list_pull_requests", "get_file_contents")]},
    {"type": "web_search"},
]


def codex_request(**changes: Any) -> dict[str, Any]:
    """A request shaped like Codex CLI's: developer and user messages, then a call and its output."""
    body = {
        "model": "gpt-5.2-codex", "instructions": "You are Codex.", "stream": True, "store": False,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: on"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env>cwd=/r</env>"},
                                                            {"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA..."},
            {"type": "function_call", "call_id": "call_ls", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
            {"type": "function_call_output", "call_id": "call_ls", "output": "README.md\nsrc"},
        ],
        "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-thread", "client_metadata": {"originator": "codex_cli_rs"},
    }
    body.update(changes)
    return body


def chat_reply(message: dict[str, Any], finish_reason: str = "stop", **extra: Any) -> dict[str, Any]:
    reply = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "upstream-model",
             "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason}],
             "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150,
                       "prompt_tokens_details": {"cached_tokens": 100}}, **extra}
    ChatCompletion.model_validate(reply)
    return reply


def test_codex_request_becomes_a_chat_body_with_flat_namespace_tools_and_named_drops():
    request = parse_request(codex_request())
    translation = to_chat(request)
    body = translation.body
    assert request.stream and not request.store and not request.text_only
    assert body["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "Sandbox: on"},
        {"role": "user", "content": [{"type": "text", "text": "<env>cwd=/r</env>"},
                                     {"type": "text", "text": "list files"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_ls", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_ls", "content": "README.md\nsrc"},
    ]
    names = [tool["function"]["name"] for tool in body["tools"]]
    assert names == ["exec_command", "mcp__github__search_issues", "mcp__github__get_issue",
                     "mcp__github__create_issue", "mcp__github__list_pull_requests", "mcp__github__get_file_contents"]
    assert body["tools"][1]["function"]["description"] == "GitHub through MCP\n\nsearch_issues tool"
    assert translation.tool_names["mcp__github__get_issue"] == ("mcp__github", "get_issue")
    assert translation.tool_names["exec_command"] == (None, "exec_command")
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is True
    assert body["reasoning_effort"] == "medium" and body["prompt_cache_key"] == "0199-thread"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "client_metadata" not in body and "store" not in body and "include" not in body
    assert set(translation.dropped) == {"input.reasoning", "tools.web_search", "reasoning.summary",
                                        "include.reasoning.encrypted_content"}


def test_chat_tool_calls_come_back_as_function_calls_with_their_namespace():
    request = parse_request(codex_request())
    translation = to_chat(request)
    reply = chat_reply({"content": "Looking it up.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "mcp__github__get_issue", "arguments": '{"q":"7"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd":"pwd"}'}},
    ]}, "tool_calls")
    response = from_chat(reply, request, translation, response_id="resp_1", created_at=1700000001)
    sdk = validated(response)
    assert sdk.output_text == "Looking it up." and sdk.status == "completed"
    message, namespaced, plain = response["output"]
    assert message["type"] == "message" and message["id"].startswith("msg_")
    assert namespaced == {"id": namespaced["id"], "type": "function_call", "status": "completed", "call_id": "call_a",
                          "name": "get_issue", "namespace": "mcp__github", "arguments": '{"q":"7"}'}
    assert namespaced["id"].startswith("fc_") and "namespace" not in plain and plain["name"] == "exec_command"
    assert response["tools"] == CODEX_TOOLS and response["store"] is False and response["model"] == "upstream-model"
    assert response["usage"] == TokenUsage(120, 30, 100).as_responses()


def test_a_namespaced_call_sent_back_maps_to_the_same_flat_chat_name():
    request = parse_request(codex_request())
    reply = chat_reply({"content": None, "tool_calls": [{"id": "call_a", "type": "function", "function": {
        "name": "mcp__github__get_issue", "arguments": "{}"}}]}, "tool_calls")
    first = from_chat(reply, request, to_chat(request), response_id="resp_1", created_at=1)
    follow = codex_request(input=[*first["output"], {"type": "function_call_output", "call_id": "call_a",
                                                     "output": [{"type": "input_text", "text": "issue 7"}]}])
    body = to_chat(parse_request(follow)).body
    assert body["messages"][1]["tool_calls"][0]["function"]["name"] == "mcp__github__get_issue"
    assert body["messages"][2] == {"role": "tool", "tool_call_id": "call_a", "content": "issue 7"}


def test_a_long_flat_name_is_shortened_deterministically_to_64_characters():
    name = flat_name("n" * 40, "f" * 40)
    assert len(name) == 64 and name == flat_name("n" * 40, "f" * 40) != flat_name("n" * 40, "f" * 39 + "g")
    request = parse_request(codex_request(tools=[{"type": "namespace", "name": "n" * 40, "description": "d",
                                                  "tools": [_function("f" * 40, {})]}]))
    assert to_chat(request).tool_names[name] == ("n" * 40, "f" * 40)


def test_consecutive_calls_join_the_assistant_message_before_them():
    items = [{"role": "user", "content": "go"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Both."}]},
             {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
             {"type": "reasoning", "id": "rs", "summary": []},
             {"type": "function_call", "call_id": "c2", "name": "exec_command", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "1"},
             {"type": "function_call_output", "call_id": "c2", "output": "2"}]
    messages = to_chat(parse_request(codex_request(input=items, instructions=None))).body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Both." and [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]


def test_parameters_move_to_their_chat_names():
    request = parse_request({
        "model": "m", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"},
            {"type": "input_image", "file_id": "file-1", "detail": "auto"}]}],
        "max_output_tokens": 500, "temperature": 0.2, "top_p": 0.9, "user": "u1", "service_tier": "flex",
        "safety_identifier": "s1", "metadata": {"k": "v"}, "truncation": "auto", "broker": {"tier": "batch"},
        "text": {"format": {"type": "json_schema", "name": "Out", "schema": {"type": "object"}, "strict": True},
                 "verbosity": "low"},
        "tools": [{"type": "function", "name": "f"}],
        "tool_choice": {"type": "function", "name": "f"}})
    translation = to_chat(request)
    body = translation.body
    assert body["messages"][0]["content"] == [{"type": "text", "text": "look"},
                                              {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA",
                                                                                  "detail": "low"}}]
    assert body["max_completion_tokens"] == 500 and body["temperature"] == 0.2 and body["top_p"] == 0.9
    assert (body["user"], body["service_tier"], body["safety_identifier"]) == ("u1", "flex", "s1")
    assert body["broker"] == {"tier": "batch"} and "metadata" not in body and "stream" not in body
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "Out", "schema": {"type": "object"}, "strict": True}}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert set(translation.dropped) == {"input_image.file_id", "text.verbosity", "metadata", "truncation"}
    assert to_chat(parse_request({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}})
                   ).body["response_format"] == {"type": "json_object"}


def test_a_hosted_tool_choice_is_dropped_and_a_choice_without_tools_left_out():
    only_hosted = to_chat(parse_request({"model": "m", "input": "x", "tools": [{"type": "web_search"}],
                                         "tool_choice": "required", "parallel_tool_calls": False}))
    assert "tools" not in only_hosted.body and "tool_choice" not in only_hosted.body
    assert "parallel_tool_calls" not in only_hosted.body
    assert set(only_hosted.dropped) == {"tools.web_search", "tool_choice"}
    hosted_choice = to_chat(parse_request({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}],
                                           "tool_choice": {"type": "web_search_preview"}}))
    assert "tool_choice" not in hosted_choice.body and hosted_choice.dropped == ("tool_choice",)


def test_a_choice_of_a_namespaced_function_or_of_allowed_tools_names_their_chat_tools():
    def choice(tool_choice: Any) -> Any:
        return to_chat(parse_request(codex_request(tool_choice=tool_choice))).body.get("tool_choice")

    assert choice({"type": "function", "name": "get_issue"}) == {
        "type": "function", "function": {"name": "mcp__github__get_issue"}}
    assert choice({"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "exec_command"}, {"type": "web_search"},
        {"type": "function", "name": "get_issue", "namespace": "mcp__github"}]}) == {
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "exec_command"}},
            {"type": "function", "function": {"name": "mcp__github__get_issue"}}]}}
    assert choice({"type": "function", "name": "not_a_tool"}) is None


def test_history_comes_after_instructions_and_before_the_input():
    history = [{"type": "message", "role": "user", "content": "first", "id": "msg_a"},
               {"type": "message", "role": "assistant", "id": "msg_b", "status": "completed",
                "content": [{"type": "output_text", "text": "one", "annotations": []}]},
               {"type": "function_call", "call_id": "c9", "name": "exec_command", "arguments": "{}", "id": "fc_c"}]
    raw = {"model": "m", "instructions": "Be brief.", "previous_response_id": "resp_0",
           "input": [{"type": "function_call_output", "call_id": "c9", "output": "ok"}]}
    request = parse_request(raw, history=history)
    messages = to_chat(request, history=history).body["messages"]
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"},
                        {"role": "assistant", "content": "one", "tool_calls": [
                            {"id": "c9", "type": "function", "function": {"name": "exec_command", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c9", "content": "ok"}]
    assert not request.text_only


def test_a_plain_text_request_is_text_only():
    assert parse_request({"model": "m", "input": "hello"}).text_only
    assert parse_request({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                                                  {"role": "assistant", "content": "b"}]}).text_only
    for change in ({"tools": [{"type": "web_search"}]}, {"previous_response_id": "resp_1"}, {"background": True},
                   {"text": {"format": {"type": "json_object"}}},
                   {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}):
        assert not parse_request({"model": "m", "input": "hello", **change}).text_only, change


def test_a_cut_or_filtered_reply_is_an_incomplete_response():
    request = parse_request({"model": "m", "input": "hello", "max_output_tokens": 16})
    for finish, reason in (("length", "max_output_tokens"), ("content_filter", "content_filter")):
        response = from_chat(chat_reply({"content": "Hel"}, finish), request, to_chat(request),
                             response_id="resp_2", created_at=5)
        sdk = validated(response)
        assert sdk.status == "incomplete" and sdk.incomplete_details.reason == reason
        assert response["output"][0]["status"] == "incomplete" and response["max_output_tokens"] == 16


def test_a_reply_echoes_the_request_and_its_defaults():
    request = parse_request({"model": "m", "input": "hello"})
    response = from_chat(chat_reply({"content": "hi"}), request, to_chat(request), response_id="resp_3",
                         created_at=7, previous_response_id="resp_0")
    validated(response)
    assert response["tool_choice"] == "auto" and response["parallel_tool_calls"] is True
    assert response["text"] == {"format": {"type": "text"}} and response["metadata"] == {}
    assert response["store"] is True and response["previous_response_id"] == "resp_0"
    assert response["error"] is None and response["object"] == "response" and "output_text" not in response
    no_usage = {k: v for k, v in chat_reply({"content": "hi"}).items() if k != "usage"}
    assert from_chat(no_usage, request, to_chat(request), response_id="r", created_at=1)["usage"]["total_tokens"] == 0


def test_the_usage_object_is_the_sdk_usage_object():
    usage = ResponseUsage.model_validate(TokenUsage(10, 5, 2, cache_write_tokens=3).as_responses(), strict=True)
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens) == (10, 2)
    assert usage.input_tokens_details.cache_write_tokens == 3


def test_input_items_have_ids_statuses_and_part_arrays():
    request = parse_request(codex_request())
    listed = input_items(request, response_id="resp_9")
    for item in listed:
        _ITEM.validate_python(item, strict=True)
    assert [item["id"][:3] for item in listed] == ["msg", "msg", "rs_", "fc_", "fco"]
    assert listed[2]["id"] == "rs_1" and listed == input_items(request, response_id="resp_9")
    text = input_items(parse_request({"model": "m", "input": "hello"}), response_id="resp_9")
    assert text[0]["content"] == [{"type": "input_text", "text": "hello"}] and text[0]["role"] == "user"
    assistant = input_items(parse_request({"model": "m", "input": [{"role": "assistant", "content": "b"}]}),
                            response_id="r")[0]
    assert _ITEM.validate_python(assistant, strict=True).content[0].text == "b"


def test_the_final_frame_of_a_native_stream_gives_the_response_and_its_usage():
    response = {"id": "resp_n", "object": "response", "usage": TokenUsage(9, 4, 3).as_responses()}
    event = {"type": "response.completed", "sequence_number": 9, "response": response}
    frame = b"event: response.completed\ndata: " + json.dumps(event).encode() + b"\n\n"
    assert completed_response(frame) == response
    assert stream_usage(frame) == TokenUsage(9, 4, 3)
    assert completed_response(b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n') \
        is None
    assert completed_response(b"data: [DONE]\n\n") is None and stream_usage(b"data: nope\n\n") is None


def _bad(**changes: Any) -> dict[str, Any]:
    body = {"model": "m", "input": [{"role": "user", "content": "hi"}]}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


@pytest.mark.parametrize(("body", "param"), [
    (_bad(model=...), "model"),
    (_bad(model=""), "model"),
    (_bad(input=7), "input"),
    (_bad(input=["hi"]), "input[0]"),
    (_bad(input=[{"type": "telepathy"}]), "input[0].type"),
    (_bad(input=[{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]), "input[1].role"),
    (_bad(input=[{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]), "input[0].content[0].type"),
    (_bad(input=[{"role": "user", "content": [{"type": "input_text", "text": 3}]}]), "input[0].content[0].text"),
    (_bad(input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                 {"type": "function_call_output", "call_id": "nope", "output": "x"}]), "input[2].call_id"),
    (_bad(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input[0].call_id"),
    (_bad(tools=[{"type": "function", "name": "f" * 65}]), "tools[0].name"),
    (_bad(tools=[{"type": "function", "name": "has space"}]), "tools[0].name"),
    (_bad(tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
    (_bad(tools=[{"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function"}]}]),
     "tools[0].tools[0].name"),
    (_bad(max_output_tokens=15), "max_output_tokens"),
    (_bad(max_output_tokens="100"), "max_output_tokens"),
    (_bad(max_output_tokens=True), "max_output_tokens"),
    (_bad(temperature=2.5), "temperature"),
    (_bad(temperature=-0.1), "temperature"),
    (_bad(top_p=1.5), "top_p"),
    (_bad(stream="yes"), "stream"),
    (_bad(text={"format": {"type": "json_schema", "schema": {}}}), "text.format.name"),
])
def test_a_bad_request_is_refused_naming_the_field(body, param):
    with pytest.raises(InvalidRequest) as refused:
        parse_request(body)
    assert refused.value.param == param and refused.value.status == 400


def test_an_output_for_a_call_in_the_history_or_a_held_elsewhere_chain_is_accepted():
    output = {"type": "function_call_output", "call_id": "c1", "output": "x"}
    history = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]
    parse_request({"model": "m", "input": [output], "previous_response_id": "resp_0"}, history=history)
    parse_request({"model": "m", "input": [output], "previous_response_id": "resp_0"})
    with pytest.raises(InvalidRequest):
        parse_request({"model": "m", "input": [output], "previous_response_id": "resp_0"},
                      history=[{"type": "message", "role": "user", "content": "a"}])
