"""The shutdown drain: stop taking work, let what is in flight finish, cut what outlives the deadline cleanly.

`begin(reason)` (the first SIGTERM/SIGINT, `POST /v1/broker/drain`, or aiohttp's `on_shutdown` for a
runner that is simply cleaned up) turns the broker to *draining* while it still listens: /readyz answers
503 with the reason, new API requests are refused with a 503 `shutting_down` (`refusal`), and the handlers
in flight, streams included, keep running. The drain ends as soon as none is left (`drained`), or at
`drain_timeout_s` (or a second signal: `expire`), when the handlers still running are cancelled: the
middleware answers a request not yet answered with the 503, and a stream already open ends with its API's
error event (`api_routes.send_stream`), so no client sees a cut connection. Only then does the server stop
listening.

Every handler registers while it runs (`enter` .. `leave`); the operator's routes do not (the middleware
leaves them out), so a preStop hook waiting on `POST /v1/broker/drain` never waits for itself.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from mergebroker.clock import Clock, Timer, monotonic
from mergebroker.errors import Overloaded

log = structlog.get_logger(__name__)

SETTLE_S = 5.0
"""How long the handlers cut at the deadline get to write their 503 or final error event."""

DrainListener = Callable[[str, int], None]
"""Told `(outcome, count)`: `refused` for each request turned away while draining, `cut` for those cancelled."""


@dataclass(frozen=True)
class DrainResult:
    """How a wait on the drain ended: whether nothing was left in flight, and how much was."""

    drained: bool
    in_flight: int


class Drain:
    """The handlers in flight, and the drain's state: idle, draining, then ended (drained or expired)."""

    def __init__(self, timeout_s: float, *, clock: Clock = monotonic) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._running: set[asyncio.Task[Any]] = set()
        self._settled: asyncio.Event | None = None  # set when the last handler cut at the deadline has left
        self._ended = asyncio.Event()
        self._reason: str | None = None
        self._started_at = 0.0
        self._deadline: Timer | None = None
        self._listener: DrainListener | None = None
        self.expired = False
        """The deadline came with handlers still running: they were cancelled, and answer 503."""

    @property
    def draining(self) -> bool:
        """Whether the drain has begun (new API requests are refused from then on)."""
        return self._reason is not None

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def status(self) -> str | None:
        """What /readyz says while draining (None before)."""
        if self._reason is None:
            return None
        return f"draining: {self._reason}, {len(self._running)} requests in flight"

    def observe(self, listener: DrainListener) -> None:
        """Report refused and cut requests to `listener` from now on (the metrics, once they exist)."""
        self._listener = listener

    def enter(self, task: asyncio.Task[Any]) -> None:
        """Register a handler's task until `leave(task)`; plain calls rather than a generator-based context
        manager, as they run around every request."""
        self._running.add(task)

    def leave(self, task: asyncio.Task[Any]) -> None:
        """The handler task `enter` registered has finished."""
        running = self._running
        running.discard(task)
        if not running and self._reason is not None:  # the last one out of a drain ends it
            if self._settled is not None:
                self._settled.set()
            self._end()

    def begin(self, reason: str) -> None:
        """Start draining (harmless once begun: the first reason stays); ends at once when nothing runs."""
        if self._reason is not None:
            return
        self._reason = reason
        self._started_at = now = self._clock()
        _unbound(log.info, "drain_started", reason=reason, in_flight=len(self._running), timeout_s=self._timeout_s)
        if not self._running:
            self._end()
        else:
            self._deadline = self._clock.call_at(now + self._timeout_s, self.expire)

    def expire(self) -> None:
        """End the drain now (its deadline, or a second signal): cancel the handlers still running."""
        if self._ended.is_set():
            return
        if self._reason is None:
            self.begin("forced")
            if self._ended.is_set():
                return
        self.expired = True
        cut = list(self._running)
        for task in cut:
            task.cancel()
        self._end(cut=len(cut))

    def refused(self) -> None:
        """A new request was turned away while draining (counted)."""
        if self._listener is not None:
            self._listener("refused", 1)

    def _end(self, *, cut: int = 0) -> None:
        if self._ended.is_set():
            return
        self._ended.set()
        if self._deadline is not None:
            self._deadline.cancel()
        _unbound(log.info, "drain_ended", outcome="expired" if self.expired else "drained", cut=cut,
                 waited_s=round(self._clock() - self._started_at, 3))
        if cut and self._listener is not None:
            self._listener("cut", cut)

    async def wait(self, timeout_s: float | None = None) -> DrainResult:
        """Wait until the drain has ended, or `timeout_s` passed (the drain goes on); where it stands."""
        if timeout_s is None:
            await self._ended.wait()
        else:
            try:
                async with self._clock.timeout_at(self._clock() + timeout_s):
                    await self._ended.wait()
            except TimeoutError:
                pass
        return DrainResult(drained=self._ended.is_set() and not self.expired, in_flight=len(self._running))

    async def drain(self, _app: web.Application | None = None) -> DrainResult:
        """Drain to the end (an `on_shutdown` hook, and `serve`): begin, wait, then give the handlers cut at
        the deadline up to `SETTLE_S` to send their last answer."""
        self.begin("shutting down")
        result = await self.wait()
        if self.expired and self._running:
            self._settled = asyncio.Event()  # `leave` sets it as the last one goes
            try:
                async with self._clock.timeout_at(self._clock() + SETTLE_S):
                    await self._settled.wait()
            except TimeoutError:
                log.warning("drain_unsettled", in_flight=len(self._running))
        return result

    def refusal(self) -> Overloaded:
        """What a request refused or cut off by the drain is answered."""
        return Overloaded("The broker is shutting down; retry on another replica.", code="shutting_down",
                          retry_after=1)


def _unbound(emit: Callable[..., Any], event: str, **fields: Any) -> None:
    """Log outside the current request's bound context: the drain is the process's, not the request's that
    happened to begin or end it."""
    contextvars.Context().run(emit, event, **fields)


DRAIN = web.AppKey("drain", Drain)
