"""A stream attempt that counts as answered once its first chunk arrives (failover happens before it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from mergebroker.errors import UpstreamBadResponse
from mergebroker.providers.upstream import Upstream


def first_chunk_opener(open_stream: Callable[[Upstream, float], AsyncIterator[bytes]]
                       ) -> Callable[[Upstream, float], Awaitable[AsyncIterator[bytes]]]:
    """An attempt that succeeds once the upstream sent its first chunk, returning the rest as an iterator."""

    async def attempt(u: Upstream, timeout: float) -> AsyncIterator[bytes]:
        stream = open_stream(u, timeout)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise UpstreamBadResponse("upstream ended the stream before its first chunk") from None
        return _Opened(first, stream)

    return attempt


class _Opened:
    """A stream whose first chunk has arrived: that chunk, then the rest. `whole_reply` is the provider's
    (`providers.whole_reply.ProviderStream`): the reply, when the upstream answered whole."""

    def __init__(self, first: bytes, rest: AsyncIterator[bytes]) -> None:
        self._first: bytes | None = first
        self._rest = rest
        self.whole_reply: dict[str, Any] | None = getattr(rest, "whole_reply", None)

    def __aiter__(self) -> _Opened:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            return await self._rest.__anext__()
        except BaseException:  # ended or broken: its upstream connection is freed now, not at garbage collection
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """End the stream early; its upstream connection is freed now."""
        self._first = None
        aclose = getattr(self._rest, "aclose", None)
        if aclose is not None:
            await aclose()
