"""A streamed answer's usage, for the ledger: the provider's usage chunk, or the broker's own count.

Every upstream stream the broker opens asks for the usage chunk (`stream_options.include_usage`,
`with_usage_requested`) whether or not its caller did, so a streamed request is ledgered with what the
provider counted. `MeteredStream` relays the stream unchanged but for that chunk, which it keeps from a
caller that did not ask for it, and settles `usage` when the stream ends (or is closed): the reported
usage, or, when the provider sent none (it refused `stream_options`, or the stream broke off), the
request's prompt estimate and the tokens of the text relayed, marked `counted`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from mergebroker import jsonio
from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.providers.sse import chat_event
from mergebroker.token_usage import TokenUsage

_USAGE = re.compile(rb'"usage"\s*:\s*\{')  # a chunk that carries usage (every chunk may carry `"usage": null`)


def with_usage_requested(body: Mapping[str, Any]) -> dict[str, Any]:
    """`body` asking the upstream for the usage chunk (its other `stream_options` kept)."""
    options = body.get("stream_options")
    return {**body, "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}


def caller_wants_usage(body: Mapping[str, Any]) -> bool:
    """Whether the caller asked for the usage chunk itself."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def counted_usage(prompt_tokens: int, text: str) -> TokenUsage:
    """Usage the broker counts for an answer the provider reported none for."""
    return TokenUsage(prompt_tokens=prompt_tokens, completion_tokens=count_text_tokens(text), counted=True)


def settle(future: asyncio.Future[Any], usage: Any) -> None:
    """Set `future` to `usage` unless it is already done (safe to call twice, or after cancellation)."""
    if not future.done():
        future.set_result(usage)


class MeteredStream:
    """An upstream chat stream relayed as it comes, its usage settled in `usage` (see the module docstring)."""

    def __init__(self, chunks: AsyncIterator[bytes], *, relay_usage: bool, prompt_tokens: int) -> None:
        self._chunks = chunks
        self._relay_usage = relay_usage
        self._prompt_tokens = prompt_tokens
        self._seen: list[bytes] = []  # read again only if no usage comes: the count needs the text
        self._reported: TokenUsage | None = None
        self.usage: asyncio.Future[TokenUsage] = asyncio.get_running_loop().create_future()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._relay()

    async def _relay(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._chunks:
                if _USAGE.search(chunk) is not None and self._read_usage(chunk):
                    continue
                self._seen.append(chunk)
                yield chunk
        finally:
            self._settle()

    def _read_usage(self, chunk: bytes) -> bool:
        """Note a chunk's usage; True when the chunk is to be left out (a usage chunk the caller did not ask
        for, carrying nothing else)."""
        event = chat_event(chunk)
        if event.usage is None:
            return False
        self._reported = TokenUsage.from_body(event.usage) or self._reported
        return not self._relay_usage and not event.text and event.finish_reason is None and _no_choices(chunk)

    def _settle(self) -> None:
        if self._reported is not None:
            settle(self.usage, self._reported)
        elif not self.usage.done():
            settle(self.usage, counted_usage(self._prompt_tokens, "".join(chat_event(c).text for c in self._seen)))

    async def aclose(self) -> None:
        """Close the upstream stream (a caller that left frees its connection now) and settle the usage."""
        try:
            aclose = getattr(self._chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._settle()


def _no_choices(chunk: bytes) -> bool:
    try:
        data = jsonio.loads(chunk.split(b"data:", 1)[1])
    except (ValueError, IndexError, RecursionError):
        return False
    return isinstance(data, dict) and not data.get("choices")
