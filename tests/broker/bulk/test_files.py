"""Stored files belong to one tenant, keep their bytes, and disappear once expired."""

from __future__ import annotations

import pytest

from mergebroker.broker.bulk.files import FileService
from mergebroker.broker.bulk.store import BatchStore
from mergebroker.clock import FakeClock
from mergebroker.errors import NotFound

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", ' \
       b'"body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}\n'


async def test_expired_files_are_cleaned_up_with_their_bytes(tmp_path):
    wall = FakeClock(1_000_000)
    store = BatchStore(tmp_path / "state.sqlite3")
    files = FileService(tmp_path, store, max_bytes=10_000, max_lines=10, ttl_s=60, max_uploads_per_tenant=4,
                        max_form_parts=8, wall=wall)
    kept = await files.upload("t", "batch", "in.jsonl", LINE)
    assert await files.content("t", kept.id) == LINE
    with pytest.raises(NotFound):
        await files.content("other-tenant", kept.id)
    wall.advance(30)
    async with files.output("t", "out.jsonl") as out:
        await out.write(b"{}\n", 1)
        later = await out.keep()
    assert await files.clean_expired() == 0
    wall.advance(31)
    assert await files.clean_expired() == 1
    with pytest.raises(NotFound):
        await files.get("t", kept.id)
    assert [r.id for r in await files.list("t", purpose=None, limit=10)] == [later.id]
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [f"{later.id}.jsonl"]
    store.close()
