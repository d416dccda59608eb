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
