"""Finalising a large batch runs off the event loop in bounded pages: the loop keeps answering meanwhile
(issue 26: finding 6)."""

from __future__ import annotations

import asyncio
import json
import time

from mergebroker.broker.bulk.files import FileService
from mergebroker.broker.bulk.finalize import write_files
from mergebroker.broker.bulk.store import BatchStore

LINES = 20_000
BODY = {"id": "chatcmpl-1", "object": "chat.completion", "model": "sim-small",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "an answer of some length " * 8},
                     "finish_reason": "stop"}], "usage": {"prompt_tokens": 50, "completion_tokens": 40,
                                                          "total_tokens": 90}}


async def longest_gap(stop: asyncio.Event) -> float:
    """The longest the loop went without running this task, ticking every 5 ms until `stop`."""
    longest, last = 0.0, time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.005)  # a probe of the loop's latency, not a synchronisation
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    return longest


async def test_writing_the_files_of_a_large_batch_leaves_the_loop_responsive(tmp_path):
    store = BatchStore(tmp_path / "state.sqlite3")
    files = FileService(tmp_path, store, max_bytes=10**9, max_lines=10**6, ttl_s=3600, max_uploads_per_tenant=4,
                        max_form_parts=8)
    ids = [f"line-{n}" for n in range(LINES)]
    await store.add_results("batch_big", [(c, 200 if n % 10 else 500, BODY if n % 10 else {"error": {
        "message": "upstream failed", "code": "upstream_error"}}) for n, c in enumerate(ids[:-100])])
    stop = asyncio.Event()
    probe = asyncio.ensure_future(longest_gap(stop))
    try:
        written = await write_files(store, files, batch_id="batch_big", tenant="t", custom_ids=ids, total=LINES,
                                    status="cancelled", max_output_bytes=10**9)
    finally:
        stop.set()
        gap = await probe
        store.close()
    assert gap < 0.25, f"the loop stalled for {gap * 1000:.0f} ms"
    assert (written.completed, written.failed) == (17_910, 2_090)
    out = (tmp_path / "files" / f"{written.output.id}.jsonl").read_bytes().splitlines()
    err = [json.loads(x) for x in (tmp_path / "files" / f"{written.errors.id}.jsonl").read_bytes().splitlines()]
    assert len(out) == 17_910 and len(err) == 2_090
    assert sum(e["error"]["code"] == "batch_cancelled" for e in err) == 100
    assert {json.loads(x)["custom_id"] for x in out} | {e["custom_id"] for e in err} == set(ids)
