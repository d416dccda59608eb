"""An Anthropic Message as a `chat.completion` (pure): content, tool calls, refusal, finish reason and usage.

Text blocks are joined into `content`; `tool_use` blocks become `tool_calls` (finish reason `tool_calls`),
except the forced structured-output tool, whose input is the answer's `content` (finish reason `stop`).
When the caller asked for structured output, a `refusal` stop reason puts the text in `message.refusal`
with `content: null` and finish reason `stop`, as OpenAI answers a refused structured request; otherwise a
refusal stays `content_filter`. Thinking blocks are left out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mergebroker.errors import UpstreamBadResponse
from mergebroker.providers.anthropic.structured import ReplyShape
from mergebroker.providers.anthropic.tools import to_tool_calls
from mergebroker.token_usage import NO_USAGE, TokenUsage

FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                  "model_context_window_exceeded": "length", "tool_use": "tool_calls",
                  "refusal": "content_filter", "pause_turn": "stop"}
"""Anthropic `stop_reason` -> OpenAI `finish_reason` (an unknown or missing reason counts as "stop")."""

REFUSED = "The model declined to answer."
"""`message.refusal` when a refused structured request came back without any text."""


def finish_reason(stop_reason: Any, shape: ReplyShape = ReplyShape()) -> str:
    """The OpenAI finish_reason of an Anthropic stop_reason (the forced answer tool's `tool_use` is a `stop`)."""
    if stop_reason == "tool_use" and shape.json_tool is not None:
        return "stop"
    return FINISH_REASONS.get(stop_reason, "stop") if isinstance(stop_reason, str) else "stop"


def to_usage(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """OpenAI usage from Anthropic's, through the one reader and writer: the prompt counts cache writes and
    reads too (all are input)."""
    return (TokenUsage.from_body(dict(usage or {})) or NO_USAGE).as_body()


def to_completion(message: Mapping[str, Any], *, created: int, shape: ReplyShape = ReplyShape()) -> dict[str, Any]:
    """A `chat.completion` from a Message, read as `shape` says (see the module docstring)."""
    blocks = message.get("content")
    if message.get("type") != "message" or not isinstance(blocks, list):
        raise UpstreamBadResponse("upstream Messages answer is not a message")
    text = "".join(b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str))
    answers = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"
               and shape.json_tool is not None and b.get("name") == shape.json_tool]
    if answers:
        text = json.dumps(answers[0].get("input") or {}, ensure_ascii=False)
    calls = to_tool_calls(blocks, skip=shape.json_tool)
    reason = finish_reason(message.get("stop_reason"), shape)
    reply: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
    if shape.structured and message.get("stop_reason") == "refusal":
        reply.update(content=None, refusal=text or REFUSED)
        reason = "stop"
    if calls:
        reply["tool_calls"] = calls
    return {"id": str(message.get("id") or ""), "object": "chat.completion", "created": created,
            "model": str(message.get("model") or ""),
            "choices": [{"index": 0, "message": reply, "logprobs": None, "finish_reason": reason}],
            "usage": to_usage(message.get("usage"))}
