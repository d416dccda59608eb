"""What the broker reads from a Messages stream it passes through from an Anthropic upstream (pure).

Anthropic reports a stream's usage in two places: `message_start` carries the input side (`input_tokens`,
`cache_read_input_tokens`, `cache_creation_input_tokens`) and an early `output_tokens`; each `message_delta`
carries the running `output_tokens`, and may restate the input side (with server tools, the input grows
during the turn). The last word on each field wins.
"""

from __future__ import annotations

from typing import Any

from mergebroker.jsonio import loads
from mergebroker.token_usage import TokenUsage


class StreamUsageReader:
    """The usage of one Anthropic stream, read from its raw SSE events as they pass."""

    def __init__(self) -> None:
        self._fields: dict[str, Any] = {}

    def feed(self, event: bytes) -> None:
        """Read one SSE event (`event: ...\\ndata: {...}`); any event without usage, or that does not parse,
        is passed over."""
        data = _event_data(event)
        if data is None:
            return
        if data.get("type") == "message_start":
            message = data.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
        elif data.get("type") == "message_delta":
            usage = data.get("usage")
        else:
            return
        if isinstance(usage, dict):
            self._fields.update({name: value for name, value in usage.items() if value is not None})

    @property
    def usage(self) -> TokenUsage | None:
        """The stream's usage so far: None until an event has reported some."""
        return TokenUsage.from_body({"usage": self._fields}) if self._fields else None


def _event_data(event: bytes) -> dict[str, Any] | None:
    data = b"\n".join(line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data:
        return None
    try:
        parsed = loads(data)
    except (ValueError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None
