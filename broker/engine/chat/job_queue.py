"""The queue as the HTTP side sees it: hand over a job, await its outcome (`JobQueue`), and a fake of it.

`ChatService` depends on this seam only. The in-process implementation is `broker.engine.chat.workers.LocalJobQueue`
(merge windows in `broker.engine.chat.merge_queue.MergeQueue`, worker tasks running `broker.engine.chat.dispatch.Dispatcher`); a
cluster-wide one can sit behind the same calls. `FakeJobQueue` records jobs and lets a unit test
answer them by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from mergebroker.broker.engine.chat.jobs import ChatJob, ChatOutcome
from mergebroker.errors import BrokerError, Overloaded


class JobQueue(Protocol):
    """Where admitted chat jobs wait for a merge window and a worker, and whence their outcome comes.

    Contract:
    - `submit(job)` accepts the job or raises `Overloaded` at once (tier full, shutting down). It returns
      the future the caller awaits; the queue completes it exactly once, with a `ChatOutcome` or a
      `BrokerError`, and only for live callers (see the next point).
    - Cancelling that future says that nobody waits any more: a job not yet sent upstream is dropped
      (sending it anyway is allowed, only wasteful). The queue never cancels it itself.
    - `extend(job, deadline)` asks that a job not yet sent run until the later `deadline` (a coalesced
      follower's); False when that is no longer possible (already sent, or the queue cannot), and the
      job then runs on the deadline it had.
    - `run_now(job)`: the run of a job that cannot merge, for its caller to await in its own task (the
      job's future is answered when it ends, as if a worker had sent it), or None when the job must be
      submitted. A queue offers it only when nothing else waits for a worker, so no priority is jumped.
    - `depth(tier)`: the tier's jobs accepted and not yet taken by a worker (metrics, /stats).
    - `start()` begins serving; `stop()` refuses new jobs, answers every job still waiting with
      `Overloaded`, and stops the workers. `alive()` is True while it can serve (readiness).
    """

    def submit(self, job: ChatJob) -> asyncio.Future[ChatOutcome]: ...

    def extend(self, job: ChatJob, deadline: float) -> bool: ...

    def run_now(self, job: ChatJob) -> Awaitable[None] | None: ...

    def depth(self, tier: str) -> int: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def alive(self) -> bool: ...


class FakeJobQueue:
    """A `JobQueue` for unit tests: keeps submitted jobs in `jobs` and deadline requests in `extensions`;
    the test answers jobs with `answer`/`fail` and awaits arrivals with `wait_until` (no sleeps).

    `capacity` (per tier) makes `submit` refuse with `Overloaded` the way a full tier does.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.jobs: list[ChatJob] = []
        self.extensions: list[tuple[ChatJob, float]] = []
        self.capacity = capacity
        self._changed = asyncio.Event()
        self._running = False

    def submit(self, job: ChatJob) -> asyncio.Future[ChatOutcome]:
        if self.capacity is not None and self.depth(job.tier) >= self.capacity:
            raise Overloaded(f"Tier '{job.tier}' queue is full; retry later.", retry_after=1, code="queue_full")
        self.jobs.append(job)
        self._changed.set()
        return job.future

    def extend(self, job: ChatJob, deadline: float) -> bool:
        self.extensions.append((job, deadline))
        self._changed.set()
        return job.extend_deadline(deadline)

    def run_now(self, job: ChatJob) -> None:
        return None  # every job is submitted, for the test to answer

    def depth(self, tier: str) -> int:
        return sum(1 for j in self.jobs if j.tier == tier and not j.future.done())

    def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        self._running = False
        for job in self.jobs:
            job.fail(Overloaded("The broker is shutting down.", retry_after=1))

    def alive(self) -> bool:
        return self._running

    def answer(self, job: ChatJob, outcome: ChatOutcome) -> None:
        """Answer `job` as a worker would (ignored when its caller has left)."""
        job.mark_sent()
        job.resolve(outcome)

    def fail(self, job: ChatJob, exc: BrokerError) -> None:
        """Fail `job` as a worker would."""
        job.mark_sent()
        job.fail(exc)

    async def wait_until(self, condition: Callable[[], object]) -> None:
        """Return once `condition()` is true, re-checking whenever a job or an extension arrives."""
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    async def wait_for(self, count: int) -> list[ChatJob]:
        """The submitted jobs, once there are at least `count`."""
        await self.wait_until(lambda: len(self.jobs) >= count)
        return self.jobs
