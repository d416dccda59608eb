"""The usage ledger records every answered request once, adds up per batch, and never lets a store failure reach requests."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest
from structlog.testing import capture_logs

from mergebroker.broker.engine.accounting.ledger import Ledger, LedgerRecord, MemoryLedgerStore, saved_tokens
from mergebroker.broker.engine.accounting.store import LedgerStoreError, SqliteLedgerStore, open_store
from mergebroker.merge.usage import apportion_usage
from mergebroker.token_usage import TokenUsage


def rec(request_id: str, **fields: object) -> LedgerRecord:
    base: dict[str, object] = dict(
        ts=1_700_000_000.0, tenant="acme", tier="standard", model="gpt-4o-mini", batch_id=None, batch_size=1,
        cache="miss", prompt_tokens=10, completion_tokens=5, alone_prompt_tokens=10, tokens_saved=0,
        status=200, latency_ms=12.5, endpoint="chat")
    base.update(fields)
    return LedgerRecord(request_id=request_id, **base)  # type: ignore[arg-type]


def merged_batch(batch_id: str, call_prompt: int, call_completion: int, own: list[int], alone: list[int],
                 answers: list[int]) -> list[LedgerRecord]:
    """Members of one merged call, with the provider's usage apportioned as the dispatcher does."""
    ids = [f"{batch_id}-{i}" for i in range(len(own))]
    usage = apportion_usage(TokenUsage(call_prompt, call_completion), member_prompt_tokens=dict(zip(ids, own)),
                            member_completion_weights=dict(zip(ids, answers)))
    return [rec(i, batch_id=batch_id, batch_size=len(ids), prompt_tokens=usage[i].prompt_tokens,
                completion_tokens=usage[i].completion_tokens, alone_prompt_tokens=a,
                tokens_saved=saved_tokens("miss", len(ids), a, usage[i].prompt_tokens))
            for i, a in zip(ids, alone)]


class GatedSleep:
    """A sleep that returns only when the test releases it, so interval flushes happen on cue."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self._release = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.started.set()
        await self._release.wait()
        self._release.clear()

    def release(self) -> None:
        self._release.set()


class SignallingStore(MemoryLedgerStore):
    """The in-memory store, plus an event set after each write."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = asyncio.Event()

    async def write(self, records):  # type: ignore[no-untyped-def]
        try:
            return await super().write(records)
        finally:
            self.wrote.set()


def test_saved_tokens_follow_the_documented_rules() -> None:
    assert saved_tokens("miss", 3, alone_prompt_tokens=100, prompt_tokens=84) == 16
    assert saved_tokens("miss", 1, alone_prompt_tokens=100, prompt_tokens=100) == 0
    assert saved_tokens("hit", 0, alone_prompt_tokens=40, prompt_tokens=0, reused_completion_tokens=10) == 50
    assert saved_tokens("coalesced", 0, 60, 0, reused_completion_tokens=30) == 90
    assert saved_tokens("miss", 3, 100, 0, status=502) == 0


async def test_merged_cached_coalesced_and_failed_records_add_up_in_sqlite(tmp_path) -> None:
    store = SqliteLedgerStore(str(tmp_path / "ledger.db"))
    ledger = Ledger(store, flush_interval_s=3600)
    # Alone, each member costs a 40-token system prompt plus its own text (60/80/40 -> 100/120/80); merged,
    # the system prompt and a header are sent once (250 - 180 own = 70 shared), saving 300 - 250 = 50.
    batch = merged_batch("b1", call_prompt=250, call_completion=300, own=[60, 80, 40], alone=[100, 120, 80],
                         answers=[90, 110, 100])
    others = [
        rec("hit", cache="hit", batch_size=0, prompt_tokens=0, completion_tokens=0, alone_prompt_tokens=40,
            tokens_saved=saved_tokens("hit", 0, 40, 0, reused_completion_tokens=10)),
        rec("follower", cache="coalesced", batch_size=0, prompt_tokens=0, completion_tokens=0,
            alone_prompt_tokens=60, tokens_saved=saved_tokens("coalesced", 0, 60, 0, reused_completion_tokens=30)),
        rec("failed", status=502, prompt_tokens=0, completion_tokens=0, alone_prompt_tokens=50),
    ]
    await ledger.start()
    for r in batch + others:
        ledger.record(r)
    await ledger.stop()

    stored = {r.request_id: r for r in await SqliteLedgerStore(str(tmp_path / "ledger.db")).query()}
    members = [stored[f"b1-{i}"] for i in range(3)]
    assert sum(m.prompt_tokens for m in members) == 250
    assert sum(m.completion_tokens for m in members) == 300
    assert sum(m.tokens_saved for m in members) == 300 - 250 == 50
    assert [m.prompt_tokens for m in members] == [84, 103, 63]
    assert [m.prompt_tokens_saved for m in members] == [m.alone_prompt_tokens - m.prompt_tokens for m in members]
    assert stored["hit"].prompt_tokens_saved == 40 and stored["hit"].completion_tokens_saved == 10
    assert stored["follower"].tokens_saved == 90
    assert stored["failed"].status == 502 and stored["failed"].tokens_saved == 0
    assert stored["hit"] == others[0]
    assert ledger.stats.written == 6 and ledger.stats.dropped == 0


