"""Every batch reaches a final state whatever fails, answered lines are never lost, and a finished batch's
state is let go (issue 26: findings 1, 4 and 7)."""

from __future__ import annotations

from dataclasses import asdict

from mergebroker.broker.bulk.store import BatchRow, BatchStore
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.providers.simulator.server import answer_for
from tests.broker.bulk.test_batches_api import assert_own_answers, config, finished, jsonl, line, outputs, run_batch


async def test_output_too_large_for_one_file_fails_the_batch_with_every_line_in_one_file(simulator, start_broker,
                                                                                      tmp_path):
    rows = [line(f"q{n}", f"question number {n}") for n in range(12)]
    b = await start_broker(config(simulator, tmp_path, max_file_bytes=len(jsonl(rows)) + 500))
    batch = await finished(b.openai, b, await run_batch(b.openai, b, rows))
    assert batch.status == "failed" and [e.code for e in batch.errors.data] == ["output_too_large"]
    found = await outputs(b.openai, batch)  # asserts each custom_id appears once across the two files
    assert set(found) == {r["custom_id"] for r in rows}
    output = (await b.openai.files.content(batch.output_file_id)).content
    assert 0 < len(output) <= len(jsonl(rows)) + 500
    kept = [r for r in found.values() if r["response"]]
    moved = [r for r in found.values() if not r["response"]]
    assert moved and {r["error"]["code"] for r in moved} == {"output_too_large"}
    assert_own_answers({r["custom_id"]: r for r in kept}, {r["custom_id"]: r["body"]["messages"][1]["content"]
                                                           for r in rows if r["custom_id"] in {k["custom_id"] for k in kept}})
    assert batch.request_counts.completed == len(kept) and batch.request_counts.failed == len(moved)


async def test_a_failure_while_writing_the_files_ends_the_batch_failed_not_stuck(simulator, start_broker, tmp_path,
                                                                                monkeypatch):
    b = await start_broker(config(simulator, tmp_path))

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(b.batches.files, "output", broken)
    batch = await finished(b.openai, b, await run_batch(b.openai, b, [line("a", "question a")]))
    assert batch.status == "failed" and [e.code for e in batch.errors.data] == ["finalize_failed"]
    assert batch.request_counts.completed == 1 and batch.request_counts.failed == 0
    await b.close()
    again = await start_broker(config(simulator, tmp_path))
    assert (await again.openai.batches.retrieve(batch.id)).status == "failed"  # final: never resumed


async def test_a_batch_stopped_while_finalizing_is_finished_at_the_next_start(simulator, start_broker, tmp_path):
    """A broker killed while writing the files leaves the batch `finalizing`: the next one writes them."""
    first = await start_broker(config(simulator, tmp_path))
    uploaded = await first.openai.files.create(file=("in.jsonl", jsonl([line("a", "qa"), line("b", "qb")])),
                                               purpose="batch")
    await first.close()
    store = BatchStore(tmp_path / "batches.sqlite3")
    data = {"id": "batch_stuck", "object": "batch", "endpoint": "/v1/chat/completions", "errors": None,
            "input_file_id": uploaded.id, "completion_window": "24h", "status": "finalizing",
            "output_file_id": None, "error_file_id": None, "created_at": 1, "in_progress_at": 1,
            "expires_at": 4_000_000_000, "finalizing_at": 2, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 2, "completed": 1, "failed": 0}, "metadata": None}
    await store.put_batch(BatchRow("batch_stuck", "default", "batch", data, asdict(Caller("default", "batch"))))
    await store.add_results("batch_stuck", [("a", 200, {"choices": [{"message": {"content": "stored answer"}}]})])
    store.close()
    second = await start_broker(config(simulator, tmp_path))
    batch = await finished(second.openai, second, "batch_stuck")
    assert batch.status == "completed" and batch.request_counts.completed == 1
    found = await outputs(second.openai, batch)
    assert found["a"]["response"]["body"]["choices"][0]["message"]["content"] == "stored answer"
    assert found["b"]["error"]["code"] == "batch_failed"
    assert simulator.stats()["chat_calls"] == 0


async def test_deleting_the_input_mid_run_then_restarting_loses_no_answered_line(simulator, start_broker, tmp_path):
    simulator.set_faults(latency_base_ms=30)
    rows = [line(f"q{n}", f"question {n}", system=f"System {n}") for n in range(10)]  # 10 calls of 1
    first = await start_broker(config(simulator, tmp_path, concurrency=1))
    batch_id = await run_batch(first.openai, first, rows)
    seen = await first.batches.wait_until(batch_id, lambda d: d["request_counts"]["completed"] >= 3)
    assert (await first.openai.files.delete(seen["input_file_id"])).deleted
    await first.close()
    calls = simulator.stats()["chat_calls"]
    second = await start_broker(config(simulator, tmp_path, concurrency=1))
    batch = await finished(second.openai, second, batch_id)
    assert batch.status == "completed" and batch.request_counts.completed == 10
    assert_own_answers(await outputs(second.openai, batch), {r["custom_id"]: r["body"]["messages"][1]["content"]
                                                             for r in rows})
    assert simulator.stats()["chat_calls"] - calls <= 10 - seen["request_counts"]["completed"]


async def test_with_its_input_gone_for_good_a_batch_ends_from_the_answers_it_stored(simulator, start_broker,
                                                                                   tmp_path):
    simulator.set_faults(latency_base_ms=30)
    rows = [line(f"q{n}", f"question {n}", system=f"System {n}") for n in range(10)]
    first = await start_broker(config(simulator, tmp_path, concurrency=1))
    batch_id = await run_batch(first.openai, first, rows)
    await first.batches.wait_until(batch_id, lambda d: d["request_counts"]["completed"] >= 3)
    await first.openai.files.delete((await first.openai.batches.retrieve(batch_id)).input_file_id)
    await first.close()
    answered = await BatchStore(tmp_path / "batches.sqlite3").answered(batch_id)
    for pinned in (tmp_path / "inputs").iterdir():
        pinned.unlink()  # as a batch created before inputs were pinned
    second = await start_broker(config(simulator, tmp_path, concurrency=1))
    batch = await finished(second.openai, second, batch_id)
    assert batch.status == "failed" and [e.code for e in batch.errors.data] == ["input_file_gone"]
    found = await outputs(second.openai, batch)
    assert set(found) == set(answered) and len(found) >= 3
    for custom_id, row in found.items():
        assert row["response"]["body"]["choices"][0]["message"]["content"] == answer_for(f"question {custom_id[1:]}")
    assert batch.request_counts.completed == len(found) and batch.request_counts.failed == 10 - len(found)


async def test_a_finished_batch_leaves_nothing_behind_in_memory_or_the_store(simulator, start_broker, tmp_path):
    b = await start_broker(config(simulator, tmp_path))
    ids = [await run_batch(b.openai, b, [line(f"q{n}", f"question {n}") for n in range(5)]) for _ in range(4)]
    for batch_id in ids:
        assert (await finished(b.openai, b, batch_id)).status == "completed"
    service = b.batches
    assert service._jobs == {} and service._progress == {} and service._rows == {}
    assert [await service._store.answered(i) for i in ids] == [{}] * 4  # the files hold the answers now
    assert list((tmp_path / "inputs").iterdir()) == []
    listed = await b.openai.batches.list()
    assert {x.id for x in listed.data} == set(ids) and {x.status for x in listed.data} == {"completed"}
