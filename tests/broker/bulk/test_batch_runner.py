"""A bulk job whose completion window ends stops sending and reports its unsent lines as expired."""

from __future__ import annotations

import asyncio
import json

from mergebroker.broker.bulk.batches import build_batch_service
from mergebroker.broker.bulk.lines import BatchLine
from mergebroker.broker.bulk.runner import BulkJob, BulkRunner, Limits
from mergebroker.broker.bulk.store import BatchStore
from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.engine.limits.ratelimit import RateLimiter
from mergebroker.clock import FakeClock, monotonic
from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.upstream import Upstream


def rows(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "sim-small", "messages": [{"role": "system", "content": f"System {i}"},
                                           {"role": "user", "content": f"question {i}"}]}}) + "\n"
                   for i in range(n)).encode()


def service_on(simulator, settings, **extra):
    """A batch service over the simulator, with its pools (to close)."""
    pools = ProviderPools([Upstream(OpenAICompatProvider(HttpProviderSettings("sim", simulator.url)))])
    service = build_batch_service(settings, pools=pools, providers=[], limits=Limits(RateLimiter(monotonic), lambda c: []),
                                  embedder=None, merging_allowed=lambda model: True, metrics=Metrics(), clock=monotonic,
                                  sleep=asyncio.sleep, **extra)
    return service, pools


async def create_batch(service, lines: int) -> dict:
    """Upload `lines` lines as tenant t and create a batch of them; the batch object."""
    record = await service.files.upload("t", "batch", "in.jsonl", rows(lines))
    return await service.create(Caller("t", "batch"), {"input_file_id": record.id, "completion_window": "24h",
                                                       "endpoint": "/v1/chat/completions"})


async def test_window_end_expires_the_job_and_its_unsent_lines(simulator, tmp_path):
    simulator.set_faults(latency_base_ms=20)
    settings = load_settings(None, environ={}, overrides={"batches": {"dir": str(tmp_path), "concurrency": 1}})
    wall = FakeClock(1_800_000_000)
    service, pools = service_on(simulator, settings, wall=wall)
    await service.start()
    try:
        batch = await create_batch(service, 6)
        await service.wait_until(batch["id"], lambda d: d["request_counts"]["completed"] >= 1)
        wall.advance(24 * 3600)
        done = await service.wait_until(batch["id"], lambda d: d["status"] in ("expired", "completed"))
        assert done["status"] == "expired" and done["expired_at"] == int(wall())
        errors = [json.loads(x) for x in (await service.files.content("t", done["error_file_id"])).splitlines()]
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        assert done["request_counts"]["completed"] + len(errors) == 6
        assert simulator.stats()["chat_calls"] == done["request_counts"]["completed"]
    finally:
        await service.stop()
        await pools.close()


def bare_runner(simulator, tmp_path):
    """A bulk runner over the simulator without the batch service around it: (runner, pools, store) to close."""
    settings = load_settings(None, environ={}, overrides={"batches": {"dir": str(tmp_path)},
                                                          "merge": {"embedder": "none"}})
    pools = ProviderPools([Upstream(OpenAICompatProvider(HttpProviderSettings("sim", simulator.url)))])
    store = BatchStore(tmp_path / "state.sqlite3")
    runner = BulkRunner(settings, pools=pools, store=store, batch_apis={}, limits=Limits(RateLimiter(monotonic),
                        lambda c: []), embedder=None, merging_allowed=lambda m: True, metrics=Metrics(),
                        clock=monotonic, sleep=asyncio.sleep, wall=monotonic)
    return runner, pools, store


def chat(custom_id: str, content: str, **extra) -> BatchLine:
    """A chat line of a bulk job."""
    return BatchLine(custom_id, "/v1/chat/completions", {"model": "sim-small", "messages": [
        {"role": "system", "content": "Answer."}, {"role": "user", "content": content}], **extra})


class Sink:
    """The results a job hands on, by custom_id (the first one kept, as the batch store keeps it)."""

    def __init__(self) -> None:
        self.results: dict[str, tuple[int, dict]] = {}

    async def record(self, job, results, call=None) -> None:
        for custom_id, status, body in results:
            self.results.setdefault(custom_id, (status, body))


async def test_lines_that_break_planning_or_sending_fail_alone(simulator, tmp_path):
    """A lone surrogate or a 900-deep vendor field (a file stored before uploads were checked) fails its own line;
    the job's good lines are answered (finding 3)."""
    deep: dict = {"x": 1}
    for _ in range(900):
        deep = {"x": deep}
    runner, pools, store = bare_runner(simulator, tmp_path)

    lines = [chat("good1", "first question"), chat("lone", "broken \ud800 text"), chat("deep", "deep", vendor=deep),
             chat("good2", "second question")]
    sink = Sink()
    try:
        await runner.run(BulkJob("batch_x", Caller("t", "batch"), lines, 4e9, "24h"), sink, set())
    finally:
        store.close()
        await pools.close()
    assert set(sink.results) == {"good1", "lone", "deep", "good2"}
    assert sink.results["good1"][0] == 200 and sink.results["good2"][0] == 200
    assert sink.results["lone"][0] >= 400 and sink.results["deep"][0] >= 400


async def test_a_finished_job_is_freed_by_reference_counting(simulator, tmp_path):
    """A finished job and its lines die as soon as the runner returns, without a garbage collection: a full
    collection over a 50,000-line job's objects holds the event loop for ~0.3 s (`mergebroker.gc_policy`)."""
    import gc
    import weakref

    runner, pools, store = bare_runner(simulator, tmp_path)
    lines = [chat(f"q{i}", f"question {i}") for i in range(6)]
    job = BulkJob("batch_f", Caller("t", "batch"), lines, 4e9, "24h")
    alive = weakref.ref(job)
    del lines
    sink = Sink()
    gc.disable()
    try:
        await runner.run(job, sink, set())
        del job
        assert alive() is None
    finally:
        gc.enable()
        store.close()
        await pools.close()
    assert len(sink.results) == 6
