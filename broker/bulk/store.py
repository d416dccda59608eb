"""Durable state of the Batch API: file records, batches, per-line results and upstream rounds, in SQLite.

One database file (`batches.sqlite3` in the batch directory) with four tables. A line's result is written
once (`INSERT OR IGNORE` on `(batch_id, custom_id)`) as soon as it is known, so a broker restarted
mid-batch resumes with the lines still unanswered and never sends finished work again; a finished batch's
results are read back a page at a time (its files are written from them) and then dropped. Cursors page
a tenant's rows by its own IDs only: another tenant's ID reads like an unknown one. A round sent
through a provider's Batch API is recorded (its upstream batch ID and its plan) before it is polled, so a
restart polls that upstream batch instead of submitting a second one. Work runs in a worker thread under
a lock, off the event loop, as the ledger's SQLite store does.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, lines INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, tier TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, data TEXT NOT NULL, caller TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_at);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, status_code INTEGER NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (batch_id, custom_id)
);
CREATE TABLE IF NOT EXISTS rounds (
    batch_id TEXT NOT NULL, round INTEGER NOT NULL, provider TEXT NOT NULL, upstream_id TEXT NOT NULL,
    calls TEXT NOT NULL, done INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, round, provider)
);
"""

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(frozen=True)
class FileRecord:
    """One stored file's metadata (its bytes live on disk beside the database)."""

    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int
    lines: int


@dataclass(frozen=True)
class BatchRow:
    """One batch: its owner, the tier it runs in, its OpenAI batch object (`data`), and the caller who created
    it (`broker.engine.limits.admission.Caller`'s fields: its key's limits keep applying to the job)."""

    id: str
    tenant: str
    tier: str
    data: dict[str, Any]
    caller: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UpstreamRound:
    """One round sent through a provider's Batch API: where it went and the plan its results map back to."""

    round: int
    provider: str
    upstream_id: str
    calls: list[dict[str, Any]]


