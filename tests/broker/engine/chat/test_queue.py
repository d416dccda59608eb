"""MergeQueue releases groups on window, size and pressure, refuses past its cap, and serves aged priority first."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import pytest
from structlog.testing import capture_logs

from mergebroker.broker.engine.chat.merge_queue import MergeQueue, TierWindow
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.settings import TierSettings
from mergebroker.clock import FakeClock
from mergebroker.errors import Overloaded


@dataclass(eq=False)
class Item:
    """The smallest thing the queue accepts: a tier, a merge key and a future."""

    tier: str
    merge_key: str | None = "k"
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    enqueued_at: float = math.inf  # "just now" whatever the fake clock says: windows open at the clock's now


def tier(name: str = "std", *, priority: int = 50, window_s: float = 1.0, max_batch: int = 4, max_queue: int = 100,
         hard_cap: int | None = None) -> TierWindow:
    return TierWindow(name, priority, window_s, max_batch, max_queue, hard_cap or 2 * max_queue)


def queue(*tiers: TierWindow, clock: FakeClock, aging_per_s: float = 10.0,
          metrics: Metrics | None = None) -> MergeQueue[Item]:
    return MergeQueue(list(tiers) or [tier()], aging_per_s=aging_per_s, clock=clock, metrics=metrics)


async def test_group_is_released_when_its_window_passes_on_the_clock(fake_clock):
    q = queue(tier(window_s=0.5), clock=fake_clock)
    a, b = Item("std"), Item("std")
    q.submit(a)
    q.submit(b)
    fake_clock.advance(0.49)
    assert q.pick() is None
    fake_clock.advance(0.01)
    group = q.pick()
    assert group is not None and group.items == [a, b] and group.key == "k"
    assert q.depth("std") == 0


async def test_a_window_counts_from_when_its_first_request_reached_the_broker(fake_clock):
    # A job that travelled (a cluster worker reads it 0.2 s after its front-end queued it) has waited
    # that long already: its window closes 0.5 s after its arrival, not 0.5 s after the read.
    q = queue(tier(window_s=0.5), clock=fake_clock)
    travelled = Item("std", enqueued_at=fake_clock() - 0.2)
    q.submit(travelled)
    fake_clock.advance(0.29)
    assert q.pick() is None
    fake_clock.advance(0.01)
    group = q.pick()
    assert group is not None and group.items == [travelled]


async def test_a_waiting_worker_is_woken_by_the_window_closing_on_the_clock(fake_clock):
    q = queue(tier(window_s=0.01), clock=fake_clock)
    item = Item("std")
    q.submit(item)
    taker = asyncio.ensure_future(q.take())
    await asyncio.sleep(0)
    assert not taker.done()
    fake_clock.advance(0.01)
    group = await asyncio.wait_for(taker, timeout=10)
    assert group.items == [item]


async def test_group_is_released_at_once_when_it_reaches_max_batch(fake_clock):
    q = queue(tier(max_batch=3), clock=fake_clock)
    items = [Item("std") for _ in range(3)]
    for item in items[:2]:
        q.submit(item)
    assert q.pick() is None
    q.submit(items[2])
    group = q.pick()
    assert group is not None and group.items == items


async def test_different_merge_keys_wait_in_separate_groups(fake_clock):
    q = queue(tier(), clock=fake_clock)
    a, b = Item("std", "x"), Item("std", "y")
    q.submit(a)
    q.submit(b)
    fake_clock.advance(1)
    assert [q.pick().items, q.pick().items] == [[a], [b]]


async def test_full_windows_are_force_flushed_counted_and_logged(fake_clock):
    metrics = Metrics()
    q = queue(tier(max_queue=3, max_batch=8), clock=fake_clock, metrics=metrics)
    items = [Item("std", f"key{i}") for i in range(3)]
    with capture_logs() as logs:
        for item in items:
            q.submit(item)
    released = [q.pick(), q.pick(), q.pick()]
    assert [g.items for g in released if g] == [[i] for i in items]
    assert metrics.registry.get_sample_value("mergebroker_forced_flush_total", {"tier": "std"}) == 1
    flushes = [e for e in logs if e["event"] == "queue_forced_flush"]
    assert len(flushes) == 1 and flushes[0]["log_level"] == "warning" and flushes[0]["tier"] == "std"


async def test_submit_past_the_hard_cap_raises_overloaded_at_once(fake_clock):
    metrics = Metrics()
    q = queue(tier(max_queue=2, max_batch=8), clock=fake_clock, metrics=metrics)
    for i in range(4):  # the default hard cap is 2 x max_queue
        q.submit(Item("std", f"key{i}"))
    with pytest.raises(Overloaded) as refused:
        q.submit(Item("std"))
    assert refused.value.status == 503 and refused.value.code == "queue_full"
    assert refused.value.headers() == {"Retry-After": "1"}
    assert q.depth("std") == 4
    assert metrics.registry.get_sample_value("mergebroker_rejected_total",
                                             {"tier": "std", "reason": "queue_full"}) == 1
    q.pick()
    q.submit(Item("std"))  # room again once a worker took a group
    assert q.depth("std") == 4


def test_default_hard_cap_is_twice_max_queue():
    assert TierSettings(name="t", max_queue=7).queue_hard_cap == 14
    assert TierSettings(name="t", max_queue=7, hard_cap=9).queue_hard_cap == 9


async def test_workers_take_the_highest_priority_first(fake_clock):
    q = queue(tier("low", priority=0), tier("high", priority=100), tier("mid", priority=50), clock=fake_clock)
    for name in ("low", "mid", "high"):
        q.submit(Item(name, None))
    assert [q.pick().tier for _ in range(3)] == ["high", "mid", "low"]


async def test_aged_low_priority_group_overtakes_fresh_high_priority_after_the_bound(fake_clock):
    # (100 - 0) / 10 per second: the released low group must win after at most 10 s.
    q = queue(tier("low", priority=0), tier("high", priority=100), clock=fake_clock, aging_per_s=10.0)
    low = Item("low", None)
    q.submit(low)
    fake_clock.advance(9.99)
    q.submit(Item("high", None))
    assert q.pick().tier == "high"
    fake_clock.advance(0.02)
    q.submit(Item("high", None))
    assert q.pick().items == [low]
    assert q.pick().tier == "high"


async def test_without_aging_low_priority_never_overtakes(fake_clock):
    q = queue(tier("low", priority=0), tier("high", priority=100), clock=fake_clock, aging_per_s=0.0)
    q.submit(Item("low", None))
    fake_clock.advance(3600)
    q.submit(Item("high", None))
    assert q.pick().tier == "high"


async def test_done_members_are_dropped_when_taken_and_the_others_stay(fake_clock):
    q = queue(tier(), clock=fake_clock)
    gone, timed_out, live = Item("std"), Item("std"), Item("std")
    for item in (gone, timed_out, live):
        q.submit(item)
    gone.future.cancel()
    timed_out.future.set_exception(TimeoutError())
    timed_out.future.exception()  # retrieved, so the loop does not warn about it
    fake_clock.advance(1)
    group = await asyncio.wait_for(q.take(), timeout=2)
    assert group.items == [live]


async def test_a_group_with_no_live_member_is_skipped(fake_clock):
    q = queue(tier(), clock=fake_clock)
    dead, live = Item("std", None), Item("std", None)
    q.submit(dead)
    q.submit(live)
    dead.future.cancel()
    group = await asyncio.wait_for(q.take(), timeout=2)
    assert group.items == [live]
    assert q.depth("std") == 0


async def test_non_mergeable_requests_are_released_at_once(fake_clock):
    q = queue(tier("std", window_s=5.0), tier("nowin", window_s=0.0), clock=fake_clock)
    alone, unwindowed = Item("std", None), Item("nowin", "k")
    q.submit(alone)
    q.submit(unwindowed)
    assert {q.pick().items[0], q.pick().items[0]} == {alone, unwindowed}


async def test_an_idle_worker_is_woken_by_a_release(fake_clock):
    q = queue(tier(), clock=fake_clock)
    waiting = asyncio.create_task(q.take())
    await asyncio.sleep(0)  # one loop turn: the worker parks on its waiter (a yield, not a timed wait)
    assert not waiting.done()
    item = Item("std", None)
    q.submit(item)
    group = await asyncio.wait_for(waiting, timeout=2)
    assert group.items == [item]


async def test_close_returns_every_waiting_item_and_refuses_new_ones(fake_clock):
    q = queue(tier(window_s=0.01), tier("other"), clock=fake_clock)
    windowed, ready, other = Item("std"), Item("std", None), Item("other")
    for item in (windowed, ready, other):
        q.submit(item)
    left = q.close()
    assert set(left) == {windowed, ready, other} and len(left) == 3
    assert q.depth("std") == 0 and q.pick() is None
    with pytest.raises(Overloaded):
        q.submit(Item("std"))


def test_aged_rank_orders_like_aging_priority_at_any_time():
    from mergebroker.broker.engine.chat.jobs import aged_rank

    fresh_realtime = aged_rank(100, enqueued_at=1000.0, aging_per_s=10)
    assert aged_rank(0, enqueued_at=1000.0 - 9.9, aging_per_s=10) < fresh_realtime
    assert aged_rank(0, enqueued_at=1000.0 - 10.1, aging_per_s=10) > fresh_realtime
    assert aged_rank(5, enqueued_at=1.0, aging_per_s=0) == 5.0


async def test_requests_are_announced_as_soon_as_they_have_a_merge_partner(fake_clock):
    heard: list[tuple[str, list[Item]]] = []
    q = MergeQueue([tier(max_batch=8)], clock=fake_clock, on_partners=lambda t, items: heard.append((t, list(items))))
    first, second, third, alone = Item("std"), Item("std"), Item("std"), Item("std", merge_key="other")
    q.submit(first)
    q.submit(alone)
    assert heard == []
    q.submit(second)
    q.submit(third)
    assert heard == [("std", [first, second]), ("std", [third])]
