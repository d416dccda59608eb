"""In-flight coalescing (singleflight): identical requests that arrive while one is pending share its result.

Only pending calls are shared, never stored: a result or error reaches the callers waiting at that
moment, and the next call after it runs again (caching results is `merge.cache`'s job).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(eq=False, slots=True)
class _Call(Generic[V]):
    task: asyncio.Task[V]
    waiters: int = 0


class SingleFlight(Generic[K, V]):
    """Runs at most one call per key at a time; callers arriving meanwhile wait on the running one.

    A waiter that is cancelled (or times out) leaves without disturbing the others; when the last waiter
    has left, the call itself is cancelled so no work is wasted. The call runs in its own task, which
    inherits the contextvars (log context) of the caller that started it.
    """

    def __init__(self) -> None:
        self._calls: dict[K, _Call[V]] = {}

    async def run(self, key: K, fn: Callable[[], Awaitable[V]]) -> tuple[V, bool]:
        """`fn()`'s value, and whether this caller joined a call already running for `key`."""
        call = self._calls.get(key)
        # A finished task awaiting its clean-up callback must not hand its outcome to a newcomer.
        shared = call is not None and not call.task.done()
        if call is None or not shared:
            call = self._start(key, fn)
        call.waiters += 1
        try:
            # The shield keeps this waiter's cancellation from reaching the shared task.
            return await asyncio.shield(call.task), shared
        finally:
            call.waiters -= 1
            if call.waiters == 0 and not call.task.done():
                # Every waiter was cancelled or timed out: nobody wants the result any more. Forgetting
                # the key now lets a newcomer start afresh instead of joining a call being cancelled.
                self._forget(key, call)
                call.task.cancel()

    def in_flight(self, key: K) -> bool:
        """True while a call for `key` is pending."""
        call = self._calls.get(key)
        return call is not None and not call.task.done()

    def __len__(self) -> int:
        """Pending calls."""
        return len(self._calls)

    def _start(self, key: K, fn: Callable[[], Awaitable[V]]) -> _Call[V]:
        call: _Call[V] = _Call(asyncio.create_task(_invoke(fn)))
        self._calls[key] = call
        # Registered before any waiter's shield, so the entry is gone by the time waiters resume.
        call.task.add_done_callback(partial(self._finished, key, call))
        return call

    def _finished(self, key: K, call: _Call[V], task: asyncio.Task[V]) -> None:
        self._forget(key, call)
        if not task.cancelled():
            # Retrieved here so an error nobody awaited any more is not reported as "never retrieved".
            task.exception()

    def _forget(self, key: K, call: _Call[V]) -> None:
        # A newer call may already own the key; only remove our own entry.
        if self._calls.get(key) is call:
            del self._calls[key]


async def _invoke(fn: Callable[[], Awaitable[V]]) -> V:
    return await fn()
