"""An upstream stream that holds its upstream's slot (concurrency, in-flight count) until it ends.

The pool hands a stream to its caller once the first chunk arrived; the slot must be given back exactly
once whether the stream ends, breaks, is closed early, or is dropped without closing (a client gone).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable


class HeldStream:
    """A stream that holds its upstream slot until it ends, fails, is closed or is dropped; releases once."""

    def __init__(self, stream: AsyncIterator[bytes], release: Callable[[], None], *,
                 on_broken: Callable[[BaseException], None] | None = None) -> None:
        self._stream = stream
        self._release: Callable[[], None] | None = release
        self._on_broken = on_broken

    def __aiter__(self) -> HeldStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._stream.__anext__()
        except (StopAsyncIteration, asyncio.CancelledError, GeneratorExit):
            self._done()
            raise
        except BaseException as exc:
            self._done()
            if self._on_broken is not None:
                self._on_broken(exc)
            raise

    async def aclose(self) -> None:
        """End the stream early and give its slot back."""
        self._done()
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()

    def _done(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:
        # A caller that drops the stream without closing it (client gone mid-answer) must not leak the slot.
        self._done()
