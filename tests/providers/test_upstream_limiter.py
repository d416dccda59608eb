"""The upstream limiter queues calls by priority and never lets them out faster than the provider's limits."""

from __future__ import annotations

import asyncio

from mergebroker.clock import FakeClock, monotonic
from mergebroker.providers.pacing import UpstreamLimiter


async def settle() -> None:
    """Let woken tasks run (they only need the loop to turn; nothing here waits on real time)."""
    for _ in range(5):
        await asyncio.sleep(0)


class Recorder:
    """Starts acquire() calls as tasks and records the order in which they are let through."""

    def __init__(self, limiter: UpstreamLimiter) -> None:
        self.limiter = limiter
        self.served: list[str] = []
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def _go(self, name: str, tokens: int, priority: int) -> None:
        await self.limiter.acquire(tokens, priority)
        self.served.append(name)

    async def start(self, name: str, tokens: int = 0, priority: int = 0) -> None:
        self.tasks[name] = asyncio.create_task(self._go(name, tokens, priority))
        await settle()

    async def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await settle()
        self.limiter.close()


async def test_calls_within_the_burst_go_at_once(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=120, tpm=None, clock=fake_clock)  # 2 per second, burst of 2
    rec = Recorder(limiter)
    for name in "abc":
        await rec.start(name)
    assert rec.served == ["a", "b"]
    assert limiter.waiting == 1
    await rec.stop()


async def test_high_priority_waiter_is_served_before_earlier_low_priority_ones(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=60, tpm=None, clock=fake_clock)  # one call per second
    rec = Recorder(limiter)
    await rec.start("first")
    await rec.start("low1", priority=0)
    await rec.start("low2", priority=0)
    await rec.start("high", priority=5)
    assert rec.served == ["first"]
    for _ in range(3):
        fake_clock.advance(1)
        await settle()
    assert rec.served == ["first", "high", "low1", "low2"]


async def test_never_exceeds_its_request_and_token_rates(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=600, tpm=6000, clock=fake_clock)  # 10 calls and 100 tokens per second
    rec = Recorder(limiter)
    for i in range(60):
        await rec.start(f"c{i}", tokens=25, priority=i % 3)
    served_at: list[int] = []
    for _ in range(12):
        served_at.append(len(rec.served))
        fake_clock.advance(1)
        await settle()
    gained = [after - before for before, after in zip(served_at, served_at[1:])]
    assert served_at[0] == 4                     # a burst of one second's tokens: 100 / 25
    assert all(g == 4 for g in gained)           # tokens, not requests, are the binding limit
    await rec.stop()


async def test_cancelled_waiter_is_removed_and_does_not_block_others(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=None, tpm=600, clock=fake_clock)  # 10 tokens per second, burst of 10
    rec = Recorder(limiter)
    await rec.start("first", tokens=10)
    await rec.start("big", tokens=10, priority=9)
    await rec.start("small", tokens=2)
    assert rec.served == ["first"]
    rec.tasks["big"].cancel()
    await settle()
    assert limiter.waiting == 1
    fake_clock.advance(0.2)
    await settle()
    assert rec.served == ["first", "small"]
    await rec.stop()


async def test_a_call_bigger_than_the_bucket_takes_one_full_bucket_and_no_debt(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=None, tpm=600, clock=fake_clock)  # bucket of 10, 10 per second
    assert await asyncio.wait_for(limiter.acquire(10**12, 0), 1) == 10  # an absurd estimate costs one bucket
    rec = Recorder(limiter)
    await rec.start("next", tokens=10)
    assert rec.served == []
    fake_clock.advance(1)  # one second refills the bucket: the huge estimate left no debt behind
    await settle()
    assert rec.served == ["next"]


async def test_usage_settled_beyond_what_was_taken_is_still_charged(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=None, tpm=600, clock=fake_clock)
    taken = await limiter.acquire(50, 0)
    limiter.give_back(taken - 50)  # the call really used 50: 40 of debt
    rec = Recorder(limiter)
    await rec.start("next", tokens=10)
    fake_clock.advance(4.9)
    await settle()
    assert rec.served == []  # 40 tokens of debt plus 10 for "next" take 5 s
    fake_clock.advance(0.1)
    await settle()
    assert rec.served == ["next"]


async def test_a_refund_returns_the_request_as_well_as_the_tokens(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=60, tpm=600, clock=fake_clock)  # one request per second, bucket of 10
    taken = await limiter.acquire(10, 0)
    rec = Recorder(limiter)
    await rec.start("next", tokens=10)
    assert rec.served == []
    limiter.refund(taken)  # the first call was never sent
    await settle()
    assert rec.served == ["next"]
    await rec.stop()


async def test_given_back_tokens_let_the_next_waiter_go(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=None, tpm=600, clock=fake_clock)
    rec = Recorder(limiter)
    await rec.start("a", tokens=10)
    await rec.start("b", tokens=6)
    assert rec.served == ["a"]
    limiter.give_back(6)  # "a" used 4 of its 10
    await settle()
    assert rec.served == ["a", "b"]


async def test_waiter_is_woken_by_a_real_timer_on_the_system_clock() -> None:
    # A bucket of one call refilling every 100 ms: the second call waits for a real timer. (A deep bucket would
    # refill while a loaded machine drains it, and the wait it measures would shrink to nothing.)
    limiter = UpstreamLimiter(rpm=600, tpm=None, clock=monotonic, burst_s=0.1)
    await limiter.acquire(0, 0)
    started = monotonic()
    await asyncio.wait_for(limiter.acquire(0, 0), timeout=2)
    assert monotonic() - started >= 0.05


async def test_unlimited_limiter_never_waits(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=None, tpm=None, clock=fake_clock)
    for _ in range(1000):
        await asyncio.wait_for(limiter.acquire(10**6, 0), timeout=1)
    assert limiter.waiting == 0



async def test_waiter_cancelled_right_after_being_served_gives_its_share_back(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=60, tpm=None, clock=fake_clock)  # one call per second
    rec = Recorder(limiter)
    await rec.start("first")
    await rec.start("quitter")
    fake_clock.advance(1)
    rec.tasks["quitter"].cancel()
    await settle()
    await rec.start("next")
    assert rec.served == ["first", "next"]
    await rec.stop()
