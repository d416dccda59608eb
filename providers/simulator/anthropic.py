"""The simulator's Anthropic mode: `POST /v1/messages` as Anthropic's Messages API (version 2023-06-01) speaks it.

Same answers, latency, faults and counters as the OpenAI endpoints (one `Simulator` serves both), in
Anthropic's shapes: a key (`x-api-key`, or a Bearer token as newer SDKs send) and `anthropic-version`
are required, the body is validated the way
the real API does (required `max_tokens`, roles user/assistant, temperature 0..1, unknown fields refused),
answers are Messages with `stop_reason` and `usage`, streams are named events (`message_start`,
`content_block_*`, `ping`, `message_delta`, `message_stop`), and errors use Anthropic's envelope
(`{"type": "error", "error": {"type", "message"}}`, 529 `overloaded_error` included). A test drives
this mode with the official `anthropic` SDK, so it cannot drift from the real protocol.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Mapping, Protocol

from aiohttp import web

from mergebroker.providers.simulator.content import (Reply, compose_reply, count_tokens, parse_request_blocks,
                                                     prompt_tokens, question_text, stream_pieces)
from mergebroker.providers.simulator.faults import FaultInjector, SimulatorConfig, is_int


class Simulator(Protocol):
    """What this mode uses of `providers.simulator.server.Simulator` (a sibling it extends, so its private parts too)."""

    stats: Any
    last_request_body: dict[str, Any] | None
    _faults: FaultInjector

    @property
    def config(self) -> SimulatorConfig: ...

    async def _injected_fault(self, request: web.Request, *, chat: bool,
                              stream: bool = False) -> web.StreamResponse | None: ...

    async def _pause(self, milliseconds: float) -> None: ...

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               504: "timeout_error", 529: "overloaded_error"}
"""Anthropic's error type per HTTP status; any other status is an `api_error`."""

_FIELDS = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k",
                     "stream", "metadata", "tools", "tool_choice", "thinking", "service_tier"})
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


class AnthropicRequestError(Exception):
    """A request the Messages API would refuse: status, error type and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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


def _check_text_blocks(content: Any, where: str) -> None:
    if isinstance(content, str):
        if not content:
            raise AnthropicRequestError(400, f"{where}: text content blocks must be non-empty")
        return
    if not isinstance(content, list) or not content:
        raise AnthropicRequestError(400, f"{where}: Input should be a valid string or a non-empty list")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise AnthropicRequestError(400, f"{where}.{j}: the simulator takes text content blocks only")


def _check_number(body: Mapping[str, Any], name: str, high: float) -> None:
    value = body.get(name)
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and 0 <= value <= high):
        raise AnthropicRequestError(400, f"{name}: Input should be between 0 and {high:g}")


def validate(headers: Mapping[str, str], body: Any) -> dict[str, Any]:
    """The request's body if the Messages API would take it, else `AnthropicRequestError` (status, message)."""
    if not headers.get("x-api-key") and not headers.get("Authorization", "").startswith("Bearer "):
        raise AnthropicRequestError(401, "x-api-key header is required")
    if not headers.get("anthropic-version"):
        raise AnthropicRequestError(400, "anthropic-version: header is required")
    if not isinstance(body, dict):
        raise AnthropicRequestError(400, "The request body is not valid JSON.")
    extra = sorted(set(body) - _FIELDS)
    if extra:
        raise AnthropicRequestError(400, f"{extra[0]}: Extra inputs are not permitted")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise AnthropicRequestError(400, "model: Field required")
    if not is_int(body.get("max_tokens")) or body["max_tokens"] < 1:
        raise AnthropicRequestError(400, "max_tokens: Field required (an integer >= 1)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicRequestError(400, "messages: at least one message is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise AnthropicRequestError(400, f"messages.{i}.role: Input should be 'user' or 'assistant'")
        _check_text_blocks(m.get("content"), f"messages.{i}.content")
    if body.get("system") is not None:
        _check_text_blocks(body["system"], "system")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s.strip() for s in stops)):
        raise AnthropicRequestError(400, "stop_sequences: each stop sequence must contain non-whitespace")
    _check_number(body, "temperature", 1)
    _check_number(body, "top_p", 1)
    return body


