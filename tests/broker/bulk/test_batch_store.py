"""The batch store pages a tenant's batches and files by its own IDs only (issue 26: finding 8, the cursor)."""

from __future__ import annotations

from mergebroker.broker.bulk.store import BatchRow, BatchStore, FileRecord


def batch(batch_id: str, tenant: str, created_at: int) -> BatchRow:
    return BatchRow(batch_id, tenant, "batch", {"id": batch_id, "status": "completed", "created_at": created_at})


async def test_another_tenants_id_as_cursor_is_an_unknown_one(tmp_path):
    store = BatchStore(tmp_path / "state.sqlite3")
    try:
        for n in range(3):
            await store.put_batch(batch(f"batch_b{n}", "beta", 100 + n))
            await store.add_file(FileRecord(f"file-b{n}", "beta", "batch", "f.jsonl", 1, 100 + n, 10**9, 1))
        await store.put_batch(batch("batch_a", "alpha", 200))
        await store.add_file(FileRecord("file-a", "alpha", "batch", "f.jsonl", 1, 200, 10**9, 1))
        own = await store.batches("beta", after="batch_b2", limit=10)
        assert [r.id for r in own] == ["batch_b1", "batch_b0"]
        assert await store.batches("beta", after="batch_a", limit=10) == await store.batches(
            "beta", after="batch_nope", limit=10) == []
        assert [r.id for r in await store.files("beta", purpose=None, after="file-b1", limit=10)] == ["file-b0"]
        assert await store.files("beta", purpose=None, after="file-a", limit=10) == await store.files(
            "beta", purpose=None, after="file-nope", limit=10) == []
    finally:
        store.close()