async def test_a_replayed_request_id_is_stored_once(tmp_path) -> None:
    path = str(tmp_path / "ledger.db")
    ledger = Ledger(SqliteLedgerStore(path), flush_interval_s=3600)
    await ledger.start()
    ledger.record(rec("r1"))
    ledger.record(rec("r1", prompt_tokens=999))
    await ledger.flush()
    ledger.record(rec("r1", prompt_tokens=555))
    await ledger.stop()

    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT request_id, prompt_tokens FROM ledger").fetchall()
    assert rows == [("r1", 10)]
    assert ledger.stats.written == 1


async def test_the_store_ignores_a_batch_written_twice(tmp_path) -> None:
    store = open_store(str(tmp_path / "ledger.db"))
    batch = [rec("a"), rec("b")]
    assert await store.write(batch) == 2
    assert await store.write(batch) == 0
    assert [r.request_id for r in await store.query()] == ["a", "b"]
    await store.close()


async def test_query_filters_by_time_and_tenant(tmp_path) -> None:
    store = SqliteLedgerStore(str(tmp_path / "ledger.db"))
    await store.write([rec("old", ts=100.0), rec("new", ts=200.0), rec("other", ts=300.0, tenant="beta")])
    assert [r.request_id for r in await store.query(since_ts=150.0)] == ["new", "other"]
    assert [r.request_id for r in await store.query(tenant="acme")] == ["old", "new"]
    assert [r.request_id for r in await store.query(since_ts=150.0, tenant="acme")] == ["new"]
    await store.close()


