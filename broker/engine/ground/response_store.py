"""The broker's own store of Responses API responses, per tenant: `store`, `previous_response_id`, and
`GET`/`DELETE /v1/responses/{id}` work on every upstream, and a chain continues on whichever upstream
(and, in cluster mode, whichever replica) serves its next turn.

Each stored response keeps its input items (the turn's own), its output items and the id it continued;
a chain's history is rebuilt by walking those ids. Rows are keyed by tenant and id, so another tenant's
id is simply not found, and expire after `retention_s`. Two stores:
- `SqliteResponseStore`: a file (shared by the replicas of one host when they name the same one), or memory;
- `RedisResponseStore`: the cluster's Redis, so every replica reads what any replica stored.
`open_response_store` picks Redis in cluster mode (`responses.backend: auto`), SQLite otherwise.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from mergebroker import jsonio
from mergebroker.background import spawn
from mergebroker.errors import Overloaded

log = structlog.get_logger(__name__)

MAX_CHAIN = 1000
"""The longest chain of `previous_response_id` followed (a guard against a cycle in a corrupt store)."""


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the Response object, the turn's input items, and the id it continued."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous_response_id: str | None


class ResponseStore(Protocol):
    """Where stored responses live. `keep` may finish its write after it returns (a stream's last event is
    sent meanwhile); `get` and `history` of that id wait for it."""

    def keep(self, tenant: str, response: dict[str, Any], input_items: list[dict[str, Any]],
             previous_response_id: str | None) -> None: ...

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


async def chain_history(store: ResponseStore, tenant: str, response_id: str) -> list[dict[str, Any]] | None:
    """The items a turn continuing `response_id` is preceded by: every earlier turn's input and output
    items, oldest first; None when `response_id` is not the tenant's."""
    turns: list[StoredResponse] = []
    current: str | None = response_id
    while current is not None and len(turns) < MAX_CHAIN:
        stored = await store.get(tenant, current)
        if stored is None:
            if not turns:
                return None
            break  # an expired ancestor: the chain is kept from where it still is
        turns.append(stored)
        current = stored.previous_response_id
    items: list[dict[str, Any]] = []
    for turn in reversed(turns):
        items.extend(turn.input_items)
        items.extend(item for item in turn.response.get("output") or [] if isinstance(item, dict))
    return items


def _row(response: dict[str, Any], input_items: list[dict[str, Any]], previous: str | None) -> bytes:
    return jsonio.dumps({"response": response, "input": input_items, "previous": previous})


def _stored(row: bytes) -> StoredResponse:
    data = jsonio.loads(row)
    return StoredResponse(data["response"], data["input"], data["previous"])


class SqliteResponseStore:
    """Stored responses in SQLite (see the module docstring). Thread-safe; calls are short and local."""

    def __init__(self, path: str | None = None, *, retention_s: float = 30 * 86400,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._db = sqlite3.connect(path or ":memory:", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL" if path else "PRAGMA journal_mode=MEMORY")
        self._db.execute("CREATE TABLE IF NOT EXISTS stored_responses (tenant TEXT NOT NULL, id TEXT NOT NULL, "
                         "created REAL NOT NULL, row BLOB NOT NULL, PRIMARY KEY (tenant, id))")
        self._lock = threading.Lock()
        self._retention_s = retention_s
        self._wall_clock = wall_clock

    def keep(self, tenant: str, response: dict[str, Any], input_items: list[dict[str, Any]],
             previous_response_id: str | None) -> None:
        """Keep `response` (its `id` is the key) with the turn's input items, at once."""
        now = self._wall_clock()
        with self._lock:
            self._db.execute("DELETE FROM stored_responses WHERE created < ?", (now - self._retention_s,))
            self._db.execute("INSERT OR REPLACE INTO stored_responses VALUES (?, ?, ?, ?)",
                             (tenant, response["id"], now, _row(response, input_items, previous_response_id)))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's stored response `response_id`, or None (unknown, expired, or another tenant's)."""
        with self._lock:
            found = self._db.execute("SELECT row, created FROM stored_responses WHERE tenant = ? AND id = ?",
                                     (tenant, response_id)).fetchone()
        if found is None or found[1] < self._wall_clock() - self._retention_s:
            return None
        return _stored(found[0])

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Remove the tenant's response `response_id`; False when there was none."""
        with self._lock:
            cursor = self._db.execute("DELETE FROM stored_responses WHERE tenant = ? AND id = ?",
                                      (tenant, response_id))
        return cursor.rowcount > 0

    async def close(self) -> None:
        with self._lock:
            self._db.close()


class RedisResponseStore:
    """Stored responses in Redis, one key per tenant and id, expiring after `retention_s`. A write runs in
    the background; until it lands, this replica's reads of that id wait for it.

    Every command touches one key, so the keys carry no hash tag: in a Redis Cluster they spread over the
    shards. `redis` is any `mergebroker.redis_connect` client (one server, Sentinel, Cluster)."""

    def __init__(self, redis: Any, *, retention_s: float = 30 * 86400, prefix: str = "mb:responses:") -> None:
        self._redis = redis
        self._retention_ms = max(1, int(retention_s * 1000))
        self._prefix = prefix
        self._writes: dict[str, asyncio.Task[Any]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self._prefix}{tenant}:{response_id}"

    def keep(self, tenant: str, response: dict[str, Any], input_items: list[dict[str, Any]],
             previous_response_id: str | None) -> None:
        key = self._key(tenant, response["id"])
        write = self._redis.set(key, _row(response, input_items, previous_response_id), px=self._retention_ms)
        task = spawn(self._tasks, _logged(write, key), f"store-{response['id']}")
        self._writes[key] = task
        task.add_done_callback(lambda _: self._writes.pop(key, None))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        key = self._key(tenant, response_id)
        if (pending := self._writes.get(key)) is not None:
            await asyncio.shield(pending)
        row = await _reached(self._redis.get(key))
        return _stored(row) if row is not None else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        key = self._key(tenant, response_id)
        if (pending := self._writes.get(key)) is not None:
            await asyncio.shield(pending)
        return bool(await _reached(self._redis.delete(key)))

    async def close(self) -> None:
        """Let the writes in flight land (the Redis client itself is the engine's to close)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)


async def _logged(write: Awaitable[Any], key: str) -> None:
    try:
        await write
    except Exception as exc:  # the answer is sent already; a lost write makes its id a 404 later, said here
        log.warning("response_store_write_failed", key=key.rsplit(":", 1)[-1], error=type(exc).__name__)


async def _reached(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as exc:
        raise Overloaded("The response store (Redis) is unreachable; try again shortly.",
                         code="response_store_unavailable", retry_after=1.0) from exc


def open_response_store(backend: str, *, path: str | None, retention_s: float, redis: Any,
                        cluster: bool) -> ResponseStore:
    """The store `responses.backend` names: `auto` is Redis in cluster mode (replicas share it), else SQLite."""
    if redis is not None and (backend == "redis" or (backend == "auto" and cluster)):
        return RedisResponseStore(redis, retention_s=retention_s)
    return SqliteResponseStore(path, retention_s=retention_s)
