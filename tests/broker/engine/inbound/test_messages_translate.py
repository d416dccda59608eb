"""The Messages <-> Chat Completions translation: request checks, the chat body, the Message for a chat reply,
the event stream for a chat stream, the native stream's usage and the error envelope, each checked against
the official SDKs' types (anthropic for what a caller reads, openai for what a chat upstream is sent)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import TypeAdapter

from mergebroker.broker.engine.apis.messages import (
    MessagesStream,
    StreamUsageReader,
    anthropic_error,
    count_prompt,
    error_event,
    from_chat,
    parse_count_request,
    parse_request,
    to_chat,
)
from mergebroker.broker.engine.apis.messages.content import BLOCK_TYPES
from mergebroker.errors import InvalidRequest
from mergebroker.token_usage import TokenUsage
from tests.helpers.paths import DATA

AGENTS = DATA / "agents"
_EVENT = TypeAdapter(RawMessageStreamEvent)
_CHAT_MESSAGE = TypeAdapter(ChatCompletionMessageParam)
_CHAT_TOOL = TypeAdapter(ChatCompletionToolParam)


def body(**changes: Any) -> dict[str, Any]:
    """A minimal valid create body, with `changes` applied (a value of None removes the field)."""
    raw: dict[str, Any] = {"model": "claude-haiku-4-5", "max_tokens": 256,
                           "messages": [{"role": "user", "content": "hello"}]}
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def bash_tool() -> dict[str, Any]:
    return {"name": "Bash", "description": "Run a shell command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                             "required": ["command"]}}


def claude_turn(name: str) -> dict[str, Any]:
    """A request Claude Code really sent (captured with its headers; the body is under "body")."""
    return json.loads((AGENTS / name).read_text())["body"]


def chat_valid(chat: dict[str, Any]) -> None:
    """Every message and tool of a chat body is what the openai SDK's params accept, and every tool message
    answers a call of the assistant message before the run of tool messages it is in."""
    for message in chat["messages"]:
        _CHAT_MESSAGE.validate_python(message)
    for tool in chat.get("tools", ()):
        _CHAT_TOOL.validate_python(tool)
        assert tool["type"] == "function"
    calls: set[str] = set()
    for message in chat["messages"]:
        if message["role"] == "tool":
            assert message["tool_call_id"] in calls
        else:
            calls = {call["id"] for call in message.get("tool_calls") or ()}


def events_of(frames: list[bytes]) -> list[dict[str, Any]]:
    """Each SSE frame's data, after checking the frame's `event:` line names the data's type."""
    out = []
    for frame in frames:
        assert frame.endswith(b"\n\n")
        event_line, data_line = frame.rstrip(b"\n").split(b"\n")
        data = json.loads(data_line.removeprefix(b"data: "))
        assert event_line == b"event: " + data["type"].encode()
        out.append(data)
    return out


def accumulated(frames: list[bytes]) -> Message:
    """The Message the anthropic SDK's stream accumulator builds from the frames, every event validated."""
    snapshot = None
    buffers: dict[int, bytes] = {}
    for data in events_of(frames):
        event = _EVENT.validate_python(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot is not None
    return Message.model_validate(snapshot.model_dump())


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "up-model", "choices": choices, **extra}


