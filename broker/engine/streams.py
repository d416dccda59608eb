"""One way to hand a stream to a caller, whatever API it speaks: frames out, bookkeeping on every path.

A `HandledStream` reads an upstream's (or a merged member's) SSE events through a `Relay` that turns
them into the caller's API (unchanged for chat and native calls; Responses or Messages events for a
translated one), and on every path (end, error, a caller that left) closes the upstream stream, settles
the rate-limit reservation with the tokens really spent and hands the usage to the request's record.
The HTTP handlers and the library only move frames; none of them repeats this bookkeeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any, Protocol

import structlog

from mergebroker import jsonio
from mergebroker.broker.engine.accounting.request_record import RequestInfo
from mergebroker.broker.engine.limits.ratelimit import Reservation
from mergebroker.errors import BrokerError
from mergebroker.providers.sse import mid_stream_error
from mergebroker.token_usage import TokenUsage

log = structlog.get_logger(__name__)


class Relay(Protocol):
    """Turns one stream's upstream events into the caller's frames.

    `feed` takes one complete SSE event; `finish(usage)` ends a stream that completed (usage: the
    provider's, or None); `fail(exc)` ends one that broke mid-way with the API's own error event;
    `usage` is what the relay read from the events itself (a native stream), else None.
    """

    @property
    def usage(self) -> TokenUsage | None: ...

    def start(self) -> list[bytes]: ...

    def feed(self, event: bytes) -> list[bytes]: ...

    def finish(self, usage: TokenUsage | None) -> list[bytes]: ...

    def fail(self, exc: BrokerError) -> list[bytes]: ...


class PassThrough:
    """A relay that sends each event as it came (chat, and native streams whose usage is read elsewhere)."""

    usage: TokenUsage | None = None

    def start(self) -> list[bytes]:
        return []

    def feed(self, event: bytes) -> list[bytes]:
        if (broken := mid_stream_error(event)) is not None:
            raise broken  # ended with the broker's own error event, and counted as a broken stream
        return [event]

    def finish(self, usage: TokenUsage | None) -> list[bytes]:
        return []

    def fail(self, exc: BrokerError) -> list[bytes]:
        return [b"data: " + jsonio.dumps(exc.body()) + b"\n\n"]


class ChatTranslator(Protocol):
    """Builds another API's events from a chat stream (`ResponsesStream`, `MessagesStream`)."""

    def start(self) -> list[bytes]: ...

    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def finish(self, usage: TokenUsage | None) -> list[bytes]: ...

    def fail(self, status: int, code: str | None, message: str) -> list[bytes]: ...


class TranslatedRelay:
    """A relay of chat chunks through a `ChatTranslator`; `on_finish` runs once the stream completed (the
    Responses API stores the finished response there)."""

    usage: TokenUsage | None = None

    def __init__(self, translator: ChatTranslator, on_finish: Callable[[], None] | None = None) -> None:
        self._translator = translator
        self._on_finish = on_finish

    def start(self) -> list[bytes]:
        return self._translator.start()

    def feed(self, event: bytes) -> list[bytes]:
        if (broken := mid_stream_error(event)) is not None:
            raise broken  # a cut answer must end as a failure in the caller's API, never as a whole one
        chunk = chat_chunk(event)
        return self._translator.feed(chunk) if chunk is not None else []

    def finish(self, usage: TokenUsage | None) -> list[bytes]:
        frames = self._translator.finish(usage)
        if self._on_finish is not None:
            self._on_finish()
        return frames

    def fail(self, exc: BrokerError) -> list[bytes]:
        return self._translator.fail(exc.status, exc.code, exc.message)


class HandledStream:
    """A stream ready to send: `async for frame in stream` yields the caller's frames (see the module)."""

    def __init__(self, info: RequestInfo, chunks: AsyncIterable[bytes], reservation: Reservation, relay: Relay, *,
                 settled_usage: asyncio.Future[Any] | None = None, headers: dict[str, str] | None = None) -> None:
        self._info = info
        self._chunks = chunks
        self._reservation = reservation
        self._relay = relay
        self._settled = settled_usage
        self.headers = {**reservation.headers(), **(headers or {})}
        self._closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[bytes]:
        try:
            for frame in self._relay.start():
                yield frame
            async for event in self._chunks:
                for frame in self._relay.feed(event):
                    yield frame
            await self._close_upstream()  # settles a metered stream's usage before the last frames
            for frame in self._relay.finish(self.usage()):
                yield frame
        except BrokerError as exc:
            for frame in self.interrupt(exc):
                yield frame
        finally:
            await self.aclose()

    def interrupt(self, exc: BrokerError) -> list[bytes]:
        """The frames that end this stream as failed with `exc` (what a mid-stream upstream failure sends, in
        the caller's API); for a stream its writer stops early (the shutdown drain's deadline), and the
        broken-upstream path above. Noted as the request's stream error."""
        self._info.stream_error = exc
        log.warning("stream_failed", status=exc.status, code=exc.code)
        return self._relay.fail(exc)

    def usage(self) -> TokenUsage | None:
        """The stream's usage as known now: the metered stream's settled usage, else what the relay read."""
        settled = self._settled
        if settled is not None and settled.done() and not settled.cancelled() and settled.exception() is None:
            value = settled.result()
            return value if isinstance(value, TokenUsage) else TokenUsage.from_body(value)
        return self._relay.usage

    async def _close_upstream(self) -> None:
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            await aclose()

    async def aclose(self) -> None:
        """End the stream now (a caller that left frees the upstream slot and connection) and settle."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._close_upstream()
        finally:
            usage = self.usage()
            if self._settled is None and usage is not None:
                self._info.usage_settles = _done(usage)
            await self._reservation.settle(usage.total_tokens if usage else self._reservation.tokens)


def _done(usage: TokenUsage) -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(usage)
    return future


def chat_chunk(event: bytes) -> dict[str, Any] | None:
    """The `chat.completion.chunk` one SSE event carries (None: `[DONE]`, comments, or unreadable), for
    the relays that translate chat streams into another API's events."""
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return None
    try:
        chunk = jsonio.loads(data)
    except (ValueError, RecursionError):
        return None
    return chunk if isinstance(chunk, dict) else None
