"""A chat completions stream as the Responses event stream: every event valid for the SDK, numbered from 0,
items opened and closed in order, and the final Response the same one `from_chat` builds."""

from __future__ import annotations

import json
from typing import Any

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from mergebroker.broker.engine.apis.responses import ResponsesStream, from_chat, parse_request, to_chat
from mergebroker.token_usage import TokenUsage

_EVENT = TypeAdapter(ResponseStreamEvent)
_TOOLS = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
          {"type": "namespace", "name": "fs", "description": "Files", "tools": [{"type": "function", "name": "read"}]}]


def events(frames: list[bytes]) -> list[dict[str, Any]]:
    """The frames' events, each checked to be one SSE frame whose event name is its type, and valid for the
    SDK (strictly; a Response's `usage` is checked apart, as in test_responses_translate)."""
    parsed = []
    for frame in frames:
        head, data = frame.decode().split("\n", 1)
        assert frame.endswith(b"\n\n") and data.startswith("data: ")
        event = json.loads(data[len("data: "):])
        assert head == f"event: {event['type']}"
        checked = {**event, "response": {**event["response"], "usage": None}} if "response" in event else event
        _EVENT.validate_python(checked, strict=True)
        parsed.append(event)
    return parsed


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "up-1",
            "choices": choices, **extra}


def call(index: int, *, id: str | None = None, name: str | None = None, arguments: str = "") -> dict[str, Any]:
    function = {"arguments": arguments, **({"name": name} if name else {})}
    return {"index": index, **({"id": id, "type": "function"} if id else {}), "function": function}


def run(body: dict[str, Any], chunks: list[dict[str, Any]], usage: TokenUsage | None = None):
    request = parse_request(body)
    translation = to_chat(request)
    stream = ResponsesStream(request, translation, response_id="resp_s", created_at=1700000000)
    frames = stream.start()
    for piece in chunks:
        frames += stream.feed(piece)
    frames += stream.finish(usage)
    return request, translation, stream, events(frames)


