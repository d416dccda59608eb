"""How the Responses mode streams: the event sequence of one response (pure) and sending it as OpenAI's SSE.

`response_events` turns a finished Response into the events OpenAI sends for it, in order: `response.created`
and `response.in_progress` (the response with no output yet), then per output item `response.output_item.added`,
its parts (a message's `response.content_part.added`, `response.output_text.delta`s of a few words each,
`response.output_text.done`, `response.content_part.done`; a function call's
`response.function_call_arguments.delta`s and `.done`; a reasoning summary's `response.reasoning_summary_part.*`
and `response.reasoning_summary_text.*`), `response.output_item.done`, and last `response.completed` (or
`response.incomplete`) with the whole Response. Every event carries its `sequence_number`.

A mid-stream fault (`stream_error_rate`, drawn like the chat route's) ends the stream after
`stream_error_after` events with `response.failed`, the response's `error` shaped as the fault's status says
(429 `rate_limit_exceeded`, with the "try again in" hint clients parse; 529 `server_error` "Overloaded").
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from mergebroker.providers.simulator.content import count_tokens, stream_pieces

Pause = Callable[[float], Awaitable[None]]
_ARGUMENT_PIECES = 3  # a function call's arguments stream in this many deltas
_FAILURES = {429: ("rate_limit_exceeded", "Rate limit reached (simulated, mid-stream). Please try again in 1s."),
             529: ("server_error", "Overloaded")}


def _item_events(item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    at = {"output_index": index, "item_id": item["id"]}
    if item["type"] == "message":
        opened = {**item, "status": "in_progress", "content": []}
        events: list[dict[str, Any]] = [{"type": "response.output_item.added", "output_index": index, "item": opened}]
        for part_index, part in enumerate(item["content"]):
            where = {**at, "content_index": part_index}
            events.append({"type": "response.content_part.added", **where, "part": {**part, "text": ""}})
            events += [{"type": "response.output_text.delta", **where, "delta": piece, "logprobs": []}
                       for piece in stream_pieces(part["text"])]
            events.append({"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []})
            events.append({"type": "response.content_part.done", **where, "part": part})
    elif item["type"] == "function_call":
        opened = {**item, "status": "in_progress", "arguments": ""}
        events = [{"type": "response.output_item.added", "output_index": index, "item": opened}]
        arguments = item["arguments"]
        size = max(1, -(-len(arguments) // _ARGUMENT_PIECES))
        events += [{"type": "response.function_call_arguments.delta", **at, "delta": arguments[i:i + size]}
                   for i in range(0, len(arguments), size)]
        events.append({"type": "response.function_call_arguments.done", **at, "arguments": arguments,
                       "name": item["name"]})
    else:
        events = [{"type": "response.output_item.added", "output_index": index, "item": {**item, "summary": []}}]
        for summary_index, part in enumerate(item.get("summary") or []):
            where = {**at, "summary_index": summary_index}
            events.append({"type": "response.reasoning_summary_part.added", **where, "part": {**part, "text": ""}})
            events.append({"type": "response.reasoning_summary_text.delta", **where, "delta": part["text"]})
            events.append({"type": "response.reasoning_summary_text.done", **where, "text": part["text"]})
            events.append({"type": "response.reasoning_summary_part.done", **where, "part": part})
    return events + [{"type": "response.output_item.done", "output_index": index, "item": item}]


def response_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a finished `response`, numbered (see the module docstring)."""
    opened = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    events = [{"type": "response.created", "response": opened}, {"type": "response.in_progress", "response": opened}]
    for index, item in enumerate(response["output"]):
        events += _item_events(item, index)
    last = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events.append({"type": last, "response": response})
    return numbered(events)


def numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with their `sequence_number`s, from 0."""
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


def failed_events(events: list[dict[str, Any]], after: int, status: int) -> list[dict[str, Any]]:
    """The first `after` events, then `response.failed` with the fault's error (see the module docstring)."""
    code, message = _FAILURES.get(status, _FAILURES[529])
    kept = [event for event in events[:after] if event["type"] not in ("response.completed", "response.incomplete")]
    final = events[-1]["response"]
    done = [event["item"] for event in kept if event["type"] == "response.output_item.done"]
    failed = {**final, "status": "failed", "output": done, "error": {"code": code, "message": message},
              "incomplete_details": None}
    return numbered(kept + [{"type": "response.failed", "response": failed}])


def sent_text(events: list[dict[str, Any]]) -> str:
    """The text and arguments the events carry (what a provider bills when a stream fails part-way)."""
    return "".join(e["delta"] for e in events if e["type"] in ("response.output_text.delta",
                                                               "response.function_call_arguments.delta"))


async def send_events(request: web.Request, events: list[dict[str, Any]], *, base_ms: float, per_token_ms: float,
                      pause: Pause) -> web.StreamResponse:
    """Send `events` as SSE (`event: <type>` and `data: <json>`): the base latency before the first, the per-token
    latency before each delta, by its tokens."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    await pause(base_ms)
    for event in events:
        if "delta" in event and per_token_ms:
            await pause(per_token_ms * count_tokens(event["delta"]))
        await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
    await response.write_eof()
    return response
