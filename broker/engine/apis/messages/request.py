"""A Messages create (or count_tokens) body, checked at the edge, and what the broker routes on (pure).

A malformed body gets its 400 before it waits anywhere, its message naming the field as Anthropic names
it (`max_tokens`, `messages.1.content.0.type`): the Anthropic error envelope has no `param`, so the message
is all a caller sees. Only what the broker routes on is lifted out; everything else stays in `body`,
which the native path forwards as it came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mergebroker.broker.engine.apis.messages.content import (
    block_types,
    check_messages,
    check_system,
)
from mergebroker.broker.engine.apis.messages.tools import check_tool_choice, check_tools
from mergebroker.errors import InvalidRequest

# Fields that give the model powers chat cannot carry: a request using one is answered natively where it can be.
_NOT_TEXT_FIELDS = ("tools", "tool_choice", "mcp_servers", "container")


@dataclass(frozen=True)
class MessagesRequest:
    """A checked `POST /v1/messages` (or `/v1/messages/count_tokens`) body.

    `text_only` is true when the request is plain text in, plain text out: text blocks only, no tools, no
    `tool_choice`, no thinking, no MCP servers or container. Such a request runs as the chat request it
    translates to (merged, cached); any other goes to an Anthropic upstream as sent, where there is one."""

    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int | None
    has_tools: bool
    text_only: bool

    @property
    def thinking(self) -> bool:
        """Whether the caller asked to see the model's thinking (`thinking.type` other than "disabled")."""
        return thinking_enabled(self.body)


def parse_request(raw: Any) -> MessagesRequest:
    """Check a Messages create body; raise `InvalidRequest` naming the first bad field."""
    body = _check_common(raw)
    limit = body.get("max_tokens")
    if limit is None:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens", code="missing_required_parameter")
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise InvalidRequest("max_tokens: must be an integer", param="max_tokens", code="invalid_type")
    if limit < 1:
        raise InvalidRequest(f"max_tokens: must be at least 1, got {limit}", param="max_tokens",
                             code="invalid_value")
    return _request(body, max_tokens=limit)


def parse_count_request(raw: Any) -> MessagesRequest:
    """Check a `POST /v1/messages/count_tokens` body: a create body without `max_tokens`."""
    return _request(_check_common(raw), max_tokens=None)


def thinking_enabled(body: dict[str, Any]) -> bool:
    """Whether a body's `thinking` config asks for thinking ("enabled", "adaptive"...), not "disabled"."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") != "disabled"


def _check_common(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest("The request body must be a JSON object", code="invalid_type")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: a non-empty string is required", param="model",
                             code="missing_required_parameter")
    check_messages(raw.get("messages"))
    check_system(raw.get("system"))
    check_tools(raw.get("tools"))
    check_tool_choice(raw.get("tool_choice"))
    stream = raw.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("stream: must be a boolean", param="stream", code="invalid_type")
    _check_sampling(raw)
    for name in ("metadata", "thinking", "broker"):
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise InvalidRequest(f"{name}: must be an object", param=name, code="invalid_type")
    return raw


def _check_sampling(raw: dict[str, Any]) -> None:
    for name in ("temperature", "top_p", "top_k"):
        value = raw.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise InvalidRequest(f"{name}: must be a number", param=name, code="invalid_type")
    stops = raw.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise InvalidRequest("stop_sequences: must be an array of strings", param="stop_sequences",
                             code="invalid_type")


def _request(body: dict[str, Any], *, max_tokens: int | None) -> MessagesRequest:
    messages = tuple(body["messages"])
    text_only = (not any(body.get(name) for name in _NOT_TEXT_FIELDS) and not thinking_enabled(body)
                 and block_types(messages) <= {"text"})
    return MessagesRequest(body=body, model=body["model"], stream=bool(body.get("stream")), max_tokens=max_tokens,
                           has_tools=bool(body.get("tools")), text_only=text_only)
