"""The simulator's Anthropic mode: `POST /v1/messages` as Anthropic's Messages API (version 2023-06-01) speaks it.

Same answers, latency, faults and counters as the OpenAI endpoints (one `Simulator` serves both), in
Anthropic's shapes: a key (`x-api-key`, or a Bearer token as newer SDKs send) and `anthropic-version`
are required, every body is validated against the SDK's request types and a strict upstream's rules
(`providers.simulator.anthropic_validate`), answers are Messages with `stop_reason` and `usage`, streams
are named events (`message_start`, `content_block_*`, `ping`, `message_delta`, `message_stop`; a
mid-stream fault, `stream_error_rate`, ends one with an `error` event after `stream_error_after` events,
`rate_limit_error` or `overloaded_error` as `stream_error_status` says), usage splits
the prompt by its `cache_control` breakpoints (`providers.simulator.anthropic_cache`), and errors
use Anthropic's envelope (`{"type": "error", "error": {"type", "message"}}`, 529 `overloaded_error`
included). As an agent's model (`providers.simulator.agent`) it calls the tools it is given (`tool_use`
blocks, streamed as `input_json_delta`s), answers from tool results once they come, and answers
`output_config.format` with JSON following the schema. Images are accepted. Beta calls (`?beta=true`, an
`anthropic-beta` header) are checked against the SDK's beta types, so Claude Code's bodies (`context_management`,
adaptive `thinking`, tools with `defer_loading`, system reminders as `role: "system"` turns) are taken;
`POST /v1/messages/count_tokens` counts a prompt as this route does. Every call is recorded for
`GET /_sim/last_request` (headers included, so tests see `anthropic-beta` and `cache_control` arrive). Tests
drive this mode with the official `anthropic` SDK, so it cannot drift from the real protocol.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from mergebroker.clock import Clock
from mergebroker.providers.simulator.agent import after_tools, instance, tool_calls
from mergebroker.providers.simulator.anthropic_cache import BreakpointCache
from mergebroker.providers.simulator.anthropic_validate import AnthropicRequestError, validate
from mergebroker.providers.simulator.billing import cache_scope
from mergebroker.providers.simulator.content import (
    compose_reply,
    count_tokens,
    parse_request_blocks,
    prompt_tokens,
    question_text,
    stream_pieces,
)
from mergebroker.providers.simulator.faults import FaultInjector, SimulatorConfig, decide_stream_error


class Simulator(Protocol):
    """What this mode uses of `providers.simulator.server.Simulator` (a sibling it extends, so its private parts too)."""

    stats: Any
    clock: Clock
    _faults: FaultInjector

    @property
    def config(self) -> SimulatorConfig: ...

    def record_request(self, request: web.Request, body: Any) -> None: ...

    async def _injected_fault(self, request: web.Request, *, chat: bool, stream: bool = False,
                              random_faults: bool = True) -> web.StreamResponse | None: ...

    async def _pause(self, milliseconds: float) -> None: ...

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               504: "timeout_error", 529: "overloaded_error"}
"""Anthropic's error type per HTTP status; any other status is an `api_error`."""

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
_JSON_PIECES = 3  # a tool's input streams in this many `input_json_delta`s


@dataclass
class Answer:
    """What the model answers: its content blocks, why it stopped, the stop sequence met, faults that shaped it."""

    blocks: list[dict[str, Any]]
    stop_reason: str
    stop_sequence: str | None = None
    faults: tuple[str, ...] = field(default=())

    def output_tokens(self) -> int:
        """Tokens of its text and of its tools' inputs."""
        return sum(count_tokens(b["text"]) if b["type"] == "text" else count_tokens(json.dumps(b["input"]))
                   for b in self.blocks)


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """An error in Anthropic's envelope."""
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
            "request_id": f"req_sim_{uuid.uuid4().hex[:20]}"}
    return web.json_response(body, status=status, headers=headers)


def _as_anthropic_error(response: web.StreamResponse) -> web.StreamResponse:
    """An injected fault's OpenAI-shaped error answer re-shaped as Anthropic's (status and Retry-After kept)."""
    if not isinstance(response, web.Response) or response.status < 400 or not isinstance(response.body, bytes):
        return response  # a malformed body or an already written stream stays what it is
    message = (json.loads(response.body).get("error") or {}).get("message") or "simulated error"
    retry_after = response.headers.get("Retry-After")
    return error_response(response.status, message, {"retry-after": retry_after} if retry_after else None)


async def _raw_json(request: web.Request) -> Any:
    """The body as JSON, or None when it is not JSON (validation refuses it then)."""
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError):
        return None


def _openai_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation as the simulator's content rules read it (system first)."""
    system = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    return system + [{"role": m["role"], "content": m["content"]} for m in body["messages"]]


