"""What the broker reads from a Responses stream it passes through from an upstream that speaks Responses (pure).

The stream's last event (`response.completed`, `response.incomplete` or `response.failed`) carries the
whole Response: the one the broker stores, and the one whose `usage` it bills.
"""

from __future__ import annotations

from typing import Any

from mergebroker.jsonio import loads
from mergebroker.token_usage import TokenUsage

FINAL_EVENTS = frozenset(("response.completed", "response.incomplete", "response.failed"))


def completed_response(event_frame: bytes) -> dict[str, Any] | None:
    """The Response in one SSE frame (`event: ...\\ndata: {...}`) when it is a stream's final event;
    None for any other frame, or one that is not JSON."""
    data = b"\n".join(line[5:].lstrip() for line in event_frame.splitlines() if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return None
    try:
        event = loads(data)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("type") not in FINAL_EVENTS:
        return None
    response = event.get("response")
    return response if isinstance(response, dict) else None


def stream_usage(event_frame: bytes) -> TokenUsage | None:
    """The usage a stream's final frame reports; None for other frames and for a final one without usage."""
    response = completed_response(event_frame)
    return TokenUsage.from_body(response) if response is not None else None
