"""The real clock's deadline (`SystemClock.timeout_at`) keeps `asyncio.timeout`'s rule: the block is cancelled
when the deadline comes and leaves as `TimeoutError`, a cancellation from elsewhere stays a cancellation, and a
block that ended in time is never cancelled afterwards.

Each deadline here has already passed when it is entered (its timer fires on the loop's next turn), or is an
hour away: no test waits on a real interval.
"""

from __future__ import annotations

import asyncio

import pytest

from mergebroker.clock import monotonic

HOUR = 3600.0


async def test_a_passed_deadline_cancels_the_block_and_leaves_as_timeout_error():
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        async with monotonic.timeout_at(monotonic() - 1):
            await never
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # nothing left pending


async def test_a_block_that_ends_in_time_is_not_cancelled_later():
    async with monotonic.timeout_at(monotonic() - 1):
        pass  # ends before the loop's next turn, when the timer would have fired
    for _ in range(3):
        await asyncio.sleep(0)  # a cancellation left armed would land here


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    entered = asyncio.Event()

    async def waiting() -> None:
        async with monotonic.timeout_at(monotonic() + HOUR):
            entered.set()
            await asyncio.get_running_loop().create_future()

    task = asyncio.create_task(waiting())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancellation_landing_with_the_deadline_wins():
    """The caller left as the deadline came: both cancellations reach the task before it runs again, and it
    leaves cancelled, not with a timeout it would answer as a 504."""
    async def waiting() -> None:
        async with monotonic.timeout_at(monotonic() - 1):
            await asyncio.get_running_loop().create_future()

    task = asyncio.create_task(waiting())
    await asyncio.sleep(0)  # the task enters its block; its deadline's timer is due on the loop's next turn
    # The caller's cancellation on a timer due with it: both timers fire in that turn, before the task resumes.
    asyncio.get_running_loop().call_later(0, task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_outer_of_two_deadlines_owns_its_expiry():
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        async with monotonic.timeout_at(monotonic() - 1):
            try:
                async with monotonic.timeout_at(monotonic() + HOUR):
                    await never
            except TimeoutError:
                pytest.fail("the inner deadline had an hour left")


async def test_a_deadline_entered_outside_a_task_is_refused():
    """From a plain loop callback there is no task to cancel: entering says so rather than failing later."""
    refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def enter() -> None:
        try:
            monotonic.timeout_at(monotonic() + HOUR).__aenter__().send(None)
        except BaseException as exc:  # noqa: BLE001 - whatever it raises is the answer
            refused.set_result(exc)

    asyncio.get_running_loop().call_soon(enter)
    error = await refused
    assert isinstance(error, RuntimeError) and "task" in str(error)
