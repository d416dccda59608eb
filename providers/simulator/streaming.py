"""How the simulated upstream streams a chat reply, with the quirks of providers that stream differently.

A stream is SSE: a role chunk, content chunks of a few words, a finish chunk, the usage chunk when
`stream_options.include_usage` asks for it, then `data: [DONE]`. A reply cut at `max_tokens` ends the
same way, its finish chunk saying "length". Tool calls (`providers.simulator.chat_agent`) stream after the
content as `delta.tool_calls` chunks, per call its id and name, then its arguments.

Quirks seen at real providers, each a config field that changes at run time:
- `ignore_stream`: a streamed request is answered with a plain `chat.completion` JSON body (the server
  side of the check lives in `providers.simulator.server`);
- `reject_stream_options` / `reject_stream`: 400 `invalid_request_error` naming the field
  (`stream_options` when present; `stream` when true), as providers without that support answer;
- `stream_error_rate`: the stream ends after `stream_error_after` chunks (the role chunk counts) with an
  error event instead of the rest, `data: {"error": {...}}` as OpenAI sends one mid-stream, shaped as a
  429 `rate_limit_exceeded` or a 529 `overloaded_error` (`stream_error_status`), and no `[DONE]`.
  It is drawn from the seeded RNG like the other faults.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mergebroker.errors import InvalidRequest, error_body
from mergebroker.providers.simulator.content import Reply, stream_pieces
from mergebroker.providers.simulator.faults import SimulatorConfig, decide_stream_error

Pause = Callable[[float], Awaitable[None]]

_STREAM_ERRORS = {429: error_body("Rate limit reached (simulated, mid-stream). Please try again in 1s.",
                                  "rate_limit_error", None, "rate_limit_exceeded"),
                  529: error_body("Overloaded", "overloaded_error", None, "overloaded_error")}


def refuse_stream_fields(body: Mapping[str, Any], config: SimulatorConfig) -> None:
    """Raise `InvalidRequest` for a streaming field this provider does not take (`reject_stream*`)."""
    if config.reject_stream_options and "stream_options" in body:
        raise InvalidRequest("Unrecognized request argument supplied: stream_options", param="stream_options")
    if config.reject_stream and body.get("stream"):
        raise InvalidRequest("Unsupported value: 'stream' does not support true with this model. Only the default "
                             "(false) value is supported.", param="stream", code="unsupported_value")


@dataclass(frozen=True)
class StreamPlan:
    """What one streamed reply sends: its pieces, how it ends, and the tokens that pace it.

    `error_after` is the number of chunks (the role chunk counts) sent before an error event of
    `error_status`'s shape ends the stream; None for a stream that ends normally.
    """

    pieces: tuple[str, ...]
    finish_reason: str
    completion_tokens: int
    error_after: int | None = None
    error_status: int = 429
    tool_calls: tuple[dict[str, Any], ...] = ()

    @property
    def sent_text(self) -> str:
        """The content the caller receives (all of it, unless an error ends the stream first)."""
        pieces = self.pieces if self.error_after is None else self.pieces[:max(0, self.error_after - 1)]
        return "".join(pieces)


def plan_stream(reply: Reply, config: SimulatorConfig, rng: random.Random) -> StreamPlan:
    """The plan of a streamed reply, with the mid-stream error fault decided now."""
    error_after = config.stream_error_after if decide_stream_error(config, rng) else None
    return StreamPlan(tuple(stream_pieces(reply.content)), reply.finish_reason, reply.completion_tokens,
                      error_after, config.stream_error_status, reply.tool_calls)


def tool_call_deltas(calls: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The `delta.tool_calls` entries that stream `calls`, as OpenAI sends them: per call its id and name with
    empty arguments, then the arguments."""
    deltas: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        deltas.append({"index": index, "id": call["id"], "type": "function",
                       "function": {"name": call["function"]["name"], "arguments": ""}})
        deltas.append({"index": index, "function": {"arguments": call["function"]["arguments"]}})
    return deltas


async def send_stream(request: web.Request, meta: Mapping[str, Any], plan: StreamPlan, *,
                      usage: Mapping[str, Any] | None, config: SimulatorConfig, pause: Pause) -> web.StreamResponse:
    """Send the plan as SSE. The base latency comes before the first chunk; the per-token latency is spread
    over the content chunks in proportion to their length. `usage` is sent when the caller asked for it."""
    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {**meta, "object": "chat.completion.chunk", "system_fingerprint": "sim", "choices": choices,
                 **({"usage": None} if usage is not None else {}), **extra}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def choice(delta: dict[str, Any], finish_reason: str | None = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    content = "".join(plan.pieces)
    per_token_ms = config.latency_per_token_ms * plan.completion_tokens
    chunks = [(config.latency_base_ms, choice({"role": "assistant", "content": ""}))]
    chunks += [(per_token_ms * len(piece) / len(content), choice({"content": piece})) for piece in plan.pieces]
    chunks += [(0.0, choice({"tool_calls": [delta]})) for delta in tool_call_deltas(plan.tool_calls)]
    for delay_ms, chunk in chunks[:plan.error_after]:
        await pause(delay_ms)
        await response.write(event(chunk))
    if plan.error_after is not None:
        await response.write(f"data: {json.dumps(_STREAM_ERRORS[plan.error_status])}\n\n".encode())
    else:
        await response.write(event(choice({}, plan.finish_reason)))
        if usage is not None:
            await response.write(event([], usage=usage))
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