# --- parse_request -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "field"), [
    (body(model=None), "model"),
    (body(model=""), "model"),
    (body(model=3), "model"),
    (body(max_tokens=None), "max_tokens"),
    (body(max_tokens="10"), "max_tokens"),
    (body(max_tokens=True), "max_tokens"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_tokens=1.5), "max_tokens"),
    (body(messages=None), "messages"),
    (body(messages={"role": "user"}), "messages"),
    (body(messages=[]), "messages"),
    (body(messages=["hi"]), "messages.0"),
    (body(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
    (body(messages=[{"role": "user"}]), "messages.0.content"),
    (body(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    (body(messages=[{"role": "user", "content": ["x"]}]), "messages.0.content.0"),
    (body(messages=[{"role": "user", "content": [{"text": "x"}]}]), "messages.0.content.0.type"),
    (body(messages=[{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]),
     "messages.0.content.0.type"),
    (body(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]), "messages.0.content.0.text"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]),
     "messages.0.content.0.source.media_type"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x"}]}]),
     "messages.0.content.0.input"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]),
     "messages.0.content.0"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
     "messages.0.content.0.tool_use_id"),
    (body(system=7), "system"),
    (body(system=[{"type": "image"}]), "system.0"),
    (body(system=[{"type": "text", "text": None}]), "system.0.text"),
    (body(tools={"name": "x"}), "tools"),
    (body(tools=["x"]), "tools.0"),
    (body(tools=[{"description": "no name", "input_schema": {}}]), "tools.0.name"),
    (body(tools=[{"name": "Bash"}]), "tools.0.input_schema"),
    (body(tool_choice={"type": "required"}), "tool_choice"),
    (body(tool_choice={"type": "tool"}), "tool_choice.name"),
    (body(stream="yes"), "stream"),
    (body(temperature="0.5"), "temperature"),
    (body(top_p=True), "top_p"),
    (body(stop_sequences="END"), "stop_sequences"),
    (body(stop_sequences=["END", 3]), "stop_sequences"),
    (body(metadata="user-1"), "metadata"),
])
def test_a_malformed_body_is_a_400_naming_its_field(raw: dict[str, Any], field: str) -> None:
    """The Anthropic envelope has no `param`: the message itself names the field, as Anthropic's does."""
    with pytest.raises(InvalidRequest) as caught:
        parse_request(raw)
    assert caught.value.status == 400
    assert caught.value.param == field
    assert caught.value.message.startswith(field)


@pytest.mark.parametrize("raw", [None, [], "text", 3, [body()]])
def test_a_body_that_is_not_an_object_is_a_400(raw: Any) -> None:
    """A JSON array or scalar body is refused as such, never a traceback."""
    with pytest.raises(InvalidRequest, match="JSON object"):
        parse_request(raw)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=5)
                     | st.sampled_from(["text", "image", "tool_use", "tool_result", "user", "assistant", "base64"]),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["type", "text", "role", "content", "source", "id", "name",
                                                        "input", "tool_use_id", "media_type", "data", "url",
                                                        "input_schema", "is_error"]), inner, max_size=4),
                     max_leaves=12)


_BLOCK = st.fixed_dictionaries({"type": st.sampled_from(sorted(BLOCK_TYPES))}, optional={
    "text": st.text(max_size=5) | _JSON, "id": st.text(max_size=3), "name": st.text(max_size=3),
    "input": st.dictionaries(st.text(max_size=3), _JSON, max_size=2) | _JSON, "tool_use_id": st.text(max_size=3),
    "content": st.text(max_size=5) | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                                      "text": st.text(max_size=3)}), max_size=2),
    "is_error": st.booleans(), "thinking": _JSON,
    "source": st.fixed_dictionaries({"type": st.sampled_from(["base64", "url", "text", "file"])}, optional={
        "media_type": st.text(max_size=3), "data": st.text(max_size=3), "url": st.text(max_size=3)})})
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                            "content": st.text(max_size=5) | st.lists(_BLOCK, max_size=4)}),
                     min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["messages", "system", "tools", "tool_choice", "metadata", "stop_sequences",
                              "thinking"]), value=_JSON)
def test_any_shape_is_a_400_or_translates(field: str, value: Any) -> None:
    """Whatever shape a field has, the caller gets a 400 or an answer, never a traceback: what parses also
    translates, counts and streams."""
    refused_or_served(body(**{field: value}))


def refused_or_served(raw: dict[str, Any]) -> dict[str, Any] | None:
    """None for a body refused with a 400; else its chat body, after counting and streaming it as well."""
    try:
        request = parse_request(raw)
    except InvalidRequest:
        return None
    chat = to_chat(request).body
    count_prompt(request, words)
    stream = MessagesStream(request, message_id="msg_h", prompt_tokens_estimate=1)
    events_of(stream.start() + stream.finish(None))
    return chat


@settings(max_examples=300, deadline=None)
@given(messages=_MESSAGES)
def test_any_turns_are_a_400_or_translate(messages: list[dict[str, Any]]) -> None:
    """Turns of every block type, with fields of any shape: a 400, or a chat body the openai SDK accepts."""
    chat = refused_or_served(body(messages=messages))
    for message in chat["messages"] if chat is not None else ():
        _CHAT_MESSAGE.validate_python(message)


