"""The serving event loop: uvloop where it is installed, the standard asyncio loop otherwise.

uvloop runs the same aiohttp code with less CPU per request (it measured faster on the passthrough
path), and nothing in the broker depends on which loop runs it, so `auto` takes it when it can.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import structlog

log = structlog.get_logger(__name__)

LoopChoice = Literal["auto", "uvloop", "asyncio"]


def new_event_loop(choice: LoopChoice = "auto") -> asyncio.AbstractEventLoop:
    """A new loop of the chosen kind; `auto` falls back to asyncio when uvloop cannot be imported.

    Asking for `uvloop` explicitly when it is missing is a configuration error (ImportError).
    """
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise
            log.info("event_loop", kind="asyncio", reason="uvloop_not_installed")
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    """`uvloop` or `asyncio`: which kind `loop` is (for the start-up log)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
