"""Every answered request leaves one ledger record whose tokens add up to what the provider reported."""

from __future__ import annotations

import asyncio
import sqlite3

from mergebroker.clock import FakeClock
from tests.conftest import provider_for


async def test_merged_cached_and_coalesced_requests_are_accounted(simulator, start_broker, tmp_path):
    path = tmp_path / "ledger.sqlite3"
    # On a fake clock the window stays open until the fourth request fills the batch, however slow the machine.
    broker = await start_broker({
        "providers": [provider_for(simulator)], "merge": {"embedder": "none"},
        "ledger": {"path": str(path), "flush_interval_s": 0.05},
        "tiers": [{"name": "standard", "window_ms": 100, "max_batch": 4, "similarity_threshold": 0.0}]},
        clock=FakeClock())
    questions = [f"ledger question {i}" for i in range(4)]
    await asyncio.gather(*(broker.chat(q, temperature=0) for q in questions))
    _, _, hit = await broker.chat("ledger question 0", temperature=0)
    assert hit["X-Broker-Cache"] == "hit"
    await broker.broker.ledger.flush()
    rows = sqlite3.connect(path).execute(
        "SELECT cache, batch_size, prompt_tokens, tokens_saved FROM ledger ORDER BY ts").fetchall()
    assert len(rows) == 5
    merged = [r for r in rows if r[0] == "miss"]
    assert [r[1] for r in merged] == [4, 4, 4, 4]
    assert sum(r[2] for r in merged) == simulator.stats()["prompt_tokens"]
    assert rows[-1][0] == "hit" and rows[-1][3] > 0


async def test_requests_succeed_when_the_ledger_cannot_write(simulator, start_broker, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"enabled": False},
                                 "ledger": {"path": str(blocker / "ledger.sqlite3"), "flush_interval_s": 0.05}})
    status, _, _ = await broker.chat("still answered")
    assert status == 200


async def test_every_request_gets_its_own_ledger_row_whatever_x_request_id_the_client_sends(
        simulator, start_broker, tmp_path):
    path = tmp_path / "ledger.sqlite3"
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"enabled": False},
                                 "ledger": {"path": str(path), "flush_interval_s": 0.05}})
    for question in ("first", "second", "third"):
        status, _, headers = await broker.chat(question, headers={"X-Request-ID": "constant-id"})
        assert status == 200 and headers["X-Request-ID"] == "constant-id"  # still echoed to the client
    await broker.broker.ledger.flush()
    ids = [r[0] for r in sqlite3.connect(path).execute("SELECT request_id FROM ledger").fetchall()]
    assert len(ids) == 3 and len(set(ids)) == 3
    assert "constant-id" not in ids
