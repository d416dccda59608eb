"""Stopping background loops whose libraries may swallow a cancellation.

A loop cancelled while inside a client library's call (redis-py's connection handling, for one) can
see that library catch the `CancelledError`, so the loop goes round again as if nothing happened and
whoever awaits it waits forever. `stop_loops` cancels again until each loop has ended, and gives up
(leaving the loop behind, never hanging shutdown) after `give_up_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

RECANCEL_EVERY_S = 0.25


async def stop_loops(tasks: Collection[asyncio.Task[Any]], *, grace_s: float = 0.0, give_up_s: float = 5.0,
                     recancel_every_s: float = RECANCEL_EVERY_S) -> set[asyncio.Task[Any]]:
    """Let `tasks` end by themselves within `grace_s`, then cancel them until they end; the ones still
    running after `give_up_s` more are returned (the caller may log them)."""
    pending = {t for t in tasks if not t.done()}
    if pending and grace_s > 0:
        _done, pending = await asyncio.wait(pending, timeout=grace_s)
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + give_up_s
    while pending:
        for task in pending:
            task.cancel()
        left = give_up_at - loop.time()
        if left <= 0:
            break
        _done, pending = await asyncio.wait(pending, timeout=min(recancel_every_s, left))
    for task in tasks:  # retrieve outcomes so none is reported as never retrieved
        if task.done() and not task.cancelled():
            task.exception()
    return pending