def _openai_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation as the simulator's content rules read it (system first)."""
    system = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    return system + [{"role": m["role"], "content": m["content"]} for m in body["messages"]]


def _stopped(reply: Reply, stops: list[str]) -> tuple[str, str, str | None]:
    """The reply's text, stop reason and matched stop sequence, cut at the first stop sequence it holds."""
    hits = [(reply.content.find(s), s) for s in stops if s in reply.content]
    if hits:
        at, sequence = min(hits)
        return reply.content[:at], "stop_sequence", sequence
    return reply.content, _STOP_REASONS.get(reply.finish_reason, "end_turn"), None


class AnthropicMode:
    """The Messages endpoint of one `Simulator` (its config, faults, RNG and counters)."""

    def __init__(self, simulator: Simulator) -> None:
        self._sim = simulator

    def routes(self) -> list[web.RouteDef]:
        """`POST /v1/messages` (Anthropic's path; its SDK's base URL is the server's root)."""
        return [web.post("/v1/messages", self.messages)]

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages: validate, maybe inject a fault, then answer as a Message or a stream."""
        sim = self._sim
        sim.stats.calls["messages"] += 1
        try:
            raw = await request.json()
        except (ValueError, UnicodeDecodeError):
            raw = None
        try:
            body = sim.last_request_body = validate(request.headers, raw)
        except AnthropicRequestError as exc:
            return error_response(exc.status, str(exc))
        messages, stream = _openai_messages(body), bool(body.get("stream"))
        sim.stats.chat_calls += 1
        sim.stats.stream_calls += int(stream)
        sim.stats.merged_calls += int(bool(parse_request_blocks(question_text(messages))))
        if (early := await sim._injected_fault(request, chat=True, stream=stream)) is not None:
            return _as_anthropic_error(early)
        reply = compose_reply(messages, max_tokens=body["max_tokens"], config=sim.config, rng=sim._faults.rng)
        sim.stats.record_faults(*reply.faults)
        text, stop_reason, sequence = _stopped(reply, body.get("stop_sequences") or [])
        usage = {"input_tokens": prompt_tokens(messages), "output_tokens": count_tokens(text),
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        sim.stats.prompt_tokens += usage["input_tokens"]
        sim.stats.completion_tokens += usage["output_tokens"]
        message = {"id": f"msg_sim_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                   "model": body["model"], "content": [], "stop_reason": None, "stop_sequence": None}
        if stream:
            return await self._stream(request, message, text, (stop_reason, sequence), usage)
        config = sim.config
        await sim._pause(config.latency_base_ms + config.latency_per_token_ms * usage["output_tokens"])
        return web.json_response({**message, "content": [{"type": "text", "text": text}],
                                  "stop_reason": stop_reason, "stop_sequence": sequence, "usage": usage})

    async def _stream(self, request: web.Request, message: dict[str, Any], text: str,
                      stop: tuple[str, str | None], usage: dict[str, int]) -> web.StreamResponse:
        """The named-event stream, paced like the OpenAI stream (base latency first, per-token spread)."""
        def event(name: str, **data: Any) -> bytes:
            return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()

        config = self._sim.config
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await self._sim._pause(config.latency_base_ms)
        await response.write(event("message_start", message={**message, "usage": {**usage, "output_tokens": 1}}))
        await response.write(event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
        await response.write(event("ping"))
        per_token_ms = config.latency_per_token_ms * usage["output_tokens"]
        for piece in stream_pieces(text):
            await self._sim._pause(per_token_ms * len(piece) / len(text))
            await response.write(event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece}))
        await response.write(event("content_block_stop", index=0))
        await response.write(event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
                                   usage={"output_tokens": usage["output_tokens"]}))
        await response.write(event("message_stop"))
        await response.write_eof()
        return response


def anthropic_routes(simulator: Simulator) -> list[web.RouteDef]:
    """The Anthropic mode's routes for `simulator`."""
    return AnthropicMode(simulator).routes()
