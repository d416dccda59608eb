"""The relay of a native Messages stream (`streams.Relay`): an Anthropic upstream's events unchanged, their
usage read as they pass; a stream that breaks mid-way ends with Anthropic's `error` event. A translated
stream goes through `streams.TranslatedRelay` with a `MessagesStream`."""

from __future__ import annotations

from typing import Any

from mergebroker import jsonio
from mergebroker.broker.engine.apis.messages import StreamUsageReader, error_event
from mergebroker.errors import BrokerError
from mergebroker.providers.anthropic.errors import stream_error
from mergebroker.token_usage import TokenUsage


class NativeMessagesRelay:
    """An Anthropic upstream's own events, relayed unchanged; `message_start` / `message_delta` give the usage."""

    def __init__(self) -> None:
        self._reader = StreamUsageReader()

    @property
    def usage(self) -> TokenUsage | None:
        return self._reader.usage

    def start(self) -> list[bytes]:
        return []

    def feed(self, event: bytes) -> list[bytes]:
        if event.startswith(b"event: error"):
            raise stream_error(_data(event))  # relayed as Anthropic's error event, counted as a broken stream
        if b"message_start" in event or b"message_delta" in event:
            self._reader.feed(event)
        return [event]

    def finish(self, usage: TokenUsage | None) -> list[bytes]:
        return []

    def fail(self, exc: BrokerError) -> list[bytes]:
        return [error_event(exc.status, exc.code, exc.message, exc.type)]


def _data(event: bytes) -> dict[str, Any]:
    """An event's JSON data ({} when unreadable: the error is then a generic one)."""
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    try:
        value = jsonio.loads(data) if data else None
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
