"""Stopping background loops: a loop whose library swallowed its cancellation still stops, and a loop
that will not stop cannot hang shutdown."""

from __future__ import annotations

import asyncio

from mergebroker.tasks import stop_loops


async def _swallows_one_cancellation(rounds: list[int]) -> None:
    # What a client library does when it catches CancelledError inside a call: the loop goes on.
    swallowed = False
    while True:
        rounds.append(1)
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
            asyncio.current_task().uncancel()  # type: ignore[union-attr]


async def test_a_loop_that_swallowed_its_cancellation_is_cancelled_again_until_it_ends():
    task = asyncio.create_task(_swallows_one_cancellation([]))
    await asyncio.sleep(0)
    stuck = await stop_loops([task], recancel_every_s=0.01, give_up_s=30)
    assert stuck == set() and task.cancelled()


async def test_a_loop_that_finishes_by_itself_within_the_grace_is_not_cancelled():
    done = asyncio.Event()

    async def ends_soon() -> str:
        await done.wait()
        return "finished"

    task = asyncio.create_task(ends_soon())
    asyncio.get_running_loop().call_soon(done.set)
    assert await stop_loops([task], grace_s=30) == set()
    assert task.result() == "finished"


async def test_a_loop_that_never_stops_is_left_behind_after_the_give_up_time():
    release = asyncio.Event()

    async def refuses() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    task = asyncio.create_task(refuses())
    await asyncio.sleep(0)  # inside its loop, where the cancellations reach it
    stuck = await stop_loops([task], recancel_every_s=0.01, give_up_s=0.05)
    assert stuck == {task}
    release.set()
    await task
