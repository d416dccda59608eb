"""Queue workers: take released groups by priority and hand them to the dispatcher.

The worker count bounds how many groups are dispatched at once; it is the only limit enforced here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from mergebroker.clock import Clock, monotonic
from mergebroker.broker.dispatch import Dispatcher
from mergebroker.broker.jobs import ChatJob
from mergebroker.broker.metrics import Metrics
from mergebroker.broker.queue import MergeQueue

log = structlog.get_logger(__name__)


class WorkerPool:
    """`size` tasks looping `take -> dispatch`; started and stopped by the app's cleanup context."""

    def __init__(self, queue: MergeQueue[ChatJob], dispatcher: Dispatcher, *, size: int, metrics: Metrics,
                 clock: Clock = monotonic) -> None:
        self._queue = queue
        self._dispatcher = dispatcher
        self._size = size
        self._metrics = metrics
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()
        self._queue_wait: dict[str, Any] = {}  # labelled histogram children by tier, looked up once

    def start(self) -> None:
        for n in range(self._size):
            task = asyncio.get_running_loop().create_task(self._run(), name=f"mergebroker-worker-{n}")
            self._tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("worker_crashed", error=repr(task.exception()))

    async def _run(self) -> None:
        while True:
            group = await self._queue.take()
            now = self._clock()
            queue_wait = self._queue_wait.get(group.tier)
            if queue_wait is None:
                queue_wait = self._queue_wait[group.tier] = self._metrics.queue_wait.labels(group.tier)
            for job in group.items:
                queue_wait.observe(now - job.enqueued_at)
            try:
                await self._dispatcher.run_group(group)
            except Exception:  # noqa: BLE001 - one bad group must not stop the worker
                log.exception("dispatch_group_failed", tier=group.tier, size=len(group.items))

    def alive(self) -> bool:
        """True while every worker task runs (for /readyz)."""
        return len(self._tasks) == self._size and all(not t.done() for t in self._tasks)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
