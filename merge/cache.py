"""Two cache levels in front of the upstream: the in-process LRU, then (optionally) Redis shared by instances.

`LruCache` lives in `merge.lru`, `RedisCache` and `make_redis_client` in `merge.redis_cache`;
they are re-exported here so callers import caches from one place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from mergebroker.merge.lru import LruCache
from mergebroker.merge.redis_cache import RedisCache, make_redis_client

__all__ = ["LruCache", "MetricsHook", "RedisCache", "SecondLevelCache", "TwoLevelCache", "make_redis_client"]

MetricsHook = Callable[[str, str], None]
"""Called as `hook(level, result)` with level "l1" or "l2" and result "hit" or "miss", once per key per level."""


class SecondLevelCache(Protocol):
    """A shared cache behind the LRU (`RedisCache` is the real one).

    Contract: `get_many` answers one value or None per key, in order, in one round trip; neither
    method raises when the backend is down (reads miss, writes are skipped).
    """

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    async def set_many(self, items: Mapping[str, bytes], ttl_s: float | None = None) -> None: ...


class TwoLevelCache:
    """Reads L1 first and sends only L1's misses to L2 in one batch; writes go to both levels.

    L2 hits are copied into L1 with L1's default TTL (L2's remaining TTL would cost another round trip).
    """

    def __init__(self, l1: LruCache, l2: SecondLevelCache | None, *, metrics_hook: MetricsHook | None = None) -> None:
        self._l1 = l1
        self._l2 = l2
        self._hook = metrics_hook

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """One value or None per key, in order."""
        found = self._l1.get_many(keys)
        self._count("l1", found)
        if self._l2 is None:
            return found
        # A key asked twice in one call is looked up in L2 once.
        missing = list(dict.fromkeys(key for key, value in zip(keys, found) if value is None))
        if not missing:
            return found
        from_l2 = await self._l2.get_many(missing)
        self._count("l2", from_l2)
        hits = {key: value for key, value in zip(missing, from_l2) if value is not None}
        for key, value in hits.items():
            self._l1.set(key, value)
        return [value if value is not None else hits.get(key) for key, value in zip(keys, found)]

    async def get(self, key: str) -> bytes | None:
        """The value for `key`, or None."""
        return (await self.get_many([key]))[0]

    async def set_many(self, items: Mapping[str, bytes], ttl_s: float | None = None) -> None:
        """Store in L1, then in L2 in one round trip; `ttl_s` None means each level's default."""
        for key, value in items.items():
            self._l1.set(key, value, ttl_s)
        if self._l2 is not None and items:
            await self._l2.set_many(items, ttl_s)

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        """Store one value in both levels."""
        await self.set_many({key: value}, ttl_s)

    def _count(self, level: str, values: list[bytes | None]) -> None:
        if self._hook is None:
            return
        for value in values:
            self._hook(level, "miss" if value is None else "hit")
