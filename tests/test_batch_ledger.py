"""Batch API lines reach the usage ledger, one row per line with its apportioned usage, and the report."""

from __future__ import annotations

from mergebroker.broker.engine.accounting.report import build_report
from mergebroker.broker.engine.accounting.store import SqliteLedgerStore
from mergebroker.merge.pricing import PriceTable
from tests.conftest import provider_for
from tests.test_batches_api import FINAL, line, run_batch


async def test_every_batch_line_is_ledgered_once_with_its_usage_and_reported(simulator, start_broker, tmp_path):
    ledger = tmp_path / "ledger.sqlite3"
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"},
                                 "batches": {"dir": str(tmp_path / "b"), "poll_interval_s": 0.02},
                                 "ledger": {"path": str(ledger), "flush_interval_s": 0.05}})
    rows = [line(f"q{n}", f"question number {n}") for n in range(6)]
    batch_id = await run_batch(broker.openai, broker, rows)
    done = await broker.batches.wait_until(batch_id, lambda d: d["status"] in FINAL)
    assert done["status"] == "completed"
    await broker.broker.ledger.stop()  # flush what is buffered
    records = [r for r in await SqliteLedgerStore(str(ledger)).query() if r.endpoint == "batch"]
    assert sorted(r.request_id for r in records) == sorted(f"{batch_id}:q{n}" for n in range(6))
    assert all(r.prompt_tokens > 0 and r.completion_tokens > 0 and r.status == 200 for r in records)
    report = build_report(records, prices=PriceTable({}))
    assert report.requests == 6 and report.prompt_tokens == sum(r.prompt_tokens for r in records)