class BatchStore:
    """The Batch API's SQLite database at `path` (created with its tables on first use)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._conn.close()

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def locked() -> T:
            with self._lock, self._conn:  # one transaction per call
                result = fn(self._conn)
                if isinstance(result, sqlite3.Cursor):
                    # Closed here, under the lock: a cursor dropped later on the loop's thread finalizes its
                    # statement while another thread uses the connection (sqlite3 "API misuse", seen under load).
                    result.close()
                    return None  # type: ignore[return-value]
                return result
        return await asyncio.to_thread(locked)

    async def add_file(self, record: FileRecord) -> None:
        """Store a file's metadata."""
        await self._run(lambda c: c.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)", astuple(record)))

    async def file(self, file_id: str) -> FileRecord | None:
        """A file's metadata, whoever owns it."""
        rows = await self._run(lambda c: c.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchall())
        return FileRecord(*rows[0]) if rows else None

    async def files(self, tenant: str, *, purpose: str | None, after: str | None, limit: int) -> list[FileRecord]:
        """A tenant's files, newest first, starting after the file `after` (cursor pagination)."""
        def query(c: sqlite3.Connection) -> list[Any]:
            sql, args = "SELECT * FROM files WHERE tenant = ?", [tenant]
            if purpose:
                sql, args = sql + " AND purpose = ?", [*args, purpose]
            if after:  # the cursor is looked up among the tenant's own files: another's ID is an unknown one
                sql += " AND (created_at, id) < (SELECT created_at, id FROM files WHERE id = ? AND tenant = ?)"
                args += [after, tenant]
            return c.execute(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", (*args, limit)).fetchall()
        return [FileRecord(*r) for r in await self._run(query)]

    async def file_ids(self) -> set[str]:
        """Every stored file's ID."""
        return {r[0] for r in await self._run(lambda c: c.execute("SELECT id FROM files").fetchall())}

    async def expired_files(self, now: int) -> list[FileRecord]:
        """Files whose expiry has passed."""
        rows = await self._run(lambda c: c.execute("SELECT * FROM files WHERE expires_at <= ?", (now,)).fetchall())
        return [FileRecord(*r) for r in rows]

    async def delete_file(self, file_id: str) -> None:
        """Forget a file's metadata."""
        await self._run(lambda c: c.execute("DELETE FROM files WHERE id = ?", (file_id,)))

    async def put_batch(self, row: BatchRow) -> None:
        """Insert or replace a batch."""
        values = (row.id, row.tenant, row.tier, row.data["status"], row.data["created_at"], json.dumps(row.data),
                  json.dumps(row.caller))
        await self._run(lambda c: c.execute("INSERT OR REPLACE INTO batches VALUES (?, ?, ?, ?, ?, ?, ?)", values))

    async def batch(self, batch_id: str) -> BatchRow | None:
        """A batch, whoever owns it."""
        rows = await self._run(lambda c: c.execute("SELECT id, tenant, tier, data, caller FROM batches WHERE id = ?",
                                                   (batch_id,)).fetchall())
        return _batch_row(rows[0]) if rows else None

    async def batches(self, tenant: str, *, after: str | None, limit: int) -> list[BatchRow]:
        """A tenant's batches, newest first, starting after the batch `after` (cursor pagination)."""
        def query(c: sqlite3.Connection) -> list[Any]:
            sql, args = "SELECT id, tenant, tier, data, caller FROM batches WHERE tenant = ?", [tenant]
            if after:  # the cursor is looked up among the tenant's own batches: another's ID is an unknown one
                sql += " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ? AND tenant = ?)"
                args += [after, tenant]
            return c.execute(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", (*args, limit)).fetchall()
        return [_batch_row(r) for r in await self._run(query)]

    async def active_batches(self) -> list[BatchRow]:
        """Every batch not yet in a final state (to resume after a restart)."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        rows = await self._run(lambda c: c.execute(f"SELECT id, tenant, tier, data, caller FROM batches WHERE status IN "
                                                   f"({marks}) ORDER BY created_at", ACTIVE_STATUSES).fetchall())
        return [_batch_row(r) for r in rows]

    async def add_results(self, batch_id: str, results: list[tuple[str, int, dict[str, Any]]]) -> None:
        """Record lines' results (custom_id, HTTP status, body); a line already answered keeps its first."""
        rows = [(batch_id, cid, status, json.dumps(body)) for cid, status, body in results]
        await self._run(lambda c: c.executemany("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)", rows))

    async def answered(self, batch_id: str) -> dict[str, bool]:
        """Which lines of a batch have a result, and whether it is a success: custom_id -> status < 300."""
        rows = await self._run(lambda c: c.execute("SELECT custom_id, status_code < 300 FROM results "
                                                   "WHERE batch_id = ?", (batch_id,)).fetchall())
        return {cid: bool(ok) for cid, ok in rows}

    async def result_page(self, batch_id: str, *, after: int, limit: int) -> list[tuple[int, str, int, str]]:
        """Up to `limit` results of a batch past row `after`, in the order they were recorded:
        (row, custom_id, status, body as JSON text). Pages keep a large batch's results out of memory."""
        return await self._run(lambda c: c.execute(
            "SELECT rowid, custom_id, status_code, body FROM results WHERE batch_id = ? AND rowid > ? "
            "ORDER BY rowid LIMIT ?", (batch_id, after, limit)).fetchall())

    async def forget_results(self, batch_id: str) -> None:
        """Drop a finished batch's results and rounds (its output and error files hold them now)."""
        def forget(c: sqlite3.Connection) -> None:
            c.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
            c.execute("DELETE FROM rounds WHERE batch_id = ?", (batch_id,))
        await self._run(forget)

    async def put_round(self, batch_id: str, found: UpstreamRound) -> None:
        """Record a round submitted to a provider's Batch API."""
        values = (batch_id, found.round, found.provider, found.upstream_id, json.dumps(found.calls))
        await self._run(lambda c: c.execute("INSERT OR REPLACE INTO rounds (batch_id, round, provider, upstream_id, "
                                            "calls) VALUES (?, ?, ?, ?, ?)", values))

    async def open_rounds(self, batch_id: str) -> list[UpstreamRound]:
        """The batch's upstream rounds not yet mapped back."""
        rows = await self._run(lambda c: c.execute("SELECT round, provider, upstream_id, calls FROM rounds WHERE "
                                                   "batch_id = ? AND done = 0 ORDER BY round", (batch_id,)).fetchall())
        return [UpstreamRound(r, p, u, json.loads(calls)) for r, p, u, calls in rows]

    async def rounds_started(self, batch_id: str) -> int:
        """The next round's number: one past the highest the batch has submitted (0 when none)."""
        rows = await self._run(lambda c: c.execute("SELECT COALESCE(MAX(round) + 1, 0) FROM rounds WHERE batch_id = ?",
                                                   (batch_id,)).fetchall())
        return int(rows[0][0])

    async def finish_round(self, batch_id: str, found: UpstreamRound) -> None:
        """Mark an upstream round (one provider's part of a round) as mapped back."""
        await self._run(lambda c: c.execute("UPDATE rounds SET done = 1 WHERE batch_id = ? AND round = ? AND "
                                            "provider = ?", (batch_id, found.round, found.provider)))

def _batch_row(row: Any) -> BatchRow:
    return BatchRow(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]))
