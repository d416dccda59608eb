"""The in-process `JobQueue`: merge windows (`MergeQueue`) and worker tasks that hand groups to the dispatcher.

Workers take released groups by priority and hand each to a dispatch task of its own, so a group waiting
on a hung upstream holds no worker: other groups (other providers, other models) keep being dispatched,
and the per-provider `max_in_flight` (in the pool) is what limits upstream calls. `max_dispatching`
bounds the groups in dispatch at once (memory, not a throughput limit); a worker waits for room there.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import structlog

from mergebroker.broker.engine.chat.dispatch import Dispatcher
from mergebroker.broker.engine.chat.jobs import ChatJob, ChatOutcome
from mergebroker.broker.engine.chat.merge_queue import MergeQueue
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import BrokerError, Overloaded

log = structlog.get_logger(__name__)


class WorkerPool:
    """`size` tasks looping `take -> dispatch`; started and stopped by the app's cleanup context."""

    def __init__(self, queue: MergeQueue[ChatJob], dispatcher: Dispatcher, *, size: int, metrics: Metrics,
                 clock: Clock = monotonic, max_dispatching: int = 4096) -> None:
        self._queue = queue
        self._dispatcher = dispatcher
        self._size = size
        self._metrics = metrics
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatching: set[asyncio.Task[None]] = set()
        self._room = max_dispatching  # groups that may still enter dispatch
        self._room_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
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
            self._observe_wait(group.tier, group.items)
            if self._room > 0:
                self._room -= 1
            else:  # the dispatch that ends next hands its place straight to this worker
                waiter = asyncio.get_running_loop().create_future()
                self._room_waiters.append(waiter)
                await waiter
            self._spawn(group)

    def hand_off(self, pick: Callable[[], Any]) -> bool:
        """Dispatch the best released group at once, from the releasing caller, when there is room.

        The queue calls this instead of waking an idle worker, which would only do the same one loop
        step later: a lone request then skips a task switch. `pick()` pops the group, so the queue's
        priority order still decides. False when there is no room (a worker waiting for room with the group
        it took then goes first) or nothing live to take (wake a worker).
        """
        if self._room <= 0:
            return False
        group = pick()
        if group is None or not group.items:
            return False
        self._observe_wait(group.tier, group.items)
        self._room -= 1
        self._spawn(group)
        return True

    def has_room(self) -> bool:
        """Whether a dispatch could start now (a place in `max_dispatching` is free)."""
        return self._room > 0

    def run_now(self, job: ChatJob) -> Awaitable[None] | None:
        """The run of `job` alone, for its caller's task to await, when there is room in dispatch; else None.

        It takes a place in `max_dispatching` like a spawned group and gives it back when it ends.
        """
        if self._room <= 0:
            return None
        self._room -= 1  # taken now: nothing runs between this and the caller's await
        return self._run_alone(job)

    async def _run_alone(self, job: ChatJob) -> None:
        try:
            self._observe_wait(job.tier, (job,))
            await self._dispatcher.run_alone(job)
            if not job.future.done():  # run_single answers every job; this only guards against a bug
                job.fail(BrokerError("The broker lost track of the request.", status=500, code="dispatch_failed"))
        finally:
            self._free_room()

    def _observe_wait(self, tier: str, jobs: Iterable[ChatJob]) -> None:
        now = self._clock()
        queue_wait = self._queue_wait.get(tier)
        if queue_wait is None:
            queue_wait = self._queue_wait[tier] = self._metrics.queue_wait.labels(tier)
        for job in jobs:
            queue_wait.observe(now - job.enqueued_at)

    def _spawn(self, group: Any) -> None:
        """Dispatch `group` in a task of its own; its place in `max_dispatching` is already taken."""
        task = asyncio.get_running_loop().create_task(self._dispatch(group))
        self._dispatching.add(task)
        task.add_done_callback(self._dispatching.discard)

    async def _dispatch(self, group: Any) -> None:
        try:
            await self._dispatcher.run_group(group)
        except Exception:  # noqa: BLE001 - one bad group must not stop the others
            log.exception("dispatch_group_failed", tier=group.tier, size=len(group.items))
        finally:
            self._free_room()

    def _free_room(self) -> None:
        """A dispatch ended: its place goes to the first worker waiting for room, else back to the pool."""
        while self._room_waiters:
            waiter = self._room_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._room += 1

    def alive(self) -> bool:
        """True while every worker task runs (for /readyz)."""
        return len(self._tasks) == self._size and all(not t.done() for t in self._tasks)

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._dispatching]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class LocalJobQueue:
    """The `JobQueue` of one process (contract in `broker.engine.chat.job_queue.JobQueue`).

    Jobs wait in `merge_queue`'s windows; `size` worker tasks take released groups and dispatch them.
    A cancelled future (every caller gone) makes `MergeQueue` drop its job when the group is taken.
    """

    def __init__(self, merge_queue: MergeQueue[ChatJob], dispatcher: Dispatcher, *, size: int, metrics: Metrics,
                 clock: Clock = monotonic) -> None:
        self.merge_queue = merge_queue
        self._workers = WorkerPool(merge_queue, dispatcher, size=size, metrics=metrics, clock=clock)
        merge_queue.hand_off = self._workers.hand_off

    def submit(self, job: ChatJob) -> asyncio.Future[ChatOutcome]:
        """Place `job` in its tier's window; raises `Overloaded` past the tier's hard cap."""
        self.merge_queue.submit(job)
        return job.future

    def extend(self, job: ChatJob, deadline: float) -> bool:
        """Extend a job still waiting in this process's queue."""
        return job.extend_deadline(deadline)

    def run_now(self, job: ChatJob) -> Awaitable[None] | None:
        """A job that does not wait in a window (it cannot merge, or its adaptive window expects no partner)
        runs in its caller's task while no released group waits for a worker and dispatch has room.

        Queueing it would only hand it to a dispatch task one loop step later, through the windows and
        the planner, for the same lone call. When groups wait, it queues behind them in priority order.
        """
        queue = self.merge_queue
        if job.stream or job.before_send is not None or not queue.idle() or not self._workers.has_room():
            return None
        # Asked last: a job it lets go alone is recorded as having arrived, and then it must be run here.
        return self._workers.run_now(job) if queue.take_alone(job) else None

    def depth(self, tier: str) -> int:
        """Jobs of `tier` not yet taken by a worker."""
        return self.merge_queue.depth(tier)

    def start(self) -> None:
        """Start the worker tasks."""
        self._workers.start()

    async def stop(self) -> None:
        """Refuse new jobs, answer the waiting ones with `Overloaded`, stop the workers."""
        for job in self.merge_queue.close():
            job.fail(Overloaded("The broker is shutting down.", retry_after=1))
        await self._workers.stop()

    def alive(self) -> bool:
        """True while every worker task runs."""
        return self._workers.alive()
