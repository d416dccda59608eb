"""The second cache level: Redis shared by broker instances, best effort.

A cache must never make a request fail or wait: while Redis is unreachable every read is a miss and
every write is skipped, one warning is logged, and Redis is probed again every `retry_after_s`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import cast

import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from mergebroker.clock import Clock, monotonic
from mergebroker.redis_connect import PoolOptions, RedisClient, connect, get_many

log = structlog.get_logger(__name__)


def make_redis_client(url: str, *, max_connections: int = 64, socket_timeout_s: float = 0.5) -> RedisClient:
    """A client for a cache: bounded pool, short timeouts and no retries, so a dead Redis costs milliseconds.

    `url` is any `mergebroker.redis_connect` URL (one server, Sentinel, Cluster). The blocking pool makes
    callers past `max_connections` wait (at most `socket_timeout_s`) for a connection instead of raising
    at once as the default pool does. Responses are not decoded: values are bytes.
    """
    return connect(url, PoolOptions(
        max_connections=max_connections,
        pool_timeout_s=socket_timeout_s,
        socket_timeout_s=socket_timeout_s,
        socket_connect_timeout_s=socket_timeout_s,
        # A miss is cheaper than a slow retry; RedisCache probes again later on its own schedule. One immediate
        # retry on a connection error only: a pooled connection from before a Redis restart (or a Sentinel
        # failover: the retry asks the sentinels for the new master) fails once, and reconnecting at once
        # keeps that from switching the cache off after the outage is over.
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    ))


class RedisCache:
    """Byte values in Redis under `prefix + key`, with jittered TTLs; never raises on Redis failures.

    Keys carry no hash tag: in a Redis Cluster entries spread over the shards, a read of many keys is one
    MGET per slot and a write one pipelined SET per key (neither needs to be atomic).

    `client` must not decode responses (see `make_redis_client`). Writes live `ttl_s` seconds, each
    scaled by a random factor in [1 - jitter_ratio, 1 + jitter_ratio] so entries written together do
    not all expire together (and stampede the upstream together).
    """

    def __init__(self, client: RedisClient, *, prefix: str, ttl_s: float, jitter_ratio: float = 0.1,
                 rng: random.Random | None = None, retry_after_s: float = 5.0, clock: Clock = monotonic) -> None:
        if ttl_s <= 0 or not 0 <= jitter_ratio < 1:
            raise ValueError("ttl_s must be positive and jitter_ratio in [0, 1)")
        self._client = client
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._jitter = jitter_ratio
        self._rng = rng or random.Random()
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._unavailable = False
        self._retry_at = 0.0

    @property
    def available(self) -> bool:
        """False from a failed Redis call until a later call succeeds."""
        return not self._unavailable

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values for `keys` in one round trip (MGET; one per slot in a cluster); all misses while unavailable."""
        if not keys or not self._may_call():
            return [None] * len(keys)
        try:
            values = await get_many(self._client, [self._prefix + key for key in keys])
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return [None] * len(keys)
        self._succeeded()
        return list(cast(list[bytes | None], values))  # the client does not decode responses (see the class docstring)

    async def get(self, key: str) -> bytes | None:
        """The value for `key`, or None."""
        return (await self.get_many([key]))[0]

    async def set_many(self, items: Mapping[str, bytes], ttl_s: float | None = None) -> None:
        """Store every item in one pipelined round trip (`SET key value PX ttl`); skipped while unavailable."""
        if not items or not self._may_call():
            return
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key, value in items.items():
                    pipe.set(self._prefix + key, value, px=self._jittered_ms(ttl_s))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return
        self._succeeded()

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        """Store one value."""
        await self.set_many({key: value}, ttl_s)

    def _jittered_ms(self, ttl_s: float | None) -> int:
        ttl = self._ttl_s if ttl_s is None else ttl_s
        factor = self._rng.uniform(1 - self._jitter, 1 + self._jitter)
        return max(1, int(ttl * factor * 1000))

    def _may_call(self) -> bool:
        if not self._unavailable:
            return True
        now = self._clock()
        if now < self._retry_at:
            return False
        # This caller probes; pushing the next probe out keeps concurrent callers from piling onto a dead Redis.
        self._retry_at = now + self._retry_after_s
        return True

    def _failed(self, exc: BaseException) -> None:
        self._retry_at = self._clock() + self._retry_after_s
        if not self._unavailable:
            self._unavailable = True
            log.warning("redis_cache_unavailable", prefix=self._prefix, error_type=type(exc).__name__,
                        error=str(exc), retry_after_s=self._retry_after_s)

    def _succeeded(self) -> None:
        if self._unavailable:
            self._unavailable = False
            log.info("redis_cache_recovered", prefix=self._prefix)
