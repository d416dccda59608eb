"""Adaptive windows in the queue: a sequential client stops waiting, a burst still merges, skips are counted."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from mergebroker.broker.engine.chat.merge_queue import MergeQueue, TierWindow
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.clock import FakeClock


@dataclass(eq=False)
class Item:
    tier: str = "std"
    merge_key: str | None = "k"
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    enqueued_at: float = math.inf  # "just now" whatever the fake clock says: windows open at the clock's now


def adaptive_queue(clock: FakeClock, metrics: Metrics | None = None, *, adaptive: bool = True) -> MergeQueue[Item]:
    tier = TierWindow("std", 50, 0.05, 4, 100, 200, adaptive=adaptive, min_partners=0.1)
    return MergeQueue([tier], clock=clock, metrics=metrics)


def answer(item: Item) -> None:
    item.future.set_result("done")


async def settle() -> None:
    await asyncio.sleep(0)  # done callbacks run on the next loop pass


def decisions(metrics: Metrics) -> dict[str, float]:
    return {d: metrics.window_decisions.labels("std", d)._value.get() for d in ("wait", "skip", "join")}


async def test_a_sequential_client_waits_once_then_is_sent_at_once(fake_clock):
    metrics = Metrics()
    q = adaptive_queue(fake_clock, metrics)
    first = Item()
    q.submit(first)
    assert q.pick() is None  # no history yet: it waits like a fixed window
    fake_clock.advance(0.051)
    assert q.pick().items == [first]
    fake_clock.advance(0.002)
    answer(first)
    await settle()
    for _ in range(5):
        item = Item()
        q.submit(item)
        assert q.pick().items == [item]  # released at once, no window
        fake_clock.advance(0.002)
        answer(item)
        await settle()
    assert decisions(metrics) == {"wait": 1, "skip": 5, "join": 0}


async def test_a_burst_still_merges_into_one_group(fake_clock):
    metrics = Metrics()
    q = adaptive_queue(fake_clock, metrics)
    burst = [Item() for _ in range(4)]
    for item in burst:
        q.submit(item)
    assert q.pick().items == burst  # released by max_batch, all together
    assert decisions(metrics) == {"wait": 1, "skip": 0, "join": 3}


async def test_a_fixed_window_always_waits(fake_clock):
    q = adaptive_queue(fake_clock, adaptive=False)
    for _ in range(3):
        item = Item()
        q.submit(item)
        assert q.pick() is None
        fake_clock.advance(0.051)
        assert q.pick().items == [item]
        answer(item)
        await settle()


async def test_requests_that_each_open_their_own_group_are_sent_at_once_after_the_first(fake_clock):
    """Every request its own merge key (e.g. a system prompt with a session id): no partner ever comes, so after
    the tier's first new group has shown it, none pays the window (it added a whole window to each before)."""
    metrics = Metrics()
    q = adaptive_queue(fake_clock, metrics)
    first = Item(merge_key="session 0")
    q.submit(first)
    assert q.pick() is None  # the tier knows nothing of its new groups yet: it waits like a fixed window
    fake_clock.advance(0.051)
    assert q.pick().items == [first]
    answer(first)
    await settle()
    for i in range(1, 6):
        item = Item(merge_key=f"session {i}")
        q.submit(item)
        assert q.pick().items == [item]  # released at once
        fake_clock.advance(0.002)
        answer(item)
        await settle()
    assert decisions(metrics) == {"wait": 1, "skip": 5, "join": 0}


async def test_a_request_its_window_would_send_at_once_is_let_go_to_its_caller_and_counted_once(fake_clock):
    """`take_alone`: what `submit` would release alone at once is handed back to the caller to send in its own
    task (no dispatch task, no hop through the queue); what would wait is left to `submit`, with nothing
    recorded, so every arrival counts once either way."""
    metrics = Metrics()
    q = adaptive_queue(fake_clock, metrics)
    first = Item(merge_key="session 0")
    assert not q.take_alone(first)  # no evidence yet: it would wait
    assert decisions(metrics) == {"wait": 0, "skip": 0, "join": 0}
    q.submit(first)
    fake_clock.advance(0.051)
    assert q.pick().items == [first]
    answer(first)
    await settle()
    alone = Item(merge_key="session 1")
    assert q.take_alone(alone)
    assert q.pick() is None and q.depth("std") == 0  # the queue does not hold it: its caller sends it
    assert decisions(metrics) == {"wait": 1, "skip": 1, "join": 0}
    partner = Item(merge_key="session 1")  # arrives while the first of its group is pending
    assert not q.take_alone(partner)
    assert decisions(metrics) == {"wait": 1, "skip": 1, "join": 0}
    q.submit(partner)
    assert q.pick() is None  # it waits for partners in its window, as submit decides
    assert decisions(metrics) == {"wait": 2, "skip": 1, "join": 0}
