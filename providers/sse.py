"""Read an OpenAI chat stream's events: the text delta, the finish reason and the usage each one carries.

`mid_stream_error(event)` reads the `data: {"error": ...}` event an OpenAI-compatible upstream sends when it
breaks an accepted stream (429 and overload included), so no relay mistakes a cut answer for a whole one.
`chat_event(event)` takes one complete SSE event as `OpenAICompatProvider.stream_chat` yields it
(`data: {...}\\n\\n`) and never raises: comments, keep-alives and unreadable events read as empty, so a
consumer that splits the text as it arrives (early release of merged answers) only sees what it can use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mergebroker import jsonio
from mergebroker.errors import UpstreamHTTPError


@dataclass(frozen=True)
class ChatEvent:
    """What one stream event says: new text (maybe empty), a finish reason, usage, the `[DONE]` marker."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False
    meta: dict[str, Any] | None = None  # id, created, model, system_fingerprint of a chunk, when present


_EMPTY = ChatEvent()
_DONE = ChatEvent(done=True)
_META_KEYS = ("id", "created", "model", "system_fingerprint")


def chat_event(event: bytes) -> ChatEvent:
    """The content of one SSE event of a chat completion stream (see the module docstring)."""
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data:
        return _EMPTY
    if data == b"[DONE]":
        return _DONE
    try:
        chunk = jsonio.loads(data)
    except (ValueError, RecursionError):
        return _EMPTY
    if not isinstance(chunk, dict):
        return _EMPTY
    usage = chunk.get("usage")
    choices = chunk.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else None
    finish = choice.get("finish_reason")
    return ChatEvent(text=text if isinstance(text, str) else "", finish_reason=finish if isinstance(finish, str) else None,
                     usage=usage if isinstance(usage, dict) else None,
                     meta={k: chunk[k] for k in _META_KEYS if k in chunk} or None)


_MID_STREAM_STATUS = {"rate_limit_exceeded": 429, "rate_limit_error": 429, "insufficient_quota": 429,
                      "overloaded_error": 529, "overloaded": 529, "server_error": 500, "timeout_error": 504}
"""An error event's `code` or `type` -> the HTTP status it would have had before the stream began."""


def mid_stream_error(event: bytes) -> UpstreamHTTPError | None:
    """The upstream error one SSE event carries in place of a chunk, else None (never raises)."""
    if b'"error"' not in event or b'"choices"' in event:  # cheap: a chunk with text never reads as an error
        return None
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    try:
        body = jsonio.loads(data) if data else None
    except (ValueError, RecursionError):
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None
    status = _MID_STREAM_STATUS.get(str(error.get("code")), _MID_STREAM_STATUS.get(str(error.get("type")), 500))
    given = error.get("message")
    message = given if isinstance(given, str) else "the upstream broke the stream"
    failed = UpstreamHTTPError(status, message, body={"error": error})
    if status == 529:  # overload, as Anthropic's 529 reads: retryable, and the caller may come back soon
        failed.status, failed.type, failed.code = 503, "service_unavailable", "upstream_overloaded"
    return failed
