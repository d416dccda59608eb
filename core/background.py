"""The one background-task helper: a task kept in its owner's set until it ends, its failure logged."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def spawn(tasks: set[asyncio.Task[Any]], coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
    """Start `coro` as a task held in `tasks` (so it is neither collected nor forgotten at shutdown) until it
    ends; an exception it ends with is logged as `background_task_failed`."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    tasks.add(task)

    def done(t: asyncio.Task[Any]) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("background_task_failed", task=name, error=repr(t.exception()))

    task.add_done_callback(done)
    return task