def test_a_plain_text_request_is_text_only() -> None:
    """System and text blocks only: the request may be merged and cached through the chat path."""
    request = parse_request(body(system=[{"type": "text", "text": "Be brief."}], stream=True, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]))
    assert (request.model, request.stream, request.max_tokens) == ("claude-haiku-4-5", True, 256)
    assert request.text_only and not request.has_tools


@pytest.mark.parametrize("changes", [
    {"tools": [bash_tool()]},
    {"tool_choice": {"type": "none"}},
    {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
    {"messages": [{"role": "user", "content": "run it"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]}]},
    {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}]},
])
def test_anything_beyond_plain_text_is_not_text_only(changes: dict[str, Any]) -> None:
    """Tools, images, documents, thinking: the request goes native to an Anthropic upstream where there is one."""
    assert not parse_request(body(**changes)).text_only


def test_thinking_disabled_is_still_text_only() -> None:
    """`thinking: {"type": "disabled"}` asks for nothing chat lacks."""
    assert parse_request(body(thinking={"type": "disabled"})).text_only


def test_a_count_tokens_request_needs_no_max_tokens() -> None:
    """`/v1/messages/count_tokens` takes the create body less `max_tokens`, and checks the rest alike."""
    request = parse_count_request(body(max_tokens=None, tools=[bash_tool()]))
    assert request.max_tokens is None and request.has_tools
    with pytest.raises(InvalidRequest) as caught:
        parse_count_request(body(max_tokens=None, messages=[]))
    assert caught.value.param == "messages"


# --- to_chat -----------------------------------------------------------------------------------------------

def test_a_text_request_becomes_a_plain_chat_body() -> None:
    """System blocks become one system string, text blocks one user string; shared parameters keep their
    meaning under chat's names, and cache_control markers do not travel."""
    request = parse_request(body(
        system=[{"type": "text", "text": "You are terse."},
                {"type": "text", "text": "Answer in English.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Part one."},
                                               {"type": "text", "text": "Part two.",
                                                "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "Go on."}],
        temperature=0.2, top_p=0.9, stop_sequences=["END"], metadata={"user_id": "u-7"}, stream=True,
        broker={"merge": False}))
    chat = to_chat(request)
    assert chat.body == {
        "model": "claude-haiku-4-5",
        "messages": [{"role": "system", "content": "You are terse.\n\nAnswer in English."},
                     {"role": "user", "content": "Part one.\n\nPart two."},
                     {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "Go on."}],
        "max_tokens": 256, "temperature": 0.2, "top_p": 0.9, "broker": {"merge": False}, "stop": ["END"],
        "user": "u-7", "stream": True, "stream_options": {"include_usage": True}}
    assert chat.dropped == ()
    chat_valid(chat.body)


def test_fields_chat_cannot_carry_are_named_in_dropped() -> None:
    """The caller learns (through the broker's dropped header) what its answer was made without."""
    request = parse_request(body(top_k=5, thinking={"type": "enabled", "budget_tokens": 2000},
                                 context_management={"edits": []}, container="c1", mcp_servers=[{"url": "x"}],
                                 service_tier="auto", future_field=1))
    chat = to_chat(request)
    assert chat.dropped == ("top_k", "context_management", "container", "mcp_servers", "service_tier",
                            "future_field")
    assert set(chat.body) == {"model", "messages", "max_tokens", "reasoning_effort"}
    assert chat.body["reasoning_effort"] == "low"  # a 2,000-token thinking budget


def test_a_tool_turn_becomes_tool_calls_and_tool_messages() -> None:
    """tool_use blocks become the assistant's tool_calls; tool_result blocks become tool messages placed
    before the rest of the user turn, as chat requires; an error result says so."""
    request = parse_request(body(tools=[bash_tool()], messages=[
        {"role": "user", "content": "list and count"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "two calls", "signature": "sig"},
            {"type": "text", "text": "Running both."},
            {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_b", "name": "Bash", "input": {"command": "wc -l"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here you go."},
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": [{"type": "text", "text": "a.py"},
                                                                          {"type": "text", "text": "b.py"}]},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": "no such file", "is_error": True}]}]))
    chat = to_chat(request)
    messages = chat.body["messages"]
    assert messages[1] == {"role": "assistant", "content": "Running both.", "tool_calls": [
        {"id": "toolu_a", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
        {"id": "toolu_b", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "wc -l"}'}}]}
    assert messages[2:] == [{"role": "tool", "tool_call_id": "toolu_a", "content": "a.py\n\nb.py"},
                            {"role": "tool", "tool_call_id": "toolu_b", "content": "Error: no such file"},
                            {"role": "user", "content": "Here you go."}]
    assert chat.body["tools"] == [{"type": "function", "function": {
        "name": "Bash", "description": "Run a shell command", "parameters": bash_tool()["input_schema"]}}]
    assert chat.dropped == ("thinking",)
    chat_valid(chat.body)


def test_an_assistant_turn_of_calls_only_has_null_content() -> None:
    """Chat takes `content: null` beside tool_calls; an empty string would read as an empty answer."""
    request = parse_request(body(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]}]))
    assert to_chat(request).body["messages"][0]["content"] is None


def test_images_become_image_url_parts() -> None:
    """Base64 images become data URLs, URL images stay URLs; text beside them stays a text part."""
    request = parse_request(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/b.jpg"}}]}]))
    chat = to_chat(request)
    assert chat.body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}}]}]
    chat_valid(chat.body)


