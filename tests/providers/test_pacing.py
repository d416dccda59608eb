"""Provider pacing: how close an upstream's declared RPM is to binding."""

from __future__ import annotations

import asyncio

import pytest

from mergebroker.clock import FakeClock
from mergebroker.providers.pacing import UpstreamLimiter


async def test_rpm_pressure_rises_as_the_request_bucket_empties_and_is_full_while_callers_queue() -> None:
    """Merging for capacity keys off this: how close the provider's declared RPM is to binding."""
    clock = FakeClock()
    limiter = UpstreamLimiter(rpm=120, tpm=None, clock=clock)  # a bucket of 2 requests, one every 0.5 s
    assert limiter.rpm_pressure() == 0.0
    await limiter.acquire(1, priority=0)
    assert limiter.rpm_pressure() == pytest.approx(0.5)
    await limiter.acquire(1, priority=0)
    waiter = asyncio.ensure_future(limiter.acquire(1, priority=0))
    await asyncio.sleep(0)
    assert limiter.rpm_pressure() == 1.0
    clock.advance(0.5)
    await waiter
    assert UpstreamLimiter(None, tpm=6000, clock=clock).rpm_pressure() == 0.0
