"""A bulk job whose completion window ends stops sending and reports its unsent lines as expired."""

from __future__ import annotations

import asyncio
import json

from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.bulk.runner import Limits
from mergebroker.broker.bulk.batches import build_batch_service
from mergebroker.broker.engine.metrics import Metrics
from mergebroker.broker.engine.limits.ratelimit import RateLimiter
from mergebroker.broker.engine.config import load_settings
from mergebroker.clock import FakeClock, monotonic
from mergebroker.providers.openai_compat import HttpProviderSettings, OpenAICompatProvider
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.upstream import Upstream


def rows(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "sim-small", "messages": [{"role": "system", "content": f"System {i}"},
                                           {"role": "user", "content": f"question {i}"}]}}) + "\n"
                   for i in range(n)).encode()


async def test_window_end_expires_the_job_and_its_unsent_lines(simulator, tmp_path):
    simulator.set_faults(latency_base_ms=20)
    settings = load_settings(None, environ={}, overrides={"batches": {"dir": str(tmp_path), "concurrency": 1}})
    pools = ProviderPools([Upstream(OpenAICompatProvider(HttpProviderSettings("sim", simulator.url)))])
    wall = FakeClock(1_800_000_000)
    service = build_batch_service(settings, pools=pools, providers=[], limits=Limits(RateLimiter(monotonic), lambda c: []),
                                  embedder=None, merging_allowed=lambda model: True, metrics=Metrics(), clock=monotonic,
                                  sleep=asyncio.sleep, wall=wall)
    await service.start()
    try:
        record = await service.files.upload("t", "batch", "in.jsonl", rows(6))
        batch = await service.create(Caller("t", "batch"), {"input_file_id": record.id, "completion_window": "24h",
                                                            "endpoint": "/v1/chat/completions"})
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
