"""One tenant cannot open a breaker for everyone: its concentrated failures get only its own calls refused,
spread failures still open the breaker, and a long answer at the provider's token rate is not slow."""

from __future__ import annotations

from typing import Any

import pytest

from mergebroker.breaker.blame import judge
from mergebroker.breaker.circuit import BreakerOpenError, BreakerSettings, BreakerState, CircuitBreaker, trip_reason
from mergebroker.breaker.window import WindowStats
from mergebroker.clock import FakeClock
from mergebroker.errors import UpstreamHTTPError, UpstreamUnavailable
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.retry import RetryPolicy
from mergebroker.providers.upstream import Upstream

SETTINGS = BreakerSettings(min_calls=10, error_ratio=0.10, slow_call_s=10.0, open_s=10.0)


def test_judge_sets_aside_the_one_tenant_whose_calls_fail():
    noisy, quiet = WindowStats.of(10, 10, 0), WindowStats.of(10, 0, 0)
    verdict = judge(WindowStats.of(20, 10, 0), {"noisy": noisy, "quiet": quiet}, SETTINGS, trip_reason)
    assert verdict.reason is None and verdict.isolate == "noisy"


def test_judge_opens_the_breaker_when_failures_are_spread_or_there_is_one_tenant():
    spread = {"a": WindowStats.of(10, 10, 0), "b": WindowStats.of(10, 5, 0)}
    assert judge(WindowStats.of(20, 15, 0), spread, SETTINGS, trip_reason).reason["blame"] == "spread"
    alone = {"a": WindowStats.of(10, 10, 0)}
    assert judge(WindowStats.of(10, 10, 0), alone, SETTINGS, trip_reason).reason is not None
    unknown = {None: WindowStats.of(10, 10, 0), "b": WindowStats.of(10, 0, 0)}
    assert judge(WindowStats.of(20, 10, 0), unknown, SETTINGS, trip_reason).reason is not None
    healthy = {"a": WindowStats.of(10, 0, 0), "b": WindowStats.of(10, 1, 0)}
    assert judge(WindowStats.of(20, 1, 0), healthy, SETTINGS, trip_reason) == judge(
        WindowStats.of(20, 1, 0), {}, SETTINGS, trip_reason)


async def _call(breaker: CircuitBreaker, clock: FakeClock, tenant: str, *, fail: bool = False, took: float = 0.1,
                allowance: float = 0.0) -> None:
    async with breaker.guard(tenant) as call:
        clock.advance(took)
        call.allowance_s = allowance
        if fail:
            raise UpstreamHTTPError(500, "boom")


async def test_a_tenant_whose_calls_fail_is_refused_alone_and_the_provider_stays_closed(fake_clock):
    breaker = CircuitBreaker("p", SETTINGS, clock=fake_clock)
    for _ in range(5):
        await _call(breaker, fake_clock, "quiet")
    for _ in range(10):
        with pytest.raises((UpstreamHTTPError, BreakerOpenError)):  # refused once its failures are judged its own
            await _call(breaker, fake_clock, "noisy", fail=True)
    assert breaker.state is BreakerState.CLOSED
    with pytest.raises(BreakerOpenError):
        breaker.before_call("noisy")
    await _call(breaker, fake_clock, "quiet")  # still served
    fake_clock.advance(SETTINGS.open_s + 0.1)
    breaker.before_call("noisy")  # its own open time is over


async def test_failures_of_several_tenants_open_the_breaker_for_everyone(fake_clock):
    breaker = CircuitBreaker("p", SETTINGS, clock=fake_clock)
    for i in range(12):
        with pytest.raises((UpstreamHTTPError, BreakerOpenError)):
            await _call(breaker, fake_clock, "ab"[i % 2], fail=True)
    assert breaker.state is BreakerState.OPEN


@pytest.mark.parametrize("took,allowance,slow", [(12.0, 24.0, False), (12.0, 0.0, True), (35.0, 24.0, True)])
async def test_slow_means_slower_than_expected_for_the_output(fake_clock, took, allowance, slow):
    breaker = CircuitBreaker("p", BreakerSettings(min_calls=1, slow_ratio=0.5, slow_call_s=10.0), clock=fake_clock)
    await _call(breaker, fake_clock, "a", took=took, allowance=allowance)
    assert (breaker.state is BreakerState.OPEN) is slow


class _ByTenantProvider:
    """Fails every call whose body names the noisy user; answers 1,200 tokens in 12 s to the others."""

    name = "p"

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self.calls = 0

    async def chat(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        self.calls += 1
        if body.get("user") == "noisy":
            raise UpstreamHTTPError(503, "overloaded by this tenant's prompts")
        self._clock.advance(12.0)  # 100 tokens/s, against an expected 50/s
        return {"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": 1200, "total_tokens": 1210}}

    async def close(self) -> None:
        return None


async def test_a_noisy_tenant_leaves_the_others_with_no_errors_through_the_pool(fake_clock):
    provider = _ByTenantProvider(fake_clock)
    breaker = CircuitBreaker("p", SETTINGS, clock=fake_clock)
    pools = ProviderPools([Upstream(provider, breaker=breaker, token_rate=50.0)], clock=fake_clock,
                          retry=RetryPolicy(attempts=1), sleep=fake_clock.sleep)
    noisy_errors, quiet_errors = 0, 0
    for i in range(40):
        tenant = "noisy" if i % 2 else "quiet"
        body = {"model": "m", "messages": [], "max_tokens": 1200, "user": tenant}
        try:
            await pools.chat("m", body, deadline=fake_clock() + 60, tenant=tenant)
        except (UpstreamHTTPError, UpstreamUnavailable):
            noisy_errors += tenant == "noisy"
            quiet_errors += tenant == "quiet"
    assert quiet_errors == 0 and noisy_errors == 20
    assert breaker.state is BreakerState.CLOSED