def test_anthropic_server_tools_are_dropped_and_named() -> None:
    """Web search and the Anthropic-defined tools run on Anthropic's side only; the caller's own tools stay."""
    request = parse_request(body(tools=[bash_tool(), {"type": "web_search_20250305", "name": "web_search"},
                                        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]))
    chat = to_chat(request)
    assert [tool["function"]["name"] for tool in chat.body["tools"]] == ["Bash"]
    assert chat.dropped == ("tools.web_search", "tools.str_replace_based_edit_tool")


@pytest.mark.parametrize(("choice", "chat_choice", "parallel"), [
    ({"type": "auto"}, "auto", None),
    ({"type": "any"}, "required", None),
    ({"type": "none"}, "none", None),
    ({"type": "tool", "name": "Bash"}, {"type": "function", "function": {"name": "Bash"}}, None),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
])
def test_tool_choice_maps_to_chat(choice: dict[str, Any], chat_choice: Any, parallel: bool | None) -> None:
    """Each Anthropic tool_choice means the same to a chat upstream, one call at a time included."""
    chat = to_chat(parse_request(body(tools=[bash_tool()], tool_choice=choice))).body
    assert chat["tool_choice"] == chat_choice
    assert chat.get("parallel_tool_calls") == parallel


def test_a_tool_choice_of_a_dropped_tool_is_left_out() -> None:
    """Forcing a server tool chat cannot run would have the upstream refuse the request: it goes, named."""
    request = parse_request(body(tools=[bash_tool(), {"type": "web_search_20250305", "name": "web_search"}],
                                 tool_choice={"type": "tool", "name": "web_search"}))
    chat = to_chat(request)
    assert "tool_choice" not in chat.body
    assert chat.dropped == ("tools.web_search", "tool_choice")


@pytest.mark.parametrize("name", ["claude_turn1.json", "claude_turn2.json"])
def test_claude_code_requests_translate_to_valid_chat(name: str) -> None:
    """Claude Code's real requests (billing header, cache markers, thinking, context management, deferred
    tools; a tool call and its result in turn 2) parse, and become a chat body the openai SDK accepts."""
    raw = claude_turn(name)
    request = parse_request(raw)
    assert request.stream and request.has_tools and not request.text_only
    chat = to_chat(request)
    chat_valid(chat.body)
    assert "context_management" in chat.dropped and chat.body["reasoning_effort"] in ("low", "medium", "high")
    assert "cache_control" not in json.dumps(chat.body)
    assert chat.body["messages"][0]["role"] == "system"
    assert chat.body["user"] == raw["metadata"]["user_id"]
    assert len(chat.body["tools"]) == len(raw["tools"])
    assert chat.body["max_tokens"] == raw["max_tokens"]


