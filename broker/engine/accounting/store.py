"""Durable `LedgerStore`s: SQLite (stdlib, written from a worker thread) and PostgreSQL (asyncpg, optional).

Both keep one table, `ledger`, keyed by `request_id` and indexed on `ts` and `(tenant, ts)`; inserts use
`ON CONFLICT (request_id) DO NOTHING`, so a replayed record is stored once. Failures are translated to
`LedgerStoreError` at this boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import sqlite3
import threading
from collections.abc import Sequence
from typing import Any

from mergebroker.broker.engine.accounting.ledger import LedgerRecord, LedgerStore

COLUMNS = tuple(f.name for f in dataclasses.fields(LedgerRecord))

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    request_id TEXT PRIMARY KEY,
    ts REAL NOT NULL,
    tenant TEXT NOT NULL,
    tier TEXT NOT NULL,
    model TEXT NOT NULL,
    batch_id TEXT,
    batch_size INTEGER NOT NULL,
    cache TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    alone_prompt_tokens INTEGER NOT NULL,
    tokens_saved INTEGER NOT NULL,
    status INTEGER NOT NULL,
    latency_ms REAL NOT NULL,
    endpoint TEXT NOT NULL,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    usage_counted INTEGER NOT NULL DEFAULT 0,
    actual_usd REAL,
    alone_usd REAL
);
CREATE INDEX IF NOT EXISTS ledger_ts ON ledger (ts);
CREATE INDEX IF NOT EXISTS ledger_tenant_ts ON ledger (tenant, ts);
"""

_ADDED_COLUMNS = {"cached_tokens": "INTEGER NOT NULL DEFAULT 0", "cache_write_tokens": "INTEGER NOT NULL DEFAULT 0",
                  "usage_counted": "INTEGER NOT NULL DEFAULT 0", "actual_usd": "REAL", "alone_usd": "REAL"}
"""Columns newer than the first schema: added in place to a ledger written by an older broker."""

_PG_SCHEMA = _SQLITE_SCHEMA.replace("REAL", "DOUBLE PRECISION").replace("INTEGER", "BIGINT") + "".join(
    f"ALTER TABLE ledger ADD COLUMN IF NOT EXISTS {name} "
    f"{kind.replace('REAL', 'DOUBLE PRECISION').replace('INTEGER', 'BIGINT')};\n"
    for name, kind in _ADDED_COLUMNS.items())

_PG_TYPES = {"ts": "float8", "latency_ms": "float8", "batch_size": "int8", "prompt_tokens": "int8",
             "completion_tokens": "int8", "alone_prompt_tokens": "int8", "tokens_saved": "int8", "status": "int8",
             "cached_tokens": "int8", "cache_write_tokens": "int8", "usage_counted": "int8", "actual_usd": "float8",
             "alone_usd": "float8"}


class LedgerStoreError(Exception):
    """The ledger's database could not be opened, written or read."""


def open_store(target: str) -> LedgerStore:
    """A store for `target`: a `postgres://` / `postgresql://` DSN, otherwise a SQLite file path."""
    if target.startswith(("postgres://", "postgresql://")):
        return PostgresLedgerStore(target)
    return SqliteLedgerStore(target)


def _row_to_record(row: Sequence[Any]) -> LedgerRecord:
    fields = dict(zip(COLUMNS, row))
    fields["usage_counted"] = bool(fields["usage_counted"])
    return LedgerRecord(**fields)


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    """Bring a ledger written by an older broker up to this schema (new columns take their defaults)."""
    present = {row[1] for row in conn.execute("PRAGMA table_info(ledger)")}
    for name, kind in _ADDED_COLUMNS.items():
        if name not in present:
            conn.execute(f"ALTER TABLE ledger ADD COLUMN {name} {kind}")


def _where(since_ts: float | None, tenant: str | None, placeholder: str) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    args: list[Any] = []
    if since_ts is not None:
        args.append(since_ts)
        clauses.append(f"ts >= {placeholder.format(len(args))}")
    if tenant is not None:
        args.append(tenant)
        clauses.append(f"tenant = {placeholder.format(len(args))}")
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), args


