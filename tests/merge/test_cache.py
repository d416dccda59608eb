"""The LRU keeps its entry and byte bounds and TTLs, and the two-level cache reads L1 before one batched L2 lookup."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis

from mergebroker.clock import FakeClock
from mergebroker.merge.cache import LruCache, RedisCache, TwoLevelCache, make_redis_client


def lru(clock: FakeClock, *, max_entries: int = 100, max_bytes: int = 1000, ttl_s: float | None = None) -> LruCache:
    return LruCache(max_entries=max_entries, max_bytes=max_bytes, ttl_s=ttl_s, clock=clock)


def test_lru_evicts_least_recently_used_past_max_entries(fake_clock: FakeClock) -> None:
    cache = lru(fake_clock, max_entries=2)
    cache.set("a", b"1")
    cache.set("b", b"2")
    cache.set("c", b"3")
    assert cache.get_many(["a", "b", "c"]) == [None, b"2", b"3"]
    assert len(cache) == 2


def test_lru_evicts_until_bytes_fit(fake_clock: FakeClock) -> None:
    cache = lru(fake_clock, max_bytes=10)
    cache.set("a", b"x" * 4)
    cache.set("b", b"x" * 4)
    cache.set("c", b"x" * 3)
    assert cache.get_many(["a", "b", "c"]) == [None, b"x" * 4, b"x" * 3]
    assert cache.bytes_used == 7
    cache.set("d", b"x" * 9)
    assert cache.get_many(["b", "c", "d"]) == [None, None, b"x" * 9]
    assert cache.bytes_used == 9 and len(cache) == 1


def test_lru_hit_refreshes_recency(fake_clock: FakeClock) -> None:
    cache = lru(fake_clock, max_entries=2)
    cache.set("a", b"1")
    cache.set("b", b"2")
    assert cache.get("a") == b"1"
    cache.set("c", b"3")
    assert cache.get("a") == b"1"
    assert cache.get("b") is None


def test_lru_entry_expires_after_ttl(fake_clock: FakeClock) -> None:
    cache = lru(fake_clock, ttl_s=10)
    cache.set("a", b"1")
    cache.set("short", b"2", ttl_s=1)
    fake_clock.advance(1)
    assert cache.get("short") is None
    assert cache.get("a") == b"1"
    fake_clock.advance(9)
    assert cache.get("a") is None
    assert len(cache) == 0 and cache.bytes_used == 0


def test_lru_without_ttl_keeps_entries(fake_clock: FakeClock) -> None:
    cache = lru(fake_clock, ttl_s=None)
    cache.set("a", b"1")
    fake_clock.advance(1e9)
    assert cache.get("a") == b"1"


def test_lru_does_not_store_a_value_larger_than_max_bytes(fake_clock: FakeClock) -> None:
    cache = lru(fake_clock, max_bytes=4)
    cache.set("small", b"1234")
    cache.set("big", b"12345")
    assert cache.get("big") is None
    assert cache.get("small") == b"1234"


def test_lru_oversize_replacement_drops_the_older_value(fake_clock: FakeClock) -> None:
    cache = lru(fake_clock, max_bytes=4)
    cache.set("k", b"old")
    cache.set("k", b"too big")
    assert cache.get("k") is None and cache.bytes_used == 0


def test_lru_replacing_and_deleting_keep_byte_count_exact(fake_clock: FakeClock) -> None:
    cache = lru(fake_clock)
    cache.set("k", b"12345")
    cache.set("k", b"12")
    assert cache.bytes_used == 2 and len(cache) == 1
    cache.delete("k")
    cache.delete("absent")
    assert cache.bytes_used == 0 and cache.get("k") is None


@pytest.fixture
async def client(redis_server) -> AsyncIterator[redis.Redis]:
    c = make_redis_client(redis_server.url)
    yield c
    await c.aclose()


async def mget_calls(client: redis.Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_mget", {}).get("calls", 0))


async def test_two_level_promotes_l2_hit_into_l1(fake_clock: FakeClock, client: redis.Redis) -> None:
    l1 = lru(fake_clock, ttl_s=60)
    cache = TwoLevelCache(l1, RedisCache(client, prefix="t:", ttl_s=60, clock=fake_clock))
    await client.set("t:k", b"from-redis")
    assert await cache.get("k") == b"from-redis"
    assert l1.get("k") == b"from-redis"
    await client.delete("t:k")
    assert await cache.get("k") == b"from-redis"


async def test_two_level_sends_only_l1_misses_to_l2_in_one_mget(fake_clock: FakeClock, client: redis.Redis) -> None:
    l1 = lru(fake_clock)
    events: list[tuple[str, str]] = []
    cache = TwoLevelCache(l1, RedisCache(client, prefix="t:", ttl_s=60, clock=fake_clock),
                          metrics_hook=lambda level, result: events.append((level, result)))
    l1.set("a", b"A")
    await client.set("t:b", b"B")
    before = await mget_calls(client)
    assert await cache.get_many(["a", "b", "c"]) == [b"A", b"B", None]
    assert await mget_calls(client) == before + 1
    assert events == [("l1", "hit"), ("l1", "miss"), ("l1", "miss"), ("l2", "hit"), ("l2", "miss")]

    events.clear()
    assert await cache.get_many(["a", "b"]) == [b"A", b"B"]
    assert await mget_calls(client) == before + 1
    assert events == [("l1", "hit"), ("l1", "hit")]


async def test_two_level_set_writes_both_levels(fake_clock: FakeClock, client: redis.Redis) -> None:
    l1 = lru(fake_clock)
    cache = TwoLevelCache(l1, RedisCache(client, prefix="t:", ttl_s=60, clock=fake_clock))
    await cache.set_many({"a": b"A", "b": b"B"})
    await cache.set("c", b"C", ttl_s=5)
    assert l1.get_many(["a", "b", "c"]) == [b"A", b"B", b"C"]
    assert await client.mget(["t:a", "t:b", "t:c"]) == [b"A", b"B", b"C"]
    assert 0 < await client.pttl("t:c") <= 5500


async def test_two_level_without_l2_uses_l1_only(fake_clock: FakeClock) -> None:
    events: list[tuple[str, str]] = []
    cache = TwoLevelCache(lru(fake_clock), None, metrics_hook=lambda level, result: events.append((level, result)))
    await cache.set("a", b"A")
    assert await cache.get_many(["a", "b"]) == [b"A", None]
    assert events == [("l1", "hit"), ("l1", "miss")]


async def test_two_level_serves_l1_while_redis_is_down(fake_clock: FakeClock, client: redis.Redis,
                                                       redis_server) -> None:
    l1 = lru(fake_clock)
    cache = TwoLevelCache(l1, RedisCache(client, prefix="t:", ttl_s=60, clock=fake_clock))
    await cache.set("a", b"A")
    redis_server.stop()
    await cache.set("b", b"B")
    assert await cache.get_many(["a", "b", "c"]) == [b"A", b"B", None]