def test_claude_code_turn_two_answers_its_tool_call() -> None:
    """The Bash call of turn 2 is the assistant's tool call, and its result the tool message right after."""
    messages = to_chat(parse_request(claude_turn("claude_turn2.json"))).body["messages"]
    call = next(m for m in messages if m.get("tool_calls"))["tool_calls"][0]
    assert call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"])["command"] == "echo ready > result.txt"
    after = messages[messages.index(next(m for m in messages if m.get("tool_calls"))) + 1]
    assert after["role"] == "tool" and after["tool_call_id"] == call["id"]
    assert after["content"].startswith("(Bash completed with no output)")


# --- from_chat ---------------------------------------------------------------------------------------------

def chat_reply(message: dict[str, Any], finish: str | None = "stop", usage: dict[str, Any] | None = None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "up-model",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
            "usage": usage or {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}


def test_a_text_reply_is_a_message() -> None:
    """The SDK reads the answer as a Message: one text block, end_turn, usage in Anthropic's terms."""
    reply = chat_reply({"content": "Hi there."}, usage={"prompt_tokens": 100, "completion_tokens": 4,
                                                        "total_tokens": 104,
                                                        "prompt_tokens_details": {"cached_tokens": 60}})
    message = Message.model_validate(from_chat(reply, parse_request(body()), message_id="msg_1"))
    assert (message.id, message.model, message.stop_reason) == ("msg_1", "up-model", "end_turn")
    assert [block.model_dump(exclude_none=True) for block in message.content] == [{"type": "text", "text": "Hi there."}]
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == (40, 60, 4)


def test_tool_calls_become_tool_use_blocks() -> None:
    """Each call is a tool_use block with its id as given and its JSON arguments as `input`; the turn stops
    for the tools even when the upstream said only "stop"."""
    reply = chat_reply({"content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
        {"id": "toolu_2", "type": "function", "function": {"name": "Bash", "arguments": "not json"}}]})
    message = Message.model_validate(from_chat(reply, parse_request(body(tools=[bash_tool()])), message_id="msg_2"))
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.id, b.input) for b in message.content if b.type == "tool_use"] == [
        ("tool_use", "call_9", {"command": "ls"}), ("tool_use", "toolu_2", {})]
    assert [b.type for b in message.content] == ["tool_use", "tool_use"]


def test_an_empty_reply_still_has_a_text_block() -> None:
    """A Message always has content; an upstream that said nothing gives one empty text block."""
    reply = {"choices": [{"message": {"role": "assistant", "content": None}, "finish_reason": None}]}
    message = Message.model_validate(from_chat(reply, parse_request(body()), message_id="msg_3"))
    assert [(b.type, b.text) for b in message.content if b.type == "text"] == [("text", "")]
    assert message.model == "claude-haiku-4-5" and message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 0 and message.usage.output_tokens == 0


@pytest.mark.parametrize(("finish", "stop"), [("stop", "end_turn"), ("length", "max_tokens"),
                                              ("content_filter", "refusal"), (None, "end_turn")])
def test_finish_reasons_map_to_stop_reasons(finish: str | None, stop: str) -> None:
    """A cut answer reads as max_tokens, a filtered one as a refusal, so the caller can continue or report."""
    message = Message.model_validate(from_chat(chat_reply({"content": "x"}, finish), parse_request(body()),
                                               message_id="msg_4"))
    assert message.stop_reason == stop


def test_reasoning_is_shown_only_when_thinking_was_asked_for() -> None:
    """A reasoning upstream's thoughts lead the content as a thinking block only for a thinking request."""
    reply = chat_reply({"content": "42", "reasoning_content": "6 times 7"})
    plain = Message.model_validate(from_chat(reply, parse_request(body()), message_id="msg_5"))
    assert [b.type for b in plain.content] == ["text"]
    thinking = parse_request(body(thinking={"type": "enabled", "budget_tokens": 1024}))
    shown = Message.model_validate(from_chat(reply, thinking, message_id="msg_5"))
    assert [(b.type, getattr(b, "thinking", None)) for b in shown.content] == [("thinking", "6 times 7"),
                                                                                 ("text", None)]


# --- MessagesStream ----------------------------------------------------------------------------------------

