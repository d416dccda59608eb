"""Bulk capacity is shared round-robin across tenants: one tenant's large job does not hold back another's
small one (issue 26: finding 5)."""

from __future__ import annotations

import asyncio
import hashlib

import openai

from mergebroker.broker.bulk.fair import FairSlots
from tests.broker.bulk.test_batches_api import config, finished, line, run_batch


async def test_a_freed_slot_goes_to_the_tenant_whose_turn_it_is():
    slots = FairSlots(1)
    order: list[str] = []
    await slots.acquire("a")  # the one slot is held

    async def take(tenant: str, n: int) -> None:
        async with slots.slot(tenant):
            order.append(f"{tenant}{n}")

    waiters = [asyncio.ensure_future(take("a", n)) for n in range(4)]
    await asyncio.sleep(0)
    waiters += [asyncio.ensure_future(take("b", n)) for n in range(2)]
    await asyncio.sleep(0)
    assert slots.waiting("a") == 4 and slots.waiting("b") == 2
    slots.release()
    await asyncio.gather(*waiters)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]
    assert slots.free == 1 and slots.waiting() == 0


async def test_a_cancelled_waiter_gives_its_turn_away():
    slots = FairSlots(1)
    await slots.acquire("a")
    gone = asyncio.ensure_future(slots.acquire("b"))
    kept = asyncio.ensure_future(slots.acquire("c"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    slots.release()
    await kept
    assert gone.cancelled() and slots.waiting() == 0 and slots.free == 0


async def test_a_small_job_of_another_tenant_is_not_queued_behind_a_large_one(simulator, start_broker, tmp_path):
    simulator.set_faults(latency_base_ms=60)
    keys = [{"sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": k, "tiers": ["batch", "standard"]}
            for k in ("large-key", "small-key")]
    b = await start_broker({**config(simulator, tmp_path, concurrency=2), "auth": {"mode": "keys", "keys": keys}})
    large, small = (openai.AsyncOpenAI(base_url=b.url + "/v1", api_key=k, max_retries=0)
                    for k in ("large-key", "small-key"))
    try:
        rows = [line(f"q{n}", f"question {n}", system=f"System {n}") for n in range(60)]  # 60 calls of 1
        big = await run_batch(large, b, rows)
        await b.batches.wait_until(big, lambda d: d["request_counts"]["completed"] >= 2)
        tiny = await run_batch(small, b, [line("only", "the small job's question")])
        done = await finished(small, b, tiny)
        at_that_time = await large.batches.retrieve(big)
        assert done.status == "completed"
        # Round-robin: the small job's call took the next free slot; the large job's 60 calls were far from done.
        assert at_that_time.request_counts.completed <= 20
        assert (await finished(large, b, big)).request_counts.completed == 60
    finally:
        await large.close()
        await small.close()
