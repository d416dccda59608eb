"""Limits kept in Redis are enforced once across replicas, and Redis going down falls back to local limits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from structlog.testing import capture_logs

from mergebroker.broker.engine.limits.ratelimit import LimitSpec, RateLimiter
from mergebroker.broker.engine.limits.redis_limiter import RedisRateLimiter
from mergebroker.clock import FakeClock
from mergebroker.errors import RateLimited

pytestmark = pytest.mark.redis

TIER = LimitSpec("tier:standard", rpm=5, tpm=None)


def make_client(url: str, max_connections: int = 10) -> aioredis.Redis:
    # No client-side retries with backoff: a stopped server must fail fast in these tests.
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=10, retry=Retry(NoBackoff(), 0),
        socket_timeout=2, socket_connect_timeout=2)
    return aioredis.Redis(connection_pool=pool)


@pytest.fixture
async def clients(redis_server) -> AsyncIterator[Callable[..., aioredis.Redis]]:
    made: list[aioredis.Redis] = []

    def factory(max_connections: int = 10) -> aioredis.Redis:
        made.append(make_client(redis_server.url, max_connections))
        return made[-1]

    yield factory
    for client in made:
        await client.aclose()


def limiter(client: aioredis.Redis, clock: FakeClock) -> RedisRateLimiter:
    return RedisRateLimiter(client, fallback=RateLimiter(clock), clock=clock, wall_clock=clock)


async def admitted(lim: RedisRateLimiter, spec: LimitSpec, n: int, tokens: int = 0) -> int:
    count = 0
    for _ in range(n):
        try:
            await lim.reserve([spec], tokens)
            count += 1
        except RateLimited:
            pass
    return count


async def test_two_replicas_share_one_limit(clients, fake_clock: FakeClock) -> None:
    a, b = limiter(clients(), fake_clock), limiter(clients(), fake_clock)
    assert await admitted(a, TIER, 3) + await admitted(b, TIER, 3) + await admitted(a, TIER, 3) == 5
    with pytest.raises(RateLimited) as caught:
        await b.reserve([TIER], 0)
    assert caught.value.retry_after == pytest.approx(12.0)
    assert caught.value.extra_headers["x-ratelimit-remaining-requests"] == "0"
    fake_clock.advance(12)
    assert await admitted(b, TIER, 3) == 1


async def test_shared_reservation_is_all_or_nothing_and_reports_headers(clients, fake_clock: FakeClock) -> None:
    lim = limiter(clients(), fake_clock)
    tier = LimitSpec("tier:standard", rpm=100, tpm=1000)
    key = LimitSpec("key:ab12cd", rpm=100, tpm=300)
    first = await lim.reserve([tier, key], 250)
    assert first.headers() == {
        "x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "99",
        "x-ratelimit-reset-requests": "600ms",
        "x-ratelimit-limit-tokens": "300", "x-ratelimit-remaining-tokens": "50", "x-ratelimit-reset-tokens": "50s",
    }
    with pytest.raises(RateLimited) as caught:
        await lim.reserve([tier, key], 100)
    assert caught.value.retry_after == pytest.approx(10.0)
    probe = await lim.reserve([tier], 0)
    assert probe.headers()["x-ratelimit-remaining-requests"] == "98"
    assert probe.headers()["x-ratelimit-remaining-tokens"] == "750"


async def test_shared_settle_gives_back_once_across_replicas(clients, fake_clock: FakeClock) -> None:
    a, b = limiter(clients(), fake_clock), limiter(clients(), fake_clock)
    spec = LimitSpec("tier:standard", rpm=None, tpm=1000)
    reservation = await a.reserve([spec], 800)
    await reservation.settle(100)
    await reservation.settle(100)
    probe = await b.reserve([spec], 0)
    assert probe.headers()["x-ratelimit-remaining-tokens"] == "900"


async def test_bucket_keys_expire_once_refilled(clients, fake_clock: FakeClock) -> None:
    client = clients()
    await limiter(client, fake_clock).reserve([TIER], 0)
    ttl_ms = await client.pttl("{mb:rl}:tier:standard:requests")
    assert 12_000 < ttl_ms <= 13_000  # one request refills in 12 s, plus a second of slack


async def test_redis_down_falls_back_to_local_limits_with_one_warning(redis_server, clients,
                                                                      fake_clock: FakeClock) -> None:
    client = clients()
    lim = limiter(client, fake_clock)
    await lim.reserve([TIER], 0)
    redis_server.stop()
    with capture_logs() as logs:
        assert await admitted(lim, TIER, 7) == 5  # the local fallback starts with a full bucket of its own
    warnings = [e for e in logs if e["event"] == "ratelimit_redis_unavailable"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"

    redis_server.start()  # empty again: this test server keeps nothing across restarts
    fake_clock.advance(5)  # past retry_after_s; the local bucket is still empty, Redis has a full one
    with capture_logs() as logs:
        assert await admitted(lim, TIER, 7) == 5
    assert [e["event"] for e in logs] == ["ratelimit_redis_recovered"]
    assert await client.exists("{mb:rl}:tier:standard:requests") == 1


async def test_many_concurrent_reserves_wait_for_pooled_connections(clients, fake_clock: FakeClock) -> None:
    lim = limiter(clients(max_connections=4), fake_clock)
    spec = LimitSpec("tier:standard", rpm=150, tpm=None)

    async def one() -> bool:
        try:
            await lim.reserve([spec], 0)
            return True
        except RateLimited:
            return False

    with capture_logs() as logs:
        results = await asyncio.gather(*(one() for _ in range(200)))
    assert sum(results) == 150
    assert not [e for e in logs if e["event"] == "ratelimit_redis_unavailable"]
