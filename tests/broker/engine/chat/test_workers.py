"""A group waiting on a hung upstream holds no worker: with a single worker, the next group is still dispatched."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from mergebroker.broker.engine.chat.workers import WorkerPool
from mergebroker.broker.engine.ground.metrics import Metrics


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


class _Item:
    """What a MergeQueue needs of a request: a tier, no merge key (released at once), a future, a name."""

    def __init__(self, name: str) -> None:
        self.tier, self.merge_key, self.name, self.enqueued_at = "t", None, name, 0.0
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class _ByItem:
    """Records each released group's one request by name; "slow" waits until `finish` is set."""

    def __init__(self) -> None:
        self.done: asyncio.Queue[str] = asyncio.Queue()
        self.slow, self.finish = asyncio.Event(), asyncio.Event()

    async def run_group(self, group: Any) -> None:
        name = group.items[0].name
        if name == "slow":
            self.slow.set()
            await self.finish.wait()
        await self.done.put(name)


async def test_released_requests_are_dispatched_in_order_within_max_dispatching():
    from mergebroker.broker.engine.chat.merge_queue import MergeQueue, TierWindow

    queue: MergeQueue[Any] = MergeQueue([TierWindow("t", 50, 0.0, 1, 100, 200)], clock=lambda: 0.0)  # type: ignore
    dispatcher = _ByItem()
    pool = WorkerPool(queue, dispatcher, size=2, metrics=Metrics(), clock=lambda: 0.0,  # type: ignore[arg-type]
                      max_dispatching=1)
    queue.hand_off = pool.hand_off
    pool.start()
    try:
        await asyncio.sleep(0)  # the workers wait for work: the first release is handed off at once
        queue.submit(_Item("slow"))
        await asyncio.wait_for(dispatcher.slow.wait(), 5)
        queue.submit(_Item("second"))
        queue.submit(_Item("third"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert dispatcher.done.empty()  # one group in dispatch at most: the others wait for room
        dispatcher.finish.set()
        assert [await asyncio.wait_for(dispatcher.done.get(), 5) for _ in range(3)] == ["slow", "second", "third"]
        queue.submit(_Item("later"))  # room again, workers idle: dispatched straight away
        assert await asyncio.wait_for(dispatcher.done.get(), 5) == "later"
        assert pool.alive()
    finally:
        await pool.stop()
