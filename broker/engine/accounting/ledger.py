"""The usage ledger: one `LedgerRecord` per answered request, buffered in memory and written in batches.

`Ledger.record()` is what the request path calls: synchronous, O(1), it never blocks and never raises.
A background task hands batches to a `LedgerStore` (SQLite or PostgreSQL, see `broker.engine.accounting.store`)
off the event loop, one transaction per batch. Stores insert idempotently by `request_id`, so a batch
that is written twice (retried after an ambiguous failure) is still counted once.

Token accounting (reserve-then-settle: the request path estimates `alone_prompt_tokens` up front and
settles with what the provider reported):

- miss, batch of one (passthrough): `prompt_tokens`/`completion_tokens` are the provider's usage;
  `tokens_saved` is 0.
- miss, merged (`batch_size > 1`): the merged call's usage as split among members by
  `merge.usage.apportion_usage` (the dispatcher's rule), so members' shares add up exactly to the call;
  `tokens_saved = alone_prompt_tokens - prompt_tokens`, signed, so a batch's savings add up to
  (sum of alone estimates - the call's prompt tokens) even when merging cost more (the Prometheus
  counter `tokens_saved` cannot go negative and is floored at 0 per batch instead).
- cache hit or coalesced follower: nothing was billed for it, so `prompt_tokens = completion_tokens = 0`,
  `batch_id = None`, `batch_size = 0`, and `tokens_saved = alone_prompt_tokens + the completion tokens
  of the reused answer` (what it would have cost alone). The coalescing leader is an ordinary miss.
- refused or failed: usage as reported (usually 0), `tokens_saved = 0`; `batch_size` is 0 when no
  upstream call was made for it (refused at admission), else the size of the failed call.

`saved_tokens(...)` computes `tokens_saved` by these rules; the report derives prompt and completion
savings back from a record (`prompt_tokens_saved`, `completion_tokens_saved`) to price them.

When the store fails, the ledger logs `ledger_unavailable` once, keeps the batch and retries it every
`flush_interval_s` (the store's idempotency makes that safe); meanwhile new records are dropped and
counted once `max_pending` are held. Whatever cannot be written by `stop()` is dropped and logged.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import structlog

from mergebroker import clock
from mergebroker.frozen_init import direct_init

log = structlog.get_logger(__name__)

CacheOutcome = Literal["hit", "coalesced", "miss"]
Endpoint = Literal["chat", "responses", "messages", "count_tokens", "embeddings", "shadow", "batch"]
# responses, messages, count_tokens: the Responses and Messages APIs (merged, native or translated alike);
# shadow: a merge-quality check call; batch: one line of a Batch API job (its request_id is the line's)


@direct_init  # built on every request
@dataclass(frozen=True)
class LedgerRecord:
    """What one answered request cost and saved; see the module docstring for the token rules."""

    request_id: str
    ts: float
    tenant: str
    tier: str
    model: str
    batch_id: str | None
    batch_size: int
    cache: CacheOutcome
    prompt_tokens: int
    completion_tokens: int
    alone_prompt_tokens: int
    tokens_saved: int
    status: int
    latency_ms: float
    endpoint: Endpoint
    # Added in 0.2 (older ledgers read them as their defaults): the prompt's parts the provider reported as
    # read from / written to its prompt cache; usage the broker counted because the provider sent none; and
    # dollars (None: the model has no price): what the request cost, and what it would have cost sent alone
    # with the provider's prompt cache.
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    usage_counted: bool = False
    actual_usd: float | None = None
    alone_usd: float | None = None

    @property
    def prompt_tokens_saved(self) -> int:
        """Prompt tokens not billed compared with sending this request alone."""
        if self.status >= 400 or (self.cache == "miss" and self.batch_size <= 1):
            return 0
        return self.alone_prompt_tokens - self.prompt_tokens

    @property
    def completion_tokens_saved(self) -> int:
        """Completion tokens not billed (non-zero only for cache hits and coalesced followers)."""
        return self.tokens_saved - self.prompt_tokens_saved

    @property
    def merged(self) -> bool:
        """True when an upstream call shared with other requests answered it."""
        return self.cache == "miss" and self.batch_size > 1

    @property
    def made_call(self) -> bool:
        """True when an upstream call (its own or a shared one) was made for this request."""
        return self.cache == "miss" and self.batch_size >= 1


def saved_tokens(cache: CacheOutcome, batch_size: int, alone_prompt_tokens: int, prompt_tokens: int,
                 reused_completion_tokens: int = 0, status: int = 200) -> int:
    """`tokens_saved` for a record, by the rules in the module docstring."""
    if status >= 400:
        return 0
    if cache != "miss":
        return alone_prompt_tokens + reused_completion_tokens
    if batch_size > 1:
        return alone_prompt_tokens - prompt_tokens
    return 0


class LedgerStore(Protocol):
    """Durable storage for ledger records.

    Contract:
    - `write` inserts a batch in one transaction, ignoring records whose `request_id` is already
      stored, and returns how many rows were new. It may raise anything on failure; the `Ledger`
      treats every exception as "store unavailable" and retries the batch later.
    - `query` returns records with `ts >= since_ts` (all when None) for `tenant` (all when None),
      oldest first.
    - Neither blocks the event loop. `close` releases connections; the store may be reopened by use.
    """

    async def write(self, records: Sequence[LedgerRecord]) -> int: ...

    async def query(self, since_ts: float | None = None, tenant: str | None = None) -> list[LedgerRecord]: ...

    async def close(self) -> None: ...


class MemoryLedgerStore:
    """An in-memory `LedgerStore` for unit tests; set `fail` to an exception to simulate an outage."""

    def __init__(self) -> None:
        self.rows: dict[str, LedgerRecord] = {}
        self.writes = 0
        self.fail: Exception | None = None

    async def write(self, records: Sequence[LedgerRecord]) -> int:
        if self.fail is not None:
            raise self.fail
        self.writes += 1
        new = 0
        for rec in records:
            if rec.request_id not in self.rows:
                self.rows[rec.request_id] = rec
                new += 1
        return new

    async def query(self, since_ts: float | None = None, tenant: str | None = None) -> list[LedgerRecord]:
        return sorted((r for r in self.rows.values()
                       if (since_ts is None or r.ts >= since_ts) and (tenant is None or r.tenant == tenant)),
                      key=lambda r: r.ts)

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class LedgerStats:
    """Counters of one `Ledger` since it was built."""

    pending: int
    written: int
    dropped: int
    failed_writes: int
    available: bool


class Ledger:
    """Buffers records from the request path and flushes them to a `LedgerStore` in the background.

    Records are flushed every `flush_interval_s`, or as soon as `max_batch` are pending, in batches of
    at most `max_batch`. At most `max_pending` records are held (including a batch being written);
    beyond that `record()` drops and counts. `record()` must be called from the event loop's thread.
    """

    def __init__(self, store: LedgerStore, *, flush_interval_s: float = 1.0, max_batch: int = 500,
                 max_pending: int = 100_000, sleep: clock.Sleep = clock.sleep) -> None:
        if max_batch < 1 or max_pending < max_batch:
            raise ValueError("need 1 <= max_batch <= max_pending")
        self._store = store
        self._interval = flush_interval_s
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._sleep = sleep
        self._pending: deque[LedgerRecord] = deque()
        self._in_flight = 0
        self._wake = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = False
        self._available = True
        self._full_logged = False
        self._written = 0
        self._dropped = 0
        self._failed_writes = 0

    @property
    def stats(self) -> LedgerStats:
        """A snapshot of the ledger's counters."""
        return LedgerStats(len(self._pending) + self._in_flight, self._written, self._dropped,
                           self._failed_writes, self._available)

    def record(self, rec: LedgerRecord) -> None:
        """Queue one record for writing; drops (and counts) it when the buffer is full or stopped."""
        if self._stopped or len(self._pending) + self._in_flight >= self._max_pending:
            self._dropped += 1
            if not self._full_logged:
                self._full_logged = True
                log.warning("ledger_full", max_pending=self._max_pending, stopped=self._stopped)
            return
        self._pending.append(rec)
        # While the store is down, a full batch must not wake the flusher: it retries on its interval.
        if self._available and len(self._pending) >= self._max_batch:
            self._wake.set()

    async def start(self) -> None:
        """Start the background flusher."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="ledger-flusher")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Flush what is pending (within `timeout_s`), stop the flusher and close the store."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=timeout_s)
            if not done:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        else:
            await self.flush()
        self._stopped = True
        if self._pending:
            self._dropped += len(self._pending)
            log.warning("ledger_dropped", records=len(self._pending))
            self._pending.clear()
        try:
            await self._store.close()
        except Exception as exc:  # closing a broken store must not fail shutdown
            log.warning("ledger_close_failed", error=type(exc).__name__)

    async def flush(self) -> int:
        """Write everything pending now, in batches; returns rows newly stored. Stops at the first failure."""
        written = 0
        async with self._write_lock:
            while self._pending:
                batch = [self._pending.popleft() for _ in range(min(self._max_batch, len(self._pending)))]
                self._in_flight = len(batch)
                try:
                    written += await self._store.write(batch)
                except asyncio.CancelledError:
                    self._pending.extendleft(reversed(batch))
                    raise
                except Exception as exc:  # any store failure: keep the batch, report once
                    self._pending.extendleft(reversed(batch))
                    self._mark_unavailable(exc)
                    break
                finally:
                    self._in_flight = 0
                self._mark_available()
        self._written += written
        return written

    async def _run(self) -> None:
        while not self._stopping:
            await self._wait()
            await self.flush()
        await self.flush()

    async def _wait(self) -> None:
        """Until the interval passes, a full batch is pending, or stop() is called."""
        await clock.sleep_or_event(self._sleep, self._interval, self._wake)
        if not self._stopping:
            self._wake.clear()

    def _mark_unavailable(self, exc: Exception) -> None:
        self._failed_writes += 1
        if self._available:
            self._available = False
            log.warning("ledger_unavailable", error=type(exc).__name__, detail=str(exc)[:200],
                        pending=len(self._pending))

    def _mark_available(self) -> None:
        self._full_logged = False
        if not self._available:
            self._available = True
            log.info("ledger_recovered", pending=len(self._pending))