def test_a_text_and_tool_stream_accumulates_to_the_whole_message() -> None:
    """Text, then a tool call whose arguments arrive in fragments: the SDK's own accumulator rebuilds the
    answer, the tool_use input being the JSON the fragments spell, and the usage the final chunk's."""
    stream = MessagesStream(parse_request(body(stream=True, tools=[bash_tool()])), message_id="msg_s",
                            prompt_tokens_estimate=90)
    frames = stream.start()
    frames += stream.feed(chunk({"role": "assistant", "content": ""}))
    frames += stream.feed(chunk({"content": "Listing "}))
    frames += stream.feed(chunk({"content": "files."}))
    frames += stream.feed(chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                 "function": {"name": "Bash", "arguments": ""}}]}))
    for fragment in ('{"comm', 'and": "ls', ' -la"}'):
        frames += stream.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}))
    frames += stream.feed(chunk({}, finish="tool_calls"))
    frames += stream.feed(chunk(None, usage={"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120,
                                             "prompt_tokens_details": {"cached_tokens": 64}}))
    frames += stream.finish(None)
    events = events_of(frames)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == 90
    message = accumulated(frames)
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Listing files."  # type: ignore[union-attr]
    tool = message.content[1]
    assert (tool.id, tool.name, tool.input) == ("call_1", "Bash", {"command": "ls -la"})  # type: ignore[union-attr]
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == (
        36, 64, 20)


def test_two_tool_calls_stream_as_two_blocks_in_order() -> None:
    """Each new call closes the block before it, so blocks are numbered 0, 1, 2 and each one ends."""
    stream = MessagesStream(parse_request(body(tools=[bash_tool()])), message_id="msg_t", prompt_tokens_estimate=5)
    frames = stream.start()
    for index, command in enumerate(("ls", "pwd")):
        frames += stream.feed(chunk({"tool_calls": [{"index": index, "id": f"call_{index}", "function": {
            "name": "Bash", "arguments": json.dumps({"command": command})}}]}))
    frames += stream.finish(TokenUsage(10, 4))
    events = events_of(frames)
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    message = accumulated(frames)
    assert [b.input for b in message.content] == [{"command": "ls"}, {"command": "pwd"}]  # type: ignore[union-attr]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (10, 4)


def test_a_stream_that_says_nothing_still_has_a_text_block() -> None:
    """An empty answer streams one empty text block, as the whole Message would hold; without any usage
    reported, the prompt's estimate stands."""
    stream = MessagesStream(parse_request(body(stream=True)), message_id="msg_e", prompt_tokens_estimate=7)
    message = accumulated(stream.start() + stream.feed(chunk({}, finish="stop")) + stream.finish(None))
    assert [(b.type, b.text) for b in message.content if b.type == "text"] == [("text", "")]
    assert (message.usage.input_tokens, message.usage.output_tokens, message.stop_reason) == (7, 0, "end_turn")


def test_a_thinking_stream_shows_reasoning_as_a_signed_thinking_block() -> None:
    """For a thinking request, streamed reasoning is a thinking block (ended by its signature) before the text."""
    stream = MessagesStream(parse_request(body(thinking={"type": "enabled", "budget_tokens": 1024})),
                            message_id="msg_k", prompt_tokens_estimate=3)
    frames = stream.start() + stream.feed(chunk({"reasoning_content": "hmm"})) + stream.feed(chunk({"content": "ok"}))
    message = accumulated(frames + stream.finish(None))
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "hmm"  # type: ignore[union-attr]


def test_a_failed_stream_ends_with_an_error_event() -> None:
    """The SDK raises the error event's type; nothing follows it, even a later finish."""
    stream = MessagesStream(parse_request(body()), message_id="msg_f", prompt_tokens_estimate=3)
    stream.start()
    stream.feed(chunk({"content": "partial"}))
    frames = stream.fail(503, "upstream_unavailable", "AI service busy")
    assert frames[0].startswith(b"event: error\n")
    error = ErrorResponse.model_validate(events_of(frames)[0])
    assert (error.error.type, error.error.message) == ("overloaded_error", "AI service busy")
    assert stream.finish(None) == [] and stream.feed(chunk({"content": "late"})) == []


# --- StreamUsageReader -------------------------------------------------------------------------------------

