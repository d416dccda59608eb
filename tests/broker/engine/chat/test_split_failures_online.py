"""In production, a model that cannot split merged replies stops being merged by itself: the quality guard
sees its merged calls need fallbacks, pauses merging for that tenant and model, and says so in a metric and
a log line; the members are answered alone, never lost."""

from __future__ import annotations

import asyncio

import pytest

from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator
from tests.conftest import provider_for

BATCH = [{"name": "batch", "priority": 0, "window_ms": 60_000, "max_batch": 2, "similarity_threshold": 0.0}]


@pytest.fixture
async def cannot_split():
    sim = await start_simulator(SimulatorConfig(models=("m",), split_failure_rate=1.0))
    try:
        yield sim
    finally:
        await sim.close()


async def test_merging_pauses_for_a_model_whose_merged_calls_fail_to_split(start_broker, cannot_split):
    broker = await start_broker({"providers": [provider_for(cannot_split, models=["m"])], "tiers": BATCH,
                                 "default_tier": "batch",
                                 "merge": {"embedder": "none", "policy": "always", "quality_guard_min_batches": 3}})

    async def pair(round_: int) -> list[tuple[int, str, str]]:
        answers = await asyncio.gather(*(broker.chat(f"Round {round_}: what is {n} plus {n}?", model="m")
                                         for n in range(2)))
        return [(status, headers["X-Broker-Batch-Size"], headers.get("X-Broker-Fallback", "")) for status, _, headers
                in answers]

    for round_ in range(3):  # three merged calls, every member re-sent alone
        assert all(status == 200 and fallback for status, _, fallback in await pair(round_))
    after = await pair(3)
    assert [(status, size) for status, size, _ in after] == [(200, "1"), (200, "1")]  # merging paused
    metrics = await (await broker.http.get("/metrics")).text()
    assert 'mergebroker_merge_guard_pauses_total{reason="fallbacks"} 1.0' in metrics