def _blocks(content: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _result_text(block: Mapping[str, Any]) -> str:
    content = block.get("content")
    return content if isinstance(content, str) else "".join(b.get("text") or "" for b in content or [])


def _text_answer(body: Mapping[str, Any], messages: list[dict[str, Any]], sim: Simulator) -> Answer:
    """The simulator's usual answer (merged calls block by block, faults), cut at the first stop sequence."""
    reply = compose_reply(messages, max_tokens=body["max_tokens"], config=sim.config, rng=sim._faults.rng)
    hits = [(reply.content.find(s), s) for s in body.get("stop_sequences") or [] if s in reply.content]
    if hits:
        at, sequence = min(hits)
        return Answer([{"type": "text", "text": reply.content[:at]}], "stop_sequence", sequence, reply.faults)
    return Answer([{"type": "text", "text": reply.content}], _STOP_REASONS.get(reply.finish_reason, "end_turn"),
                  None, reply.faults)


def is_beta(request: web.Request) -> bool:
    """Whether a call is a beta one (`?beta=true`, as the SDK's `client.beta` and Claude Code send it, or an
    `anthropic-beta` header): its body is checked against the SDK's beta types."""
    return request.query.get("beta") == "true" or bool(request.headers.get("anthropic-beta"))


def answer(body: Mapping[str, Any], messages: list[dict[str, Any]], sim: Simulator) -> Answer:
    """What the model answers `body`: from tool results, structured output, tool calls, or text. (A system turn
    after the last user turn, as Claude Code sends reminders, does not hide that turn's tool results.)"""
    question = question_text(messages)
    last = next(m for m in reversed(body["messages"]) if m["role"] != "system")
    results = [b for b in _blocks(last["content"]) if b.get("type") == "tool_result"]
    if results:
        return Answer([{"type": "text", "text": after_tools([_result_text(b) for b in results])}], "end_turn")
    output = (body.get("output_config") or {}).get("format")
    if isinstance(output, dict) and output.get("type") == "json_schema":
        return Answer([{"type": "text", "text": json.dumps(instance(output["schema"], question))}], "end_turn")
    choice = body.get("tool_choice") or {"type": "auto"}
    tools = [{"name": t["name"], "schema": t.get("input_schema")} for t in body.get("tools") or []
             if "name" in t and t.get("type") in (None, "custom")]  # server tools (web search, ...) run upstream
    calls = tool_calls(tools, choice["type"], named=choice.get("name"),
                       parallel=not choice.get("disable_parallel_tool_use"), seed=question) if tools else []
    if not calls:
        return _text_answer(body, messages, sim)
    said = [{"type": "text", "text": f"Calling {len(calls)} tool(s)."}] if choice["type"] == "auto" else []
    return Answer(said + [{"type": "tool_use", "id": f"toolu_sim_{uuid.uuid4().hex[:20]}", "name": name,
                           "input": value} for name, value in calls], "tool_use")


class AnthropicMode:
    """The Messages endpoint of one `Simulator` (its config, faults, RNG and counters)."""

    def __init__(self, simulator: Simulator) -> None:
        self._sim = simulator
        self._cache = BreakpointCache(simulator.clock)

    def routes(self) -> list[web.RouteDef]:
        """`POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's paths; its SDK's base URL is the
        server's root). Any query string (`?beta=true`) is taken."""
        return [web.post("/v1/messages", self.messages), web.post("/v1/messages/count_tokens", self.count_tokens)]

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages/count_tokens: `{"input_tokens": N}`, the prompt as `/v1/messages` counts it (only the
        `down` and `status_override` faults apply)."""
        sim = self._sim
        sim.stats.calls["count_tokens"] += 1
        raw = await _raw_json(request)
        sim.record_request(request, raw)
        try:
            body = validate(request.headers, raw, beta=is_beta(request), count=True)
        except AnthropicRequestError as exc:
            return error_response(exc.status, str(exc))
        if (early := await sim._injected_fault(request, chat=False, random_faults=False)) is not None:
            return _as_anthropic_error(early)
        return web.json_response({"input_tokens": prompt_tokens(_openai_messages(body))})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages: validate, maybe inject a fault, then answer as a Message or a stream."""
        sim = self._sim
        sim.stats.calls["messages"] += 1
        raw = await _raw_json(request)
        sim.record_request(request, raw)
        try:
            body = validate(request.headers, raw, beta=is_beta(request))
        except AnthropicRequestError as exc:
            return error_response(exc.status, str(exc))
        messages, stream = _openai_messages(body), bool(body.get("stream"))
        sim.stats.chat_calls += 1
        sim.stats.stream_calls += int(stream)
        sim.stats.merged_calls += int(bool(parse_request_blocks(question_text(messages))))
        if (early := await sim._injected_fault(request, chat=True, stream=stream)) is not None:
            return _as_anthropic_error(early)
        reply = answer(body, messages, sim)
        sim.stats.record_faults(*reply.faults)
        usage = self._usage(request, body, messages, reply)
        sim.stats.prompt_tokens += usage["input_tokens"] + usage["cache_read_input_tokens"] + usage[
            "cache_creation_input_tokens"]
        sim.stats.cache_read_input_tokens += usage["cache_read_input_tokens"]
        sim.stats.cache_creation_input_tokens += usage["cache_creation_input_tokens"]
        sim.stats.completion_tokens += usage["output_tokens"]
        message = {"id": f"msg_sim_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                   "model": body["model"], "content": [], "stop_reason": None, "stop_sequence": None}
        if stream:
            return await self._stream(request, message, reply, usage)
        config = sim.config
        await sim._pause(config.latency_base_ms + config.latency_per_token_ms * usage["output_tokens"])
        return web.json_response({**message, "content": reply.blocks, "stop_reason": reply.stop_reason,
                                  "stop_sequence": reply.stop_sequence, "usage": usage})

    def _usage(self, request: web.Request, body: dict[str, Any], messages: list[dict[str, Any]],
               reply: Answer) -> dict[str, int]:
        """Anthropic's usage: the prompt split into what the breakpoint cache read, what it wrote, and the rest
        (`providers.simulator.anthropic_cache`; its counts are capped by the prompt's own count)."""
        total = prompt_tokens(messages)
        cache = self._cache.use(cache_scope(request.headers, self._sim.config), body, self._sim.config.cache_ttl_s)
        read = min(cache.read, total)
        written = min(cache.written, total - read)
        return {"input_tokens": total - read - written, "output_tokens": reply.output_tokens(),
                "cache_creation_input_tokens": written, "cache_read_input_tokens": read}

    async def _stream(self, request: web.Request, message: dict[str, Any], reply: Answer,
                      usage: dict[str, int]) -> web.StreamResponse:
        """The named-event stream, paced like the OpenAI stream (base latency first, per-token spread over text)."""
        config = self._sim.config
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        # A real upstream may break an accepted stream with an `error` event (429 or 529), after some events.
        cut = config.stream_error_after if decide_stream_error(config, self._sim._faults.rng) else None
        sent = 0

        async def write(frame: bytes) -> None:
            nonlocal sent
            if cut is not None and sent >= cut:
                raise _StreamCut
            await response.write(frame)
            sent += 1

        try:
            await self._events(write, message, reply, usage)
        except _StreamCut:
            status = config.stream_error_status
            await response.write(_event("error", error={"type": ERROR_TYPES.get(status, "api_error"),
                                                        "message": f"Simulated mid-stream error ({status})."}))
        await response.write_eof()
        return response

    async def _events(self, write: Any, message: dict[str, Any], reply: Answer, usage: dict[str, int]) -> None:
        """The stream's events, from message_start to message_stop, each through `write`."""
        config = self._sim.config
        await self._sim._pause(config.latency_base_ms)
        await write(_event("message_start", message={**message, "usage": {**usage, "output_tokens": 1}}))
        await write(_event("ping"))
        per_token_ms = config.latency_per_token_ms * usage["output_tokens"]
        text_length = sum(len(b["text"]) for b in reply.blocks if b["type"] == "text") or 1
        for index, block in enumerate(reply.blocks):
            if block["type"] == "text":
                await write(_event("content_block_start", index=index, content_block={"type": "text", "text": ""}))
                for piece in stream_pieces(block["text"]):
                    await self._sim._pause(per_token_ms * len(piece) / text_length)
                    await write(_event("content_block_delta", index=index,
                                       delta={"type": "text_delta", "text": piece}))
            else:
                await write(_event("content_block_start", index=index, content_block={**block, "input": {}}))
                arguments = json.dumps(block["input"])
                size = -(-len(arguments) // _JSON_PIECES)
                for at in range(0, len(arguments), size):
                    await write(_event("content_block_delta", index=index, delta={
                        "type": "input_json_delta", "partial_json": arguments[at:at + size]}))
            await write(_event("content_block_stop", index=index))
        await write(_event("message_delta", delta={"stop_reason": reply.stop_reason,
                                                   "stop_sequence": reply.stop_sequence}, usage=usage))
        await write(_event("message_stop"))


def _event(name: str, **data: Any) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()


class _StreamCut(Exception):
    """Raised by a stream's writer where a simulated mid-stream error cuts it."""


def anthropic_routes(simulator: Simulator) -> list[web.RouteDef]:
    """The Anthropic mode's routes for `simulator`."""
    return AnthropicMode(simulator).routes()
