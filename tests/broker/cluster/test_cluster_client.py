"""A Redis restart leaves no stale connection behind: the cluster's stream client reconnects a pooled
connection that died with the old server on its first use, so no loop reports an error (and no warning
outlives the outage). The cache's client (`merge.redis_cache.make_redis_client`) does not yet."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from mergebroker.broker.cluster.client import make_stream_client
from mergebroker.merge.redis_cache import RedisCache, make_redis_client

pytestmark = pytest.mark.redis

POOL = 8


async def fill_pool(client) -> None:
    """Open every connection of the pool: as many blocking reads at once as it holds."""
    await asyncio.gather(*(client.xread({"nothing-here": "$"}, block=50) for _ in range(POOL)))


async def test_every_pooled_stream_connection_reconnects_after_a_redis_restart(redis_server):
    client = make_stream_client(redis_server.url, block_ms=50, max_connections=POOL)
    try:
        await fill_pool(client)
        redis_server.stop()
        redis_server.start()
        reads = await asyncio.gather(*(client.xread({"nothing-here": "$"}, block=50) for _ in range(POOL)))
        assert not any(reads)  # each on a connection from before the restart: nothing read, and no ConnectionError
    finally:
        await client.aclose()


async def test_the_cache_logs_no_warning_after_a_redis_restart(redis_server):
    client = make_redis_client(redis_server.url, max_connections=POOL)
    cache = RedisCache(client, prefix="t:", ttl_s=60)
    try:
        await asyncio.gather(*(client.blpop(["nothing-here"], timeout=0.05) for _ in range(POOL)))
        redis_server.stop()
        redis_server.start()
        with capture_logs() as logs:
            for _ in range(POOL):
                await cache.get("k")
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == []
    finally:
        await client.aclose()
