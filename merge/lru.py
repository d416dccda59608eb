"""The first cache level: an in-process LRU of bytes, bounded by entry count and by value bytes, with TTLs."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from mergebroker.clock import Clock, monotonic


@dataclass(frozen=True, slots=True)
class _Entry:
    value: bytes
    expires_at: float | None


class LruCache:
    """A least-recently-used cache of `bytes` values.

    Both bounds always hold after `set`: at most `max_entries` entries and at most `max_bytes` of values
    (keys and bookkeeping are not counted). A value larger than `max_bytes` is not stored. `ttl_s` is the
    default lifetime (None: entries live until evicted); expired entries are dropped when read.

    Not thread-safe: use it from the event loop only (it never awaits, so no lock is needed there).
    """

    def __init__(self, *, max_entries: int, max_bytes: int, ttl_s: float | None, clock: Clock = monotonic) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be positive")
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._ttl_s = ttl_s
        self._clock = clock
        # Most recently used at the end, so eviction pops from the front.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> bytes | None:
        """The value for `key`, or None if absent or expired; a hit makes the entry the most recent."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at is not None and self._clock() >= entry.expires_at:
            self.delete(key)
            return None
        self._entries.move_to_end(key)
        return entry.value

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """`get` for each key, in order."""
        return [self.get(key) for key in keys]

    def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        """Store `value` for `ttl_s` seconds (default: the cache's TTL), evicting the least recent as needed."""
        # Whatever happens below, an older value must not outlive the newer one that replaced it.
        self.delete(key)
        ttl = self._ttl_s if ttl_s is None else ttl_s
        if len(value) > self._max_bytes or (ttl is not None and ttl <= 0):
            return
        expires_at = None if ttl is None else self._clock() + ttl
        self._entries[key] = _Entry(value, expires_at)
        self._bytes += len(value)
        while len(self._entries) > self._max_entries or self._bytes > self._max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted.value)

    def delete(self, key: str) -> None:
        """Forget `key` (no error if absent)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry.value)

    def __len__(self) -> int:
        """Entries held, expired ones not yet read included."""
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        """Total length of the values held."""
        return self._bytes
