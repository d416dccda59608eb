"""The drain's state on a fake clock (begin, end when idle, expire at the deadline, a second signal), and who
may call POST /v1/broker/drain."""

from __future__ import annotations

import asyncio
import signal

from pydantic import SecretStr

from mergebroker.broker.http.drain import Drain
from mergebroker.broker.http.routes import drain_allowed
from mergebroker.broker.http.server import StopSignals


async def _handlers(drain: Drain, count: int) -> tuple[list[asyncio.Task[None]], asyncio.Event]:
    """`count` handler tasks registered with `drain`, each running until `release` is set."""
    release = asyncio.Event()
    entered = 0

    async def handler() -> None:
        nonlocal entered
        task = asyncio.current_task()
        assert task is not None
        drain.enter(task)
        entered += 1
        try:
            await release.wait()
        finally:
            drain.leave(task)

    tasks = [asyncio.ensure_future(handler()) for _ in range(count)]
    while entered < count:
        await asyncio.sleep(0)  # same loop: the tasks register as soon as they run
    return tasks, release


async def test_a_drain_with_nothing_in_flight_ends_at_once(fake_clock):
    drain = Drain(600, clock=fake_clock)
    drain.begin("POST /v1/broker/drain")
    result = await drain.wait()
    assert drain.draining and result.drained and result.in_flight == 0 and fake_clock.pending == 0


async def test_the_drain_ends_when_the_last_handler_leaves_not_at_the_deadline(fake_clock):
    drain = Drain(600, clock=fake_clock)
    tasks, release = await _handlers(drain, 3)
    drain.begin("SIGTERM received")
    assert drain.status() == "draining: SIGTERM received, 3 requests in flight"
    assert (await drain.wait(0)).drained is False
    release.set()
    await asyncio.gather(*tasks)
    result = await drain.wait()
    assert result.drained and not drain.expired and fake_clock.pending == 0  # the deadline timer is gone


async def test_at_the_deadline_the_handlers_left_are_cancelled_and_counted_as_cut(fake_clock):
    drain = Drain(30, clock=fake_clock)
    counted: list[tuple[str, int]] = []
    drain.observe(lambda outcome, n: counted.append((outcome, n)))
    tasks, _release = await _handlers(drain, 2)
    drain.begin("SIGTERM received")
    drain.refused()
    fake_clock.advance(29.9)
    assert not drain.expired
    fake_clock.advance(0.1)
    assert drain.expired
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert (await drain.wait()).drained is False
    assert counted == [("refused", 1), ("cut", 2)]


async def test_a_second_signal_ends_the_drain_at_once(fake_clock):
    drain, stop = Drain(600, clock=fake_clock), asyncio.Event()
    signals = StopSignals(drain, stop)
    tasks, _release = await _handlers(drain, 1)
    signals(signal.SIGTERM)
    assert stop.is_set() and drain.status() == "draining: SIGTERM received, 1 requests in flight"
    assert not drain.expired
    signals(signal.SIGINT)
    assert drain.expired
    await asyncio.gather(*tasks, return_exceptions=True)


def test_drain_calls_come_from_loopback_directly_or_with_the_metrics_token():
    token = SecretStr("t0ken")
    assert drain_allowed("127.0.0.1", {}, None)
    assert drain_allowed("::1", {}, None)
    assert not drain_allowed("10.1.2.3", {}, None)
    assert not drain_allowed("127.0.0.1", {"X-Forwarded-For": "203.0.113.9"}, None)  # a proxy on the host
    assert not drain_allowed(None, {}, None)
    assert drain_allowed("10.1.2.3", {"Authorization": "Bearer t0ken"}, token)
    assert not drain_allowed("10.1.2.3", {"Authorization": "Bearer nope"}, token)