class SqliteLedgerStore:
    """A SQLite ledger at `path`; the file, table and indexes are created on first use, off the loop.

    One connection is shared by worker threads under a lock, in WAL mode so that `mergebroker report`
    can read while the broker writes.
    """

    def __init__(self, path: str, *, busy_timeout_s: float = 5.0) -> None:
        self._path = path
        self._busy_timeout_s = busy_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    async def write(self, records: Sequence[LedgerRecord]) -> int:
        """Insert `records` in one transaction; returns how many were new."""
        rows = [dataclasses.astuple(r) for r in records]
        return await asyncio.to_thread(self._locked, self._write_sync, rows)

    async def query(self, since_ts: float | None = None, tenant: str | None = None) -> list[LedgerRecord]:
        """Records since `since_ts` for `tenant` (None: all), oldest first."""
        return await asyncio.to_thread(self._locked, self._query_sync, since_ts, tenant)

    async def close(self) -> None:
        """Close the connection; the next call reopens it."""
        await asyncio.to_thread(self._locked, self._close_sync)

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            try:
                return fn(*args)
            except (sqlite3.Error, OSError) as exc:
                self._close_sync()
                raise LedgerStoreError(f"sqlite ledger {self._path}: {exc}") from exc

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self._path, timeout=self._busy_timeout_s, check_same_thread=False)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(_SQLITE_SCHEMA)
                _add_missing_columns(conn)
            except sqlite3.Error:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _write_sync(self, rows: list[tuple[Any, ...]]) -> int:
        conn = self._connection()
        placeholders = ", ".join("?" for _ in COLUMNS)
        with conn:  # one transaction per batch: commit on success, roll back on error
            before = conn.total_changes
            conn.executemany(f"INSERT INTO ledger ({', '.join(COLUMNS)}) VALUES ({placeholders}) "
                             "ON CONFLICT(request_id) DO NOTHING", rows)
            return conn.total_changes - before

    def _query_sync(self, since_ts: float | None, tenant: str | None) -> list[LedgerRecord]:
        where, args = _where(since_ts, tenant, "?")
        cur = self._connection().execute(f"SELECT {', '.join(COLUMNS)} FROM ledger{where} ORDER BY ts", args)
        return [_row_to_record(row) for row in cur.fetchall()]

    def _close_sync(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class PostgresLedgerStore:
    """A PostgreSQL ledger reached through asyncpg (`pip install 'mergebroker[postgres]'`).

    asyncpg is imported only when the first call connects; a missing module is reported at construction.
    Each batch is one `INSERT ... SELECT FROM unnest(...)` statement, hence one transaction.
    """

    def __init__(self, dsn: str, *, pool_size: int = 2) -> None:
        if importlib.util.find_spec("asyncpg") is None:
            raise ModuleNotFoundError("PostgresLedgerStore needs asyncpg: pip install 'mergebroker[postgres]'")
        self._dsn = dsn
        self._pool_size = pool_size
        self._pool: Any = None
        self._connect_lock = asyncio.Lock()

    async def write(self, records: Sequence[LedgerRecord]) -> int:
        """Insert `records` in one statement; returns how many were new."""
        columns = [list(col) for col in zip(*(dataclasses.astuple(r) for r in records))]
        if not columns:
            return 0
        arrays = ", ".join(f"${i}::{_PG_TYPES.get(name, 'text')}[]" for i, name in enumerate(COLUMNS, 1))
        sql = (f"INSERT INTO ledger ({', '.join(COLUMNS)}) SELECT * FROM unnest({arrays}) "
               "ON CONFLICT (request_id) DO NOTHING")
        status = await self._call("execute", sql, *columns)
        return int(str(status).rsplit(" ", 1)[-1])

    async def query(self, since_ts: float | None = None, tenant: str | None = None) -> list[LedgerRecord]:
        """Records since `since_ts` for `tenant` (None: all), oldest first."""
        where, args = _where(since_ts, tenant, "${}")
        rows = await self._call("fetch", f"SELECT {', '.join(COLUMNS)} FROM ledger{where} ORDER BY ts", *args)
        return [_row_to_record(tuple(row)) for row in rows]

    async def close(self) -> None:
        """Close the pool; the next call reconnects."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def _call(self, method: str, sql: str, *args: Any) -> Any:
        try:
            pool = await self._ensure_pool()
            async with pool.acquire() as conn:
                return await getattr(conn, method)(sql, *args)
        except (TimeoutError, OSError) as exc:
            raise LedgerStoreError(f"postgres ledger: {type(exc).__name__}") from exc
        except Exception as exc:
            import asyncpg

            if isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError):
                raise LedgerStoreError(f"postgres ledger: {type(exc).__name__}") from exc
            raise

    async def _ensure_pool(self) -> Any:
        async with self._connect_lock:
            if self._pool is None:
                import asyncpg

                pool = await asyncpg.create_pool(self._dsn, min_size=1, max_size=self._pool_size)
                async with pool.acquire() as conn:
                    await conn.execute(_PG_SCHEMA)
                self._pool = pool
            return self._pool
