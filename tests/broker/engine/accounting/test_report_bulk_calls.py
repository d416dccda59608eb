"""The report counts a Batch API job's upstream calls as the upstream received them: a merged (or
deduplicated) call once, however many lines it answered."""

from __future__ import annotations

import pytest

from mergebroker.broker.engine.accounting.report import build_report
from mergebroker.broker.engine.accounting.store import SqliteLedgerStore
from mergebroker.merge.pricing import PriceTable
from tests.broker.bulk.test_batches_api import config, finished, line, run_batch

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("batch_api", [False, True])
async def test_report_counts_the_calls_the_upstream_received_not_the_lines(simulator, start_broker, tmp_path,
                                                                           batch_api):
    ledger = tmp_path / "ledger.sqlite3"
    b = await start_broker({**config(simulator, tmp_path, batch_api=batch_api),
                            "ledger": {"path": str(ledger), "flush_interval_s": 0.05}})
    rows = [line(f"q{n}", f"Item number {n % 10}") for n in range(24)]  # 10 distinct items, merged 8 + 2
    rows.append(line("tools", "Look it up.", tools=TOOLS))  # may not merge: a call of its own
    batch = await finished(b.openai, b, await run_batch(b.openai, b, rows))
    assert batch.status == "completed" and batch.request_counts.completed == 25
    await b.broker.ledger.stop()  # flush what is buffered
    records = [r for r in await SqliteLedgerStore(str(ledger)).query() if r.endpoint == "batch"]
    report = build_report(records, prices=PriceTable({}))

    sim = simulator.stats()
    assert sim["chat_calls"] == 3
    assert report.requests == 25 and report.upstream_calls == sim["chat_calls"]
    assert report.upstream_calls_saved == 25 - 3  # every answered line, less the calls that answered them
    assert report.merged == 24 and report.merge_rate == pytest.approx(24 / 25)
    assert report.prompt_tokens == sim["prompt_tokens"]  # each line keeps its apportioned share
    by_line = {r.request_id.rsplit(":", 1)[1]: r for r in records}
    assert by_line["tools"].batch_size == 1
    assert len({by_line[f"q{n}"].batch_id for n in range(24)}) == 2
