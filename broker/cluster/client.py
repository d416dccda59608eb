"""The Redis client for the streams: a blocking pool and timeouts longer than the longest blocking read."""

from __future__ import annotations

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def make_stream_client(url: str, *, block_ms: int, max_connections: int = 32) -> redis.Redis:
    """A client whose callers wait for a free connection (the default pool raises `MaxConnectionsError`).

    Reads block up to `block_ms`, so the socket timeout leaves them room; connecting stays short, so a
    dead Redis is noticed in well under a second and the front-ends fall back. One immediate retry on a
    connection error, for a pooled connection that went stale when Redis restarted (a dead Redis
    refuses the second connect at once too); anything else the callers decide (fall back, try later).
    """
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=2.0, socket_timeout=block_ms / 1000 + 2.0,
        socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 1))
    return redis.Redis.from_pool(pool)
