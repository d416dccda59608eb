"""The broker's own store of Responses API responses, per tenant: `store`, `previous_response_id`, and
`GET`/`DELETE /v1/responses/{id}` work on every upstream, and a chain continues on whichever upstream
serves its next turn.

Each stored response keeps its input items (the turn's own), its output items and the id it continued;
a chain's history is rebuilt by walking those ids. Rows live in SQLite (a file, or memory when no path
is set), keyed by tenant and id, so another tenant's id is simply not found. Rows older than
`retention_s` are removed as new ones are written.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from mergebroker import jsonio

MAX_CHAIN = 1000
"""The longest chain of `previous_response_id` followed (a guard against a cycle in a corrupt store)."""


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the Response object, the turn's input items, and the id it continued."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous_response_id: str | None


class ResponseStore:
    """Stored responses in SQLite (see the module docstring). Thread-safe; calls are short and local."""

    def __init__(self, path: str | None = None, *, retention_s: float = 30 * 86400,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._db = sqlite3.connect(path or ":memory:", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL" if path else "PRAGMA journal_mode=MEMORY")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses (tenant TEXT NOT NULL, id TEXT NOT NULL, "
                         "created REAL NOT NULL, previous TEXT, response BLOB NOT NULL, input BLOB NOT NULL, "
                         "PRIMARY KEY (tenant, id))")
        self._lock = threading.Lock()
        self._retention_s = retention_s
        self._wall_clock = wall_clock

    def put(self, tenant: str, response: dict[str, Any], input_items: list[dict[str, Any]],
            previous_response_id: str | None) -> None:
        """Keep `response` (its `id` is the key) with the turn's input items."""
        now = self._wall_clock()
        with self._lock:
            self._db.execute("DELETE FROM responses WHERE created < ?", (now - self._retention_s,))
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                             (tenant, response["id"], now, previous_response_id, jsonio.dumps(response),
                              jsonio.dumps(input_items)))

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's stored response `response_id`, or None (unknown, expired, or another tenant's)."""
        with self._lock:
            row = self._db.execute("SELECT response, input, previous, created FROM responses "
                                   "WHERE tenant = ? AND id = ?", (tenant, response_id)).fetchone()
        if row is None or row[3] < self._wall_clock() - self._retention_s:
            return None
        return StoredResponse(jsonio.loads(row[0]), jsonio.loads(row[1]), row[2])

    def delete(self, tenant: str, response_id: str) -> bool:
        """Remove the tenant's response `response_id`; False when there was none."""
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
        return cursor.rowcount > 0

    def history(self, tenant: str, response_id: str) -> list[dict[str, Any]] | None:
        """The items a turn continuing `response_id` is preceded by: every earlier turn's input and
        output items, oldest first; None when `response_id` is not the tenant's."""
        turns: list[StoredResponse] = []
        current: str | None = response_id
        while current is not None and len(turns) < MAX_CHAIN:
            stored = self.get(tenant, current)
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

    def close(self) -> None:
        """Close the database."""
        self._db.close()