def test_native_stream_usage_combines_start_and_delta() -> None:
    """Input and cache tokens from message_start, output tokens from the last message_delta."""
    reader = StreamUsageReader()
    reader.feed(b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","usage":'
                b'{"input_tokens":12,"cache_read_input_tokens":3000,"cache_creation_input_tokens":200,'
                b'"output_tokens":1}}}\n\n')
    assert reader.usage == TokenUsage(3212, 1, 3000, 200)
    reader.feed(b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
                b'"usage":{"output_tokens":40}}\n\n')
    reader.feed(b'event: message_delta\ndata: {"type":"message_delta","delta":{},"usage":{"output_tokens":57}}\n\n')
    assert reader.usage == TokenUsage(3212, 57, 3000, 200)
    assert reader.usage.as_anthropic() == {"input_tokens": 12, "output_tokens": 57, "cache_read_input_tokens": 3000,
                                           "cache_creation_input_tokens": 200}


def test_a_delta_restating_input_tokens_overrides_the_start() -> None:
    """With server tools the input grows during the turn; the delta's count is the one billed."""
    reader = StreamUsageReader()
    reader.feed(b'data: {"type":"message_start","message":{"usage":{"input_tokens":10,"output_tokens":1}}}')
    reader.feed(b'data: {"type":"message_delta","usage":{"input_tokens":25,"cache_read_input_tokens":5,'
                b'"output_tokens":9}}')
    assert reader.usage == TokenUsage(30, 9, 5, 0)


@pytest.mark.parametrize("event", [b"", b"event: ping\ndata: {\"type\":\"ping\"}\n\n", b"data: {not json",
                                   b"data: [1,2]", b'data: {"type":"message_start","message":"x"}',
                                   b'data: {"type":"message_delta","usage":7}', b"\xff\xfe"])
def test_malformed_events_are_passed_over(event: bytes) -> None:
    """A relay never breaks a caller's stream over an event it cannot read for usage."""
    reader = StreamUsageReader()
    reader.feed(event)
    assert reader.usage is None


# --- errors ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("status", "sent", "kind"), [
    (400, 400, "invalid_request_error"), (401, 401, "authentication_error"), (403, 403, "permission_error"),
    (404, 404, "not_found_error"), (429, 429, "rate_limit_error"), (503, 529, "overloaded_error"),
    (529, 529, "overloaded_error"), (504, 504, "timeout_error"), (500, 500, "api_error"), (502, 502, "api_error"),
    (405, 405, "invalid_request_error"), (415, 415, "invalid_request_error"),
])
def test_errors_leave_in_anthropic_envelope(status: int, sent: int, kind: str) -> None:
    """The SDK maps the status and the error type to its exception classes; an overload is sent as 529 so
    Claude Code and the SDK retry it."""
    got_status, payload = anthropic_error(status, "some_code", "went wrong", "server_error")
    assert got_status == sent
    error = ErrorResponse.model_validate(payload)
    assert (error.type, error.error.type, error.error.message) == ("error", kind, "went wrong")


def test_a_too_large_body_is_request_too_large() -> None:
    """Anthropic answers an oversized body 413 `request_too_large` (a type the SDK's union does not list)."""
    assert anthropic_error(413, "payload_too_large", "too big", "invalid_request_error") == (
        413, {"type": "error", "error": {"type": "request_too_large", "message": "too big"}})


def test_an_error_event_is_framed_like_anthropics() -> None:
    """`event: error` and the same envelope as the HTTP error, on one compact data line."""
    frame = error_event(429, "rate_limit_exceeded", "slow down", "rate_limit_error")
    assert frame == (b'event: error\ndata: {"type":"error","error":{"type":"rate_limit_error",'
                     b'"message":"slow down"}}\n\n')


# --- count_prompt ------------------------------------------------------------------------------------------

def words(text: str) -> int:
    return len(text.split())


def test_count_prompt_counts_system_turns_tools_and_framing() -> None:
    """The estimate grows with each part a real count includes: system, turns, tool calls, tool results and
    tool definitions, plus a little per message."""
    plain = parse_count_request(body(max_tokens=None, system="one two", messages=[
        {"role": "user", "content": "three four five"}]))
    assert count_prompt(plain, words) == 2 + 3 + 3
    with_tools = parse_count_request(body(max_tokens=None, system="one two", tools=[bash_tool()], messages=[
        {"role": "user", "content": "three four five"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "a b c d"}]}]}]))
    tool_words = words(json.dumps(bash_tool()))
    assert count_prompt(with_tools, words) == 8 + tool_words + 3 + 1 + 2 + 3 + 4
