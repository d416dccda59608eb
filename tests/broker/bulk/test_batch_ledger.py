"""Batch API lines reach the usage ledger, one row per line with its apportioned usage, and the report."""

from __future__ import annotations

from mergebroker.broker.engine.accounting.ledger import Ledger, MemoryLedgerStore
from mergebroker.broker.engine.accounting.report import build_report
from mergebroker.broker.engine.accounting.request_record import record_bulk_line
from mergebroker.broker.engine.accounting.store import SqliteLedgerStore
from mergebroker.merge.pricing import PriceTable
from tests.broker.bulk.test_batches_api import FINAL, line, run_batch
from tests.conftest import provider_for


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
    assert report.upstream_calls == simulator.stats()["chat_calls"]


async def test_a_line_refused_before_any_call_is_no_upstream_call():
    """A line refused outright (`batch_size=0`) is a request in the report but made no call; the lines one call
    answered share its batch id, count as one call, and save what each would have cost alone."""
    store = MemoryLedgerStore()
    ledger = Ledger(store)
    refused = {"error": {"message": "no such model", "type": "invalid_request_error", "param": "model", "code": None}}
    record_bulk_line(None, ledger, None, line_id="b:lost", tenant="t", tier="batch", status=404, body=refused,
                     batch_size=0)
    share = {"model": "sim-small", "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
    for n in range(3):
        record_bulk_line(None, ledger, None, line_id=f"b:q{n}", tenant="t", tier="batch", status=200, body=share,
                         batch_id="b:r0-0:x", batch_size=3, alone_prompt_tokens=25)
    await ledger.stop()
    report = build_report(await store.query(), prices=PriceTable({}))
    assert report.requests == 4 and report.upstream_calls == 1 and report.upstream_calls_saved == 2
    assert report.merged == 3 and report.tokens_saved == 3 * (25 - 10)
