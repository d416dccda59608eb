"""A bounded shutdown drain: requests in flight get `drain_timeout_s` to finish, then a 503 envelope.

aiohttp stops accepting, then waits for running handlers (up to its own shutdown timeout) and cancels
what is left, which closes those connections without an answer. With a hung upstream that wait was the
whole read timeout. Here every handler registers while it runs (`enter` .. `leave`); at shutdown (`drain`, an
`on_shutdown` hook) they get `drain_timeout_s` to finish, and those still running are cancelled with
the drain marked expired, which the middleware turns into one 503 `shutting_down` answer each.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from aiohttp import web

from mergebroker.errors import Overloaded

log = structlog.get_logger(__name__)


class Drain:
    """The handlers in flight, and whether the shutdown drain ran out of time."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._running: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.expired = False

    def enter(self) -> asyncio.Task[Any] | None:
        """Register the current handler task until `leave(task)` (what it returns); plain calls rather than a
        generator-based context manager, as they run around every request."""
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
            self._idle.clear()
        return task

    def leave(self, task: asyncio.Task[Any] | None) -> None:
        """The handler task `enter` registered has finished."""
        if task is not None:
            self._running.discard(task)
            if not self._running:
                self._idle.set()

    async def drain(self, _app: web.Application | None = None) -> None:
        """Wait up to the timeout for the handlers in flight; cancel the rest (they answer 503)."""
        try:
            await asyncio.wait_for(self._idle.wait(), self._timeout_s)
        except TimeoutError:
            self.expired = True
            log.warning("drain_timeout", in_flight=len(self._running), timeout_s=self._timeout_s)
            for task in list(self._running):
                task.cancel()

    def refusal(self) -> Overloaded:
        """What a request cut off by the drain is answered."""
        return Overloaded("The broker is shutting down; retry on another replica.", code="shutting_down",
                          retry_after=1)


DRAIN = web.AppKey("drain", Drain)
