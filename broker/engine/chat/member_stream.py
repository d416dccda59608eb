"""One streamed member of a merged call: its own SSE stream of its own block.

The dispatcher feeds a `MemberStream` while the merged reply streams (`release` text that passed the
leak checks, then `finish`); the HTTP handler iterates it and gets ready-to-send SSE events in OpenAI's
`chat.completion.chunk` shape, with an ID of the member's own. Nothing is sent before the first text, so
a member whose block fails before any of its text was released can `switch_to` a stream of its own
(re-sent alone) and the client sees one ordinary stream, with no seam. A member whose block broke off
after some of its text was sent `resume_with` a stream of its own: its text is relayed from where the
member's left off (the part already sent is skipped), so the client still sees one stream; should the
new answer not begin with what was sent, the stream ends there with `length` (the text sent cannot be
taken back). `end_filtered` ends a stream whose block turned out to leak another member's text with
`finish_reason: "content_filter"`; `fail` ends it with one SSE error event.

Every method is safe to call after the stream ended (the first ending wins), and from the loop only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from mergebroker import jsonio
from mergebroker.errors import BrokerError
from mergebroker.providers.sse import chat_event
from mergebroker.token_usage import TokenUsage

_DONE = b"data: [DONE]\n\n"


class MemberStream:
    """A merged member's stream (see the module docstring); iterate it for SSE event bytes."""

    def __init__(self, *, model: str, include_usage: bool) -> None:
        self._items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._id = "chatcmpl-" + uuid.uuid4().hex[:24]
        self._model = model
        self._created = int(time.time())
        self._include_usage = include_usage
        self.sent_text = False  # some of the member's text has been released to it
        self.ended = False
        self._released: list[str] = []
        self._relayed: AsyncIterable[bytes] | None = None

    @property
    def released(self) -> str:
        """The text released to the member so far."""
        return "".join(self._released)

    def release(self, text: str) -> None:
        """Send `text` (already checked) to the member."""
        if text and not self.ended:
            self.sent_text = True
            self._released.append(text)
            self._items.put_nowait(("text", text))

    def finish(self, finish_reason: str, usage: TokenUsage | None = None) -> None:
        """End the stream normally (`stop`, `length`) or filtered (`content_filter`)."""
        self._end("finish", (finish_reason, usage))

    def end_filtered(self) -> None:
        """End the stream because its block leaked another member's text."""
        self.finish("content_filter")

    def fail(self, exc: BrokerError) -> None:
        """End the stream with one SSE error event."""
        self._end("error", exc)

    def switch_to(self, chunks: AsyncIterable[bytes]) -> None:
        """Relay `chunks` (the member's own upstream stream) instead; only before any text was sent."""
        if self.sent_text:
            raise RuntimeError("switch_to after text was sent")
        self._relayed = chunks
        self._end("relay", chunks)

    def resume_with(self, chunks: AsyncIterable[bytes]) -> None:
        """Continue from `chunks` (the member's own upstream stream, asked for its usage chunk), skipping
        the text already sent; for a member whose block broke off after some of its text was sent."""
        self._relayed = chunks
        self._end("resume", chunks)

    def _end(self, kind: str, value: Any) -> None:
        if not self.ended:
            self.ended = True
            self._items.put_nowait((kind, value))

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._events()

    async def _events(self) -> AsyncIterator[bytes]:
        started = False
        while True:
            kind, value = await self._items.get()
            if kind == "relay":
                async for chunk in value:
                    yield chunk
                return
            if kind == "resume":
                async for event in self._resumed(value):
                    yield event
                return
            if not started and kind in ("text", "finish"):
                started = True
                yield self._chunk({"role": "assistant", "content": ""})
            if kind == "text":
                yield self._chunk({"content": value})
            elif kind == "finish":
                finish_reason, usage = value
                yield self._chunk({}, finish_reason)
                if self._include_usage and usage is not None:
                    yield self._event({"choices": [], "usage": usage.as_body()})
                yield _DONE
                return
            else:
                yield b"data: " + jsonio.dumps(value.body()) + b"\n\n"
                return

    async def _resumed(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """The member's own answer from where its merged block left off (see the module docstring)."""
        sent, seen, finish_reason, usage = self.released, "", None, None
        async for chunk in chunks:
            event = chat_event(chunk)
            usage = TokenUsage.from_body(event.usage) or usage
            finish_reason = event.finish_reason or finish_reason
            if not event.text:
                continue
            before, seen = seen, seen + event.text
            if len(seen) <= len(sent):
                if not sent.startswith(seen):
                    finish_reason = "length"  # another answer than the one begun: end where the sent text ends
                    break
            elif not seen.startswith(sent):
                finish_reason = "length"
                break
            else:
                yield self._chunk({"content": seen[max(len(sent), len(before)):]})
        yield self._chunk({}, finish_reason or "stop")
        if self._include_usage and usage is not None:
            yield self._event({"choices": [], "usage": usage.as_body()})
        yield _DONE

    async def aclose(self) -> None:
        """Stop: a relayed stream of its own is closed (the merged call belongs to the dispatcher)."""
        self.ended = True
        aclose = getattr(self._relayed, "aclose", None)
        if aclose is not None:
            await aclose()

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return self._event({"choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]})

    def _event(self, fields: dict[str, Any]) -> bytes:
        chunk = {"id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
                 **fields}
        return b"data: " + jsonio.dumps(chunk) + b"\n\n"
