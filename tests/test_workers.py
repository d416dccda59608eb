"""A group waiting on a hung upstream holds no worker: with a single worker, the next group is still dispatched."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from mergebroker.broker.metrics import Metrics
from mergebroker.broker.workers import WorkerPool


class _Groups:
    """Stands in for MergeQueue.take(): hands out the groups put in, in order."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, name: str) -> None:
        self._queue.put_nowait(SimpleNamespace(tier="t", items=[SimpleNamespace(enqueued_at=0.0)], name=name))

    async def take(self) -> Any:
        return await self._queue.get()


class _Dispatcher:
    """Hangs on the group named "hung"; records the others as dispatched."""

    def __init__(self) -> None:
        self.done: asyncio.Queue[str] = asyncio.Queue()
        self.hung = asyncio.Event()

    async def run_group(self, group: Any) -> None:
        if group.name == "hung":
            self.hung.set()
            await asyncio.Event().wait()  # an upstream that never answers
        await self.done.put(group.name)


async def test_a_hung_group_does_not_hold_the_only_worker():
    groups, dispatcher = _Groups(), _Dispatcher()
    pool = WorkerPool(groups, dispatcher, size=1, metrics=Metrics(), clock=lambda: 0.0)  # type: ignore[arg-type]
    pool.start()
    try:
        groups.put("hung")
        await asyncio.wait_for(dispatcher.hung.wait(), 5)
        groups.put("next")
        assert await asyncio.wait_for(dispatcher.done.get(), 5) == "next"
        assert pool.alive()
    finally:
        await pool.stop()
