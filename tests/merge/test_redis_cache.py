"""RedisCache reads in one MGET, writes jittered TTLs in one pipeline, and degrades to misses while Redis is down."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis
from structlog.testing import capture_logs

from mergebroker.clock import FakeClock
from mergebroker.merge.redis_cache import RedisCache, make_redis_client


@pytest.fixture
async def client(redis_server) -> AsyncIterator[redis.Redis]:
    c = make_redis_client(redis_server.url)
    yield c
    await c.aclose()


async def command_calls(client: redis.Redis, command: str) -> int:
    stats = await client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def events(logs: list[dict], name: str) -> list[dict]:
    return [entry for entry in logs if entry["event"] == name]


async def test_set_many_then_get_many_round_trips_under_the_prefix(client: redis.Redis,
                                                                   fake_clock: FakeClock) -> None:
    cache = RedisCache(client, prefix="emb:", ttl_s=60, clock=fake_clock)
    await cache.set_many({"a": b"\x00A", "b": b"B"})
    assert await cache.get_many(["a", "missing", "b"]) == [b"\x00A", None, b"B"]
    assert await client.get("emb:a") == b"\x00A"
    await cache.set("c", b"C")
    assert await cache.get("c") == b"C"


async def test_get_many_is_one_mget_and_set_many_one_set_per_item(client: redis.Redis, fake_clock: FakeClock) -> None:
    cache = RedisCache(client, prefix="p:", ttl_s=60, clock=fake_clock)
    mget_before = await command_calls(client, "mget")
    await cache.set_many({f"k{i}": b"v" for i in range(20)})
    assert await cache.get_many([f"k{i}" for i in range(20)]) == [b"v"] * 20
    assert await command_calls(client, "mget") == mget_before + 1
    assert await command_calls(client, "get") == 0
    assert await command_calls(client, "set") == 20


async def test_empty_batches_do_not_touch_redis(client: redis.Redis, fake_clock: FakeClock) -> None:
    cache = RedisCache(client, prefix="p:", ttl_s=60, clock=fake_clock)
    await cache.set_many({})
    assert await cache.get_many([]) == []
    assert await command_calls(client, "mget") == 0


async def test_ttls_are_jittered_within_bounds(client: redis.Redis, fake_clock: FakeClock) -> None:
    cache = RedisCache(client, prefix="j:", ttl_s=100, jitter_ratio=0.2, rng=random.Random(7), clock=fake_clock)
    await cache.set_many({f"k{i}": b"v" for i in range(30)})
    ttls = [await client.pttl(f"j:k{i}") for i in range(30)]
    # Allow a second of wall time between SET and PTTL below the lower bound.
    assert all(79_000 <= ttl <= 120_000 for ttl in ttls), ttls
    assert len(set(ttls)) > 20, "TTLs should differ so entries do not expire together"


async def test_explicit_ttl_overrides_the_default(client: redis.Redis, fake_clock: FakeClock) -> None:
    cache = RedisCache(client, prefix="j:", ttl_s=100, jitter_ratio=0.1, clock=fake_clock)
    await cache.set("short", b"v", ttl_s=2)
    assert 0 < await client.pttl("j:short") <= 2200


async def test_redis_down_gives_fast_misses_one_warning_and_recovery(redis_server, client: redis.Redis,
                                                                     fake_clock: FakeClock) -> None:
    cache = RedisCache(client, prefix="d:", ttl_s=60, retry_after_s=5, clock=fake_clock)
    await cache.set("a", b"A")
    redis_server.stop()
    pool, attempts = client.connection_pool, []
    take = pool.get_connection

    async def counted(*args, **kwargs):
        attempts.append(fake_clock())
        return await take(*args, **kwargs)

    pool.get_connection = counted  # how often the cache reaches for Redis, each a chance to wait on a socket
    with capture_logs() as logs:
        assert await cache.get_many(["a", "b"]) == [None, None]
        tried = len(attempts)
        await cache.set_many({"c": b"C"})
        assert await cache.get("a") is None
        assert len(attempts) == tried  # fast misses: until the retry is due nothing reaches for Redis
        fake_clock.advance(5)
        assert await cache.get("a") is None  # a probe, still down
        assert len(attempts) > tried
        assert not cache.available
        assert len(events(logs, "redis_cache_unavailable")) == 1
        assert events(logs, "redis_cache_unavailable")[0]["log_level"] == "warning"

        redis_server.start()
        assert await cache.get("a") is None  # the next probe is not due yet
        assert events(logs, "redis_cache_recovered") == []
        fake_clock.advance(5)
        await cache.set("a", b"again")
        assert await cache.get("a") == b"again"
        assert cache.available
        assert len(events(logs, "redis_cache_recovered")) == 1
        assert len(events(logs, "redis_cache_unavailable")) == 1


async def test_calls_while_down_skip_redis_until_the_retry_delay(redis_server, client: redis.Redis,
                                                                 fake_clock: FakeClock) -> None:
    cache = RedisCache(client, prefix="d:", ttl_s=60, retry_after_s=5, clock=fake_clock)
    redis_server.stop()
    with capture_logs():
        await cache.get("a")
    redis_server.start()
    # Redis is back, but the cache must not have tried before retry_after_s.
    await cache.set("a", b"A")
    assert await client.get("d:a") is None
    fake_clock.advance(5)
    await cache.set("a", b"A")
    assert await client.get("d:a") == b"A"


async def test_pool_bounds_connections_without_raising(redis_server, fake_clock: FakeClock) -> None:
    small = make_redis_client(redis_server.url, max_connections=2)
    try:
        cache = RedisCache(small, prefix="c:", ttl_s=60, clock=fake_clock)
        await cache.set("k", b"v")
        with capture_logs() as logs:
            results = await asyncio.gather(*(cache.get("k") for _ in range(20)))
        assert results == [b"v"] * 20
        assert events(logs, "redis_cache_unavailable") == []
    finally:
        await small.aclose()