TEXT_AND_CALLS = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Let me "}), chunk({"content": "look."}),
    chunk({"tool_calls": [call(0, id="call_a", name="exec_command", arguments='{"cmd":')]}),
    chunk({"tool_calls": [call(1, id="call_b", name="fs__read", arguments="{}")]}),
    chunk({"tool_calls": [call(0, arguments='"ls"}')]}),
    chunk({}, "tool_calls"),
    chunk(usage={"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62}),
]


def test_text_then_two_calls_stream_as_opened_filled_and_closed_items():
    _, _, _, seen = run({"model": "m", "input": "go", "tools": _TOOLS, "stream": True}, TEXT_AND_CALLS)
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    assert [e["type"] for e in seen] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert seen[0]["response"]["status"] == "in_progress" and seen[0]["response"]["output"] == []
    assert seen[6]["text"] == "Let me look." and seen[8]["item"]["status"] == "completed"
    assert seen[14]["arguments"] == '{"cmd":"ls"}' and seen[14]["output_index"] == 1
    read = seen[17]["item"]
    assert (read["name"], read["namespace"], read["call_id"], seen[17]["output_index"]) == ("read", "fs", "call_b", 2)
    final = seen[-1]["response"]
    assert final["status"] == "completed" and final["usage"] == TokenUsage(50, 12).as_responses()
    assert Response.model_validate({**final, "usage": None}, strict=True).output_text == "Let me look."


def test_the_final_response_is_the_one_from_chat_builds_for_the_whole_reply():
    request, translation, stream, seen = run({"model": "m", "input": "go", "tools": _TOOLS, "stream": True},
                                             TEXT_AND_CALLS)
    reply = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "up-1",
             "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                 "role": "assistant", "content": "Let me look.", "tool_calls": [
                     {"id": "call_a", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'}},
                     {"id": "call_b", "type": "function", "function": {"name": "fs__read", "arguments": "{}"}}]}}],
             "usage": {"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62}}
    whole = from_chat(reply, request, translation, response_id="resp_s", created_at=1700000000)
    assert stream.final_response == whole == seen[-1]["response"]


def test_a_stream_cut_at_the_token_limit_ends_incomplete():
    _, _, stream, seen = run({"model": "m", "input": "go", "max_output_tokens": 16},
                             [chunk({"content": "Once upon"}), chunk({}, "length")], TokenUsage(5, 16))
    assert seen[-1]["type"] == "response.incomplete"
    final = seen[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and seen[-2]["item"]["status"] == "incomplete"
    assert final["usage"]["output_tokens"] == 16 and stream.final_response == final


def test_a_stream_that_fails_midway_ends_with_response_failed_holding_the_text_so_far():
    request = parse_request({"model": "m", "input": "go", "stream": True})
    stream = ResponsesStream(request, to_chat(request), response_id="resp_f", created_at=3)
    frames = stream.start() + stream.feed(chunk({"content": "Hal"}))
    frames += stream.fail(502, "upstream_gone", "The upstream closed the stream")
    seen = events(frames)
    assert seen[-1]["type"] == "response.failed"
    failed = seen[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error",
                                                                "message": "The upstream closed the stream"}
    assert failed["output"][0]["content"][0]["text"] == "Hal" and failed["output"][0]["status"] == "incomplete"
    assert stream.finish() == [] and stream.feed(chunk({"content": "x"})) == []
    limited = ResponsesStream(request, to_chat(request), response_id="resp_g", created_at=3)
    assert events(limited.fail(429, None, "slow down"))[0]["response"]["error"]["code"] == "rate_limit_exceeded"


def test_interleaved_call_arguments_land_on_their_own_items():
    _, _, _, seen = run({"model": "m", "input": "go", "tools": _TOOLS}, [
        chunk({"tool_calls": [call(0, id="c0", name="exec_command"), call(1, id="c1", name="fs__read")]}),
        chunk({"tool_calls": [call(1, arguments='{"p":'), call(0, arguments='{"cmd":"a"}')]}),
        chunk({"tool_calls": [call(1, arguments='"x"}')]}),
        chunk({}, "tool_calls")])
    done = [e for e in seen if e["type"] == "response.function_call_arguments.done"]
    assert [(e["output_index"], e["arguments"]) for e in done] == [(0, '{"cmd":"a"}'), (1, '{"p":"x"}')]
    assert seen[-1]["response"]["usage"]["total_tokens"] == 0


def test_usage_given_to_finish_wins_over_the_last_chunk():
    _, _, _, seen = run({"model": "m", "input": "go"}, [chunk({"content": "hi"}), chunk({}, "stop"),
                                                        chunk(usage={"prompt_tokens": 1, "completion_tokens": 1})],
                        TokenUsage(7, 3, 2))
    assert seen[-1]["response"]["usage"] == TokenUsage(7, 3, 2).as_responses()
    assert seen[-1]["response"]["model"] == "up-1"


def test_shown_reasoning_streams_as_a_reasoning_item_before_the_answer():
    request, translation, stream, seen = run({"model": "m", "input": "go"}, [
        chunk({"reasoning_content": "Think"}), chunk({"reasoning_content": "ing."}),
        chunk({"content": "Done."}), chunk({}, "stop")])
    kinds = [e["type"] for e in seen]
    assert kinds[2:9] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta",
                          "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert seen[6]["text"] == "Thinking." and seen[8]["item"]["type"] == "reasoning"
    final = seen[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    reply = {"id": "c", "object": "chat.completion", "created": 1, "model": "up-1", "choices": [{
        "index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": "Done.", "reasoning_content": "Thinking."}}]}
    assert from_chat(reply, request, translation, response_id="resp_s", created_at=1700000000) == final


def test_a_cut_after_reasoning_leaves_the_reasoning_complete_and_the_answer_incomplete():
    _, _, _, seen = run({"model": "m", "input": "go"}, [chunk({"reasoning": "Hmm."}), chunk({"content": "Par"}),
                                                        chunk({}, "length")])
    done = [e["item"]["status"] for e in seen if e["type"] == "response.output_item.done"]
    assert done == ["completed", "incomplete"]
    assert [item["status"] for item in seen[-1]["response"]["output"]] == done
