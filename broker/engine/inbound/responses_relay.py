"""The relay of a native Responses stream (`streams.Relay`): the upstream's events unchanged, its finished
Response handed to `on_done` (the store), a broken stream ended with the API's own failure event. A
translated stream goes through `streams.TranslatedRelay` with a `ResponsesStream`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mergebroker import jsonio
from mergebroker.broker.engine.apis.responses import completed_response
from mergebroker.errors import BrokerError
from mergebroker.token_usage import TokenUsage

OnDone = Callable[[dict[str, Any] | None], None]


class NativeResponsesRelay:
    """An upstream's own Responses events, relayed unchanged; its final Response read on the way."""

    def __init__(self, on_done: OnDone) -> None:
        self._on_done = on_done
        self._sequence = -1
        self.usage: TokenUsage | None = None

    def start(self) -> list[bytes]:
        return []

    def feed(self, event: bytes) -> list[bytes]:
        if b'"sequence_number"' in event:
            self._sequence = max(self._sequence, _sequence_of(event))
        if b'"response.completed"' in event or b'"response.incomplete"' in event or b'"response.failed"' in event:
            response = completed_response(event)
            if response is not None:
                self.usage = TokenUsage.from_body(response)
                self._on_done(response)
        return [event]

    def finish(self, usage: TokenUsage | None) -> list[bytes]:
        return []

    def fail(self, exc: BrokerError) -> list[bytes]:
        self._sequence += 1
        error = {"type": "error", "code": exc.code or exc.type, "message": exc.message, "param": exc.param,
                 "sequence_number": self._sequence}
        return [b"event: error\ndata: " + jsonio.dumps(error) + b"\n\n"]


def _sequence_of(event: bytes) -> int:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            try:
                value = jsonio.loads(line[5:]).get("sequence_number")
            except (ValueError, RecursionError, AttributeError):
                return -1
            return value if isinstance(value, int) else -1
    return -1
