"""Injected time: every time-based part takes a `clock` (monotonic seconds) and, where it waits, a `sleep`."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]

monotonic: Clock = time.monotonic
sleep: Sleep = asyncio.sleep


class FakeClock:
    """A manual clock for tests: `advance(dt)` moves time; `sleep(dt)` advances instead of waiting."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)
        await asyncio.sleep(0)


async def sleep_or_event(sleep: Sleep, seconds: float, event: asyncio.Event) -> None:
    """Return after `seconds` on the injected `sleep`, or as soon as `event` is set, whichever comes first."""
    sleeper = asyncio.ensure_future(sleep(seconds))
    waker = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        waker.cancel()
