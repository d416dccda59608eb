"""SingleFlight shares one pending call among identical callers, stores no outcome, and cancels only unwanted work."""

from __future__ import annotations

import asyncio
import gc

import pytest

from mergebroker.merge.coalesce import SingleFlight


class Gated:
    """An upstream stand-in that counts calls and blocks until released."""

    def __init__(self, value: str = "answer", error: Exception | None = None) -> None:
        self.calls = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.value = value
        self.error = error

    async def __call__(self) -> str:
        self.calls += 1
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if self.error is not None:
            raise self.error
        return self.value


async def test_fifty_concurrent_identical_calls_run_fn_once_and_all_get_its_value() -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    fn = Gated()
    waiters = [asyncio.create_task(sf.run("k", fn)) for _ in range(50)]
    await fn.started.wait()
    assert sf.in_flight("k") and len(sf) == 1
    fn.release.set()
    results = await asyncio.gather(*waiters)
    assert fn.calls == 1
    assert all(value == "answer" for value, _ in results)
    assert sum(1 for _, shared in results if not shared) == 1
    assert len(sf) == 0 and not sf.in_flight("k")


async def test_different_keys_run_separately() -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    a, b = Gated("a"), Gated("b")
    ta, tb = asyncio.create_task(sf.run("a", a)), asyncio.create_task(sf.run("b", b))
    await a.started.wait()
    await b.started.wait()
    assert len(sf) == 2
    a.release.set()
    b.release.set()
    assert await ta == ("a", False) and await tb == ("b", False)


async def test_error_reaches_every_waiter_and_is_not_stored() -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    failing = Gated(error=RuntimeError("upstream down"))
    waiters = [asyncio.create_task(sf.run("k", failing)) for _ in range(5)]
    await failing.started.wait()
    failing.release.set()
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(o, RuntimeError) and str(o) == "upstream down" for o in outcomes)
    assert len(sf) == 0

    healthy = Gated("fresh")
    healthy.release.set()
    assert await sf.run("k", healthy) == ("fresh", False)
    assert failing.calls == 1 and healthy.calls == 1


async def test_one_cancelled_waiter_does_not_cancel_the_call_for_the_others() -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    fn = Gated()
    first = asyncio.create_task(sf.run("k", fn))
    leaver = asyncio.create_task(sf.run("k", fn))
    await fn.started.wait()
    leaver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaver
    assert sf.in_flight("k") and not fn.cancelled.is_set()
    fn.release.set()
    assert await first == ("answer", False)
    assert len(sf) == 0


async def test_a_waiter_timing_out_leaves_the_call_running_for_the_others() -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    fn = Gated()
    patient = asyncio.create_task(sf.run("k", fn))
    await fn.started.wait()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sf.run("k", fn), 0.01)
    assert sf.in_flight("k") and not fn.cancelled.is_set()
    fn.release.set()
    assert await patient == ("answer", False)
    assert fn.calls == 1 and len(sf) == 0


async def test_when_every_waiter_is_cancelled_the_underlying_call_is_cancelled() -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    fn = Gated()
    waiters = [asyncio.create_task(sf.run("k", fn)) for _ in range(3)]
    await fn.started.wait()
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    await asyncio.wait_for(fn.cancelled.wait(), 1)
    assert len(sf) == 0 and not sf.in_flight("k")


async def test_a_caller_arriving_while_an_abandoned_call_winds_down_starts_afresh() -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    started, cancelled, let_go = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            await let_go.wait()  # clean-up that outlives the cancellation request
            raise
        return "never"

    waiter = asyncio.create_task(sf.run("k", slow_to_stop))
    await started.wait()
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    await cancelled.wait()
    fresh = Gated("fresh")
    fresh.release.set()
    try:
        assert await asyncio.wait_for(sf.run("k", fresh), 1) == ("fresh", False)
        assert fresh.calls == 1
    finally:
        let_go.set()


async def test_an_error_after_all_waiters_left_is_not_reported_as_never_retrieved() -> None:
    sf: SingleFlight[str, str] = SingleFlight()
    started = asyncio.Event()

    async def stubborn() -> str:
        # Swallows its cancellation and fails anyway, so the error has no waiter left to receive it.
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass
        raise RuntimeError("late failure")

    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        waiter = asyncio.create_task(sf.run("k", stubborn))
        await started.wait()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        still_running = asyncio.all_tasks() - {asyncio.current_task()}
        if still_running:
            await asyncio.wait(still_running)
        del still_running
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert reported == []
    assert len(sf) == 0


async def test_join_shares_an_external_future_and_the_last_waiter_leaving_cancels_it():
    import asyncio

    from mergebroker.merge.coalesce import SingleFlight

    flight: SingleFlight[str, str] = SingleFlight()
    started: list[asyncio.Future[str]] = []

    def start() -> asyncio.Future[str]:
        started.append(asyncio.get_running_loop().create_future())
        return started[-1]

    first = asyncio.create_task(flight.join("k", start))
    second = asyncio.create_task(flight.join("k", start))
    await asyncio.sleep(0)
    assert len(started) == 1 and flight.in_flight("k")
    first.cancel()
    await asyncio.sleep(0)
    assert not started[0].cancelled()  # the other waiter still wants it
    started[0].set_result("value")
    assert await second == ("value", True)
    assert len(flight) == 0

    lone = asyncio.create_task(flight.join("k2", start))
    await asyncio.sleep(0)
    lone.cancel()
    await asyncio.sleep(0)
    assert started[1].cancelled() and len(flight) == 0


async def test_join_reports_an_error_from_start_to_that_caller_alone():
    import pytest

    from mergebroker.merge.coalesce import SingleFlight

    flight: SingleFlight[str, str] = SingleFlight()

    def broken():
        raise RuntimeError("queue full")

    with pytest.raises(RuntimeError):
        await flight.join("k", broken)
    assert len(flight) == 0
