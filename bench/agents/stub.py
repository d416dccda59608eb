"""A scripted model server for real agent clients: records every request and answers like a tiny model.

It speaks the two APIs the clients use: OpenAI Responses (`POST /v1/responses`, Codex CLI) and Anthropic Messages
(`POST /v1/messages`, Claude Code), streamed or not. The "model" is two rules: a turn whose last input is the
user's message calls the shell tool with `command`; a turn after a tool result answers `final_text`. Anything else
(`/v1/models`, `count_tokens`, unknown paths) is recorded and answered with the smallest reply the clients accept,
so the record shows exactly what each client asks for.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

# The shell tool each client offers, by name, and how its arguments carry one command line.
SHELL_ARGUMENTS = {
    "shell": lambda cmd: {"command": ["bash", "-lc", cmd]},
    "local_shell": lambda cmd: {"command": ["bash", "-lc", cmd]},
    "shell_command": lambda cmd: {"command": cmd},
    "exec_command": lambda cmd: {"cmd": cmd},
    "Bash": lambda cmd: {"command": cmd, "description": "Run the requested command"},
}


@dataclass(frozen=True)
class Recorded:
    """One request as it arrived."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any


@dataclass
class StubModel:
    """The script: which command the tool call runs and what the model says after it; plus the record."""

    command: str
    final_text: str = "Done: the command ran."
    requests: list[Recorded] = field(default_factory=list)
    _ids: Any = field(default_factory=itertools.count)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):04d}"


STUB = web.AppKey("stub", StubModel)


def shell_tool(tool_names: list[str]) -> str | None:
    """The first offered tool that runs a shell command, or None."""
    return next((name for name in tool_names if name in SHELL_ARGUMENTS), None)


def responses_wants_tool(body: Mapping[str, Any]) -> bool:
    """True when the Responses input ends with the user's message (no tool output after it)."""
    items = body.get("input")
    if not isinstance(items, list) or not items:
        return isinstance(items, str)
    last = items[-1]
    return last.get("type", "message") == "message" and last.get("role") == "user"


def messages_wants_tool(body: Mapping[str, Any]) -> bool:
    """True when the Messages conversation ends with a user turn that holds no tool result. Claude Code puts a
    `role: "system"` message (its environment notes) after the user's prompt, so those are skipped."""
    messages = [m for m in body.get("messages") or [] if m.get("role") != "system"]
    if not messages or messages[-1].get("role") != "user":
        return False
    content = messages[-1].get("content")
    return not (isinstance(content, list) and any(b.get("type") == "tool_result" for b in content))


def _tool_names(body: Mapping[str, Any]) -> list[str]:
    return [t.get("name") or (t.get("function") or {}).get("name") or t.get("type", "") for t in body.get("tools") or []]


def responses_output(stub: StubModel, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The output items of one Responses turn: a shell call, or the final message."""
    tool = shell_tool(_tool_names(body)) if responses_wants_tool(body) else None
    if tool is not None:
        arguments = json.dumps(SHELL_ARGUMENTS[tool](stub.command))
        return [{"type": "function_call", "id": stub.next_id("fc"), "call_id": stub.next_id("call"), "name": tool,
                 "arguments": arguments, "status": "completed"}]
    return [{"type": "message", "id": stub.next_id("msg"), "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": stub.final_text, "annotations": []}]}]


def messages_content(stub: StubModel, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The content blocks of one Messages turn: a Bash tool_use, or the final text."""
    tool = shell_tool(_tool_names(body)) if messages_wants_tool(body) else None
    if tool is not None:
        return [{"type": "tool_use", "id": stub.next_id("toolu"), "name": tool,
                 "input": SHELL_ARGUMENTS[tool](stub.command)}]
    return [{"type": "text", "text": stub.final_text}]


def _sse(event: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def responses_events(response_id: str, model: str, output: list[dict[str, Any]]) -> list[bytes]:
    """The smallest Responses stream Codex accepts: created, one output_item.done per item, completed."""
    usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    base = {"id": response_id, "object": "response", "model": model, "status": "in_progress", "output": []}
    events = [_sse("response.created", {"type": "response.created", "response": base})]
    events += [_sse("response.output_item.done", {"type": "response.output_item.done", "output_index": i, "item": item})
               for i, item in enumerate(output)]
    done = {**base, "status": "completed", "output": output, "usage": usage}
    return events + [_sse("response.completed", {"type": "response.completed", "response": done})]


def messages_events(message: dict[str, Any]) -> list[bytes]:
    """A full Messages stream: message_start, each block's start/delta/stop, message_delta, message_stop."""
    start = {**message, "content": [], "stop_reason": None}
    events = [_sse("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        if block["type"] == "tool_use":
            opening = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            opening, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        events += [_sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": opening}),
                   _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}),
                   _sse("content_block_stop", {"type": "content_block_stop", "index": index})]
    events.append(_sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": 5},
                                         "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None}}))
    return events + [_sse("message_stop", {"type": "message_stop"})]


async def _stream(request: web.Request, events: list[bytes]) -> web.StreamResponse:
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await reply.prepare(request)
    for event in events:
        await reply.write(event)
    await reply.write_eof()
    return reply


async def _record(request: web.Request) -> tuple[StubModel, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode(errors="replace")
    stub = request.app[STUB]
    stub.requests.append(Recorded(request.method, request.path, request.query_string, dict(request.headers), body))
    return stub, body


async def responses(request: web.Request) -> web.StreamResponse:
    stub, body = await _record(request)
    output = responses_output(stub, body)
    events = responses_events(stub.next_id("resp"), body.get("model", ""), output)
    if body.get("stream"):
        return await _stream(request, events)
    final = json.loads(events[-1].split(b"data: ", 1)[1])
    return web.json_response(final["response"])


async def messages(request: web.Request) -> web.StreamResponse:
    stub, body = await _record(request)
    content = messages_content(stub, body)
    stop = "tool_use" if content[0]["type"] == "tool_use" else "end_turn"
    message = {"id": stub.next_id("msg"), "type": "message", "role": "assistant", "model": body.get("model", ""),
               "content": content, "stop_reason": stop, "stop_sequence": None,
               "usage": {"input_tokens": 10, "output_tokens": 5}}
    if body.get("stream"):
        return await _stream(request, messages_events(message))
    return web.json_response(message)


async def count_tokens(request: web.Request) -> web.Response:
    await _record(request)
    return web.json_response({"input_tokens": 10})


async def models(request: web.Request) -> web.Response:
    await _record(request)
    return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model", "owned_by": "stub"}]})


async def anything_else(request: web.Request) -> web.Response:
    await _record(request)
    return web.json_response({"error": {"type": "not_found_error", "message": "not served by the stub"}}, status=404)


def create_app(stub: StubModel) -> web.Application:
    """The stub's application; `stub.requests` fills as requests arrive."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[STUB] = stub
    app.add_routes([web.post("/v1/responses", responses), web.post("/v1/messages", messages),
                    web.post("/v1/messages/count_tokens", count_tokens), web.get("/v1/models", models),
                    web.route("*", "/{tail:.*}", anything_else)])
    return app
