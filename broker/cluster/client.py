"""The Redis client for the streams: a blocking pool and timeouts longer than the longest blocking read."""

from __future__ import annotations

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from mergebroker.redis_connect import PoolOptions, RedisClient, connect


def make_stream_client(url: str, *, block_ms: int, max_connections: int = 32) -> RedisClient:
    """A client whose callers wait for a free connection (the default pool raises `MaxConnectionsError`).

    `url` is any `mergebroker.redis_connect` URL (one server, Sentinel, Cluster: `partition.Keys` puts every
    key under one hash tag). Reads block up to `block_ms`, so the socket timeout leaves them room;
    connecting stays short, so a dead Redis is noticed in well under a second and the front-ends fall back.
    One immediate retry on a connection error, for a pooled connection that went stale when Redis restarted
    or failed over (a dead Redis refuses the second connect at once too; a Sentinel names the new master);
    anything else the callers decide (fall back, try later).
    """
    return connect(url, PoolOptions(max_connections=max_connections, pool_timeout_s=2.0,
                                    socket_timeout_s=block_ms / 1000 + 2.0, socket_connect_timeout_s=0.5,
                                    retry=Retry(NoBackoff(), 1)))
