"""In-flight coalescing (singleflight): identical requests that arrive while one is pending share its result.

Only pending calls are shared, never stored: a result or error reaches the callers waiting at that
moment, and the next call after it runs again (caching results is `merge.cache`'s job).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(eq=False, slots=True)
class _Call(Generic[V]):
    future: asyncio.Future[V]
    waiters: int = 0


@dataclass(frozen=True, slots=True)
class Lead(Generic[V]):
    """A call its first caller runs in its own task: `run` answers `future`; should that caller leave
    (cancelled) while others wait on the call, `hand_over()` must get `future` answered some other way."""

    future: asyncio.Future[V]
    run: Awaitable[None]
    hand_over: Callable[[], None]


class SingleFlight(Generic[K, V]):
    """Runs at most one call per key at a time; callers arriving meanwhile wait on the running one.

    A waiter that is cancelled (or times out) leaves without disturbing the others; when the last waiter
    has left, the call itself is cancelled so no work is wasted. `run` runs the call in its own task,
    which inherits the contextvars (log context) of the caller that started it; `join` shares a call
    that is already a future (work some other task will finish), with no task of its own.
    """

    def __init__(self) -> None:
        self._calls: dict[K, _Call[V]] = {}

    async def run(self, key: K, fn: Callable[[], Awaitable[V]]) -> tuple[V, bool]:
        """`fn()`'s value, and whether this caller joined a call already running for `key`."""
        return await self.join(key, lambda: asyncio.ensure_future(fn()))

    async def join(self, key: K, start: Callable[[], asyncio.Future[V] | Lead[V]]) -> tuple[V, bool]:
        """The result of the pending future for `key`, or of `start()` when none is pending; and whether shared.

        `start()` returns a future that someone else completes (e.g. a queued job's), or a `Lead`: a call
        this caller runs in its own task, which callers arriving meanwhile share like any other. It is
        called only when no call for `key` is pending, and an exception it raises reaches this caller alone.
        The last waiter to leave before the future is done cancels it.
        """
        call = self._calls.get(key)
        # A finished call awaiting its clean-up callback must not hand its outcome to a newcomer.
        shared = call is not None and not call.future.done()
        if call is None or not shared:
            started = start()
            if isinstance(started, Lead):
                return await self._lead(key, started), False
            call = self._start(key, started)
        call.waiters += 1
        try:
            # The shield keeps this waiter's cancellation from reaching the shared call.
            return await asyncio.shield(call.future), shared
        finally:
            call.waiters -= 1
            if call.waiters == 0 and not call.future.done():
                # Every waiter was cancelled or timed out: nobody wants the result any more. Forgetting
                # the key now lets a newcomer start afresh instead of joining a call being cancelled.
                self._forget(key, call)
                call.future.cancel()

    async def _lead(self, key: K, lead: Lead[V]) -> V:
        """Run `lead` in this task as the call for `key`; its result, or its error."""
        call = self._start(key, lead.future)
        call.waiters += 1
        try:
            await lead.run
        except BaseException:
            if call.waiters > 1 and not call.future.done():
                # This caller left (or failed) mid-call while others wait: the call cannot go on in a task
                # being cancelled, so it is handed over, and they are answered all the same.
                lead.hand_over()
            raise
        finally:
            call.waiters -= 1
            if call.waiters == 0 and not call.future.done():
                self._forget(key, call)
                call.future.cancel()
        return call.future.result()

    def in_flight(self, key: K) -> bool:
        """True while a call for `key` is pending."""
        call = self._calls.get(key)
        return call is not None and not call.future.done()

    def __len__(self) -> int:
        """Pending calls."""
        return len(self._calls)

    def _start(self, key: K, future: asyncio.Future[V]) -> _Call[V]:
        call: _Call[V] = _Call(future)
        self._calls[key] = call
        # Registered before any waiter's shield, so the entry is gone by the time waiters resume.
        future.add_done_callback(partial(self._finished, key, call))
        return call

    def _finished(self, key: K, call: _Call[V], future: asyncio.Future[V]) -> None:
        self._forget(key, call)
        if not future.cancelled():
            # Retrieved here so an error nobody awaited any more is not reported as "never retrieved".
            future.exception()

    def _forget(self, key: K, call: _Call[V]) -> None:
        # A newer call may already own the key; only remove our own entry.
        if self._calls.get(key) is call:
            del self._calls[key]