async def test_an_unwritable_ledger_never_reaches_requests_and_warns_once(tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    store = SqliteLedgerStore(str(blocker / "ledger.db"))
    sleep = GatedSleep()
    ledger = Ledger(store, flush_interval_s=1.0, max_batch=2, max_pending=4, sleep=sleep)
    with capture_logs() as logs:
        await ledger.start()
        ledger.record(rec("r1"))
        assert await ledger.flush() == 0
        for i in range(2, 10):
            started = time.perf_counter()
            ledger.record(rec(f"r{i}"))
            assert time.perf_counter() - started < 0.01
        await sleep.started.wait()
        sleep.release()  # one interval: the flusher retries and fails again, silently
        assert await ledger.flush() == 0
        await ledger.stop(timeout_s=5)

    unavailable = [e for e in logs if e["event"] == "ledger_unavailable"]
    assert len(unavailable) == 1 and unavailable[0]["log_level"] == "warning"
    assert unavailable[0]["error"] == "LedgerStoreError"
    stats = ledger.stats
    assert stats.available is False and stats.written == 0 and stats.failed_writes >= 2
    assert stats.dropped == 9 and stats.pending == 0  # 5 over the bound, then 4 left unwritten at stop


async def test_the_store_error_is_translated_at_the_boundary(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LedgerStoreError) as info:
        await SqliteLedgerStore(str(blocker / "ledger.db")).write([rec("r1")])
    assert isinstance(info.value.__cause__, sqlite3.Error)


async def test_records_kept_through_an_outage_are_written_once_the_store_recovers() -> None:
    store = MemoryLedgerStore()
    store.fail = ConnectionError("database down")
    ledger = Ledger(store, flush_interval_s=3600)
    with capture_logs() as logs:
        ledger.record(rec("r1"))
        ledger.record(rec("r2"))
        assert await ledger.flush() == 0
        assert await ledger.flush() == 0
        store.fail = None
        assert await ledger.flush() == 2
    assert set(store.rows) == {"r1", "r2"}
    assert [e["event"] for e in logs] == ["ledger_unavailable", "ledger_recovered"]


async def test_a_full_batch_is_flushed_without_waiting_for_the_interval() -> None:
    store = SignallingStore()
    sleep = GatedSleep()  # never released: only a full batch can trigger the write
    ledger = Ledger(store, flush_interval_s=3600, max_batch=3, sleep=sleep)
    await ledger.start()
    ledger.record(rec("r1"))
    ledger.record(rec("r2"))
    await sleep.started.wait()
    assert store.writes == 0
    ledger.record(rec("r3"))
    await asyncio.wait_for(store.wrote.wait(), timeout=5)
    assert set(store.rows) == {"r1", "r2", "r3"}
    await ledger.stop()


async def test_pending_records_are_flushed_when_the_interval_passes() -> None:
    store = SignallingStore()
    sleep = GatedSleep()
    ledger = Ledger(store, flush_interval_s=1.0, max_batch=100, sleep=sleep)
    await ledger.start()
    ledger.record(rec("r1"))
    await sleep.started.wait()
    assert store.writes == 0
    sleep.release()
    await asyncio.wait_for(store.wrote.wait(), timeout=5)
    assert set(store.rows) == {"r1"}
    await ledger.stop()


async def test_stop_flushes_what_is_pending_in_batches() -> None:
    store = MemoryLedgerStore()
    ledger = Ledger(store, flush_interval_s=3600, max_batch=4, sleep=GatedSleep())
    await ledger.start()
    for i in range(3):
        ledger.record(rec(f"r{i}"))
    await ledger.stop()
    assert len(store.rows) == 3 and store.writes == 1
    ledger.record(rec("late"))
    assert "late" not in store.rows and ledger.stats.dropped == 1


async def test_record_drops_and_counts_beyond_max_pending() -> None:
    store = MemoryLedgerStore()
    ledger = Ledger(store, max_batch=2, max_pending=3)
    with capture_logs() as logs:
        for i in range(6):
            ledger.record(rec(f"r{i}"))
    assert ledger.stats.pending == 3 and ledger.stats.dropped == 3
    assert [e["event"] for e in logs] == ["ledger_full"]
    assert await ledger.flush() == 3
    assert set(store.rows) == {"r0", "r1", "r2"}


async def test_a_ledger_written_by_an_older_broker_gains_the_new_columns_and_keeps_its_rows(tmp_path) -> None:
    """Upgrading the broker never loses the old ledger: missing columns are added with their defaults."""
    import sqlite3

    from mergebroker.broker.engine.accounting.store import SqliteLedgerStore

    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE ledger (request_id TEXT PRIMARY KEY, ts REAL NOT NULL, tenant TEXT NOT NULL, "
                "tier TEXT NOT NULL, model TEXT NOT NULL, batch_id TEXT, batch_size INTEGER NOT NULL, "
                "cache TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
                "alone_prompt_tokens INTEGER NOT NULL, tokens_saved INTEGER NOT NULL, status INTEGER NOT NULL, "
                "latency_ms REAL NOT NULL, endpoint TEXT NOT NULL)")
    old.execute("INSERT INTO ledger VALUES ('r1', 1.0, 't', 'batch', 'm', NULL, 1, 'miss', 10, 5, 10, 0, 200, "
                "3.0, 'chat')")
    old.commit()
    old.close()
    store = SqliteLedgerStore(str(path))
    (record,) = await store.query()
    assert (record.request_id, record.prompt_tokens, record.cached_tokens, record.actual_usd) == ("r1", 10, 0, None)
    assert record.usage_counted is False
    await store.close()
