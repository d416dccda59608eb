"""Bounded polls for state that sends the test no event: another process's, or one behind an HTTP boundary.

Each poll has a deadline and fails with a message that says what never happened, so a broken test fails
in seconds with a reason instead of hanging until pytest's own timeout. Where an event exists, tests
wait on the event instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
Message = str | Callable[[], str]


def _text(message: Message) -> str:
    # A callable message is read only on failure: it may read a log file.
    return message() if callable(message) else message


async def wait_until(predicate: Callable[[], T | Awaitable[T]], timeout_s: float, message: Message, *,
                     interval_s: float = 0.01, ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """Call `predicate` (awaiting its result when that is awaitable) until the result is truthy and
    return it; past `timeout_s` seconds of real time, fail with `message`.

    `interval_s` is the pause between looks; 0 only yields to the loop, for state that tasks on this
    same loop change (no time needs to pass). Exceptions in `ignoring` count as "not yet" (a server
    that does not listen yet).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = None
        with contextlib.suppress(*ignoring):
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            found = result  # only once it is in hand: an awaitable that raised leaves "not yet"
        if found:
            return found  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {_text(message)}")
        await asyncio.sleep(interval_s)


def wait_until_blocking(predicate: Callable[[], T], timeout_s: float, message: Message, *,
                        interval_s: float = 0.05, ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """`wait_until` for synchronous tests and fixtures: blocks the thread between looks."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = None
        with contextlib.suppress(*ignoring):
            found = predicate()
        if found:
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {_text(message)}")
        time.sleep(interval_s)
