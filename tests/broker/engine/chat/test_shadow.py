"""Shadow comparison: a sample of merged members is re-sent alone in the background, the fidelity metric records how
close the answers were, the ledger bills the shadow calls apart, and low fidelity pauses that tenant's merging."""

from __future__ import annotations

import asyncio
from typing import Any

from mergebroker.broker.engine.accounting.report import build_report
from mergebroker.broker.engine.accounting.store import SqliteLedgerStore
from mergebroker.broker.engine.chat.jobs import ChatJob
from mergebroker.broker.engine.chat.shadow import ShadowRunner
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.clock import FakeClock
from mergebroker.merge.quality_guard import GuardSettings, QualityGuard
from mergebroker.merge.shape import MergeShape
from mergebroker.providers.simulator.quiz_set import builtin_set
from mergebroker.providers.simulator.server import SimulatorConfig, start_simulator
from tests.conftest import provider_for

BATCH = {"X-Broker-Tier": "batch"}


def config(sim, ledger: str, **merge: Any) -> dict:
    return {"providers": [provider_for(sim)], "ledger": {"path": ledger},
            "tiers": [{"name": "standard", "priority": 50},
                      {"name": "batch", "priority": 0, "window_ms": 200, "max_batch": 4, "similarity_threshold": 0.0}],
            "merge": {"embedder": "none", "shadow_rate": 1.0, "shadow_tpm": 1_000_000,
                      "quality_guard_min_fidelity": 0.9, "quality_guard_fidelity_window": 4, **merge}}


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def ask(broker, questions) -> list[tuple[int, dict, Any]]:
    return await asyncio.gather(*(broker.chat(q, headers=BATCH, temperature=0) for q in questions))


async def test_degraded_merges_move_the_fidelity_metric_and_pause_the_tenants_merging(start_broker, tmp_path):
    items = builtin_set(8)
    async with await start_simulator(SimulatorConfig(quiz=True, merge_degrade=0.5)) as sim:
        broker = await start_broker(config(sim, str(tmp_path / "ledger.db")))
        first = await ask(broker, [i.question for i in items[:4]])
        assert [h["X-Broker-Batch-Size"] for _, _, h in first] == ["4"] * 4
        assert all(b["choices"][0]["message"]["content"] != i.expected for (_, b, _), i in zip(first, items))
        await broker.broker.shadow.drain()
        m = broker.broker.metrics
        labels = {"tier": "batch", "model": "sim-small", "batch_size": "4"}
        assert sample(m, "mergebroker_merge_fidelity_count", **labels) == 4
        assert sample(m, "mergebroker_merge_fidelity_sum", **labels) == 0.0
        assert sample(m, "mergebroker_shadow_total", result="differ") == 4
        assert sim.stats()["chat_calls"] == 5  # the merged call and four shadows alone
        assert sample(m, "mergebroker_merge_guard_pauses_total", reason="fidelity") == 1

        second = await ask(broker, [i.question for i in items[4:]])  # merging is paused for this tenant and model
        assert [h["X-Broker-Batch-Size"] for _, _, h in second] == ["1"] * 4
        assert [b["choices"][0]["message"]["content"] for _, b, _ in second] == [i.expected for i in items[4:]]

        await broker.broker.ledger.flush()
        store = SqliteLedgerStore(str(tmp_path / "ledger.db"))
        report = build_report(await store.query(), prices={})
        await store.close()
        assert report.requests == 8 and report.shadow_calls == 4 and report.shadow_tokens > 0


async def test_faithful_merges_score_one_and_keep_merging(start_broker, tmp_path):
    items = builtin_set(8)
    async with await start_simulator(SimulatorConfig(quiz=True)) as sim:
        broker = await start_broker(config(sim, str(tmp_path / "ledger.db")))
        for chunk in (items[:4], items[4:]):
            results = await ask(broker, [i.question for i in chunk])
            assert [h["X-Broker-Batch-Size"] for _, _, h in results] == ["4"] * 4
            await broker.broker.shadow.drain()
        m = broker.broker.metrics
        labels = {"tier": "batch", "model": "sim-small", "batch_size": "4"}
        assert sample(m, "mergebroker_merge_fidelity_sum", **labels) == 8.0
        assert sample(m, "mergebroker_shadow_total", result="agree") == 8


class HeldPools:
    """Single calls wait until released; counts them."""

    def __init__(self, expected: int = 0) -> None:
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()  # set when `expected` calls are waiting
        self.expected = expected
        self.calls: list[float] = []

    async def chat(self, model: str, body: dict, *, deadline: float, priority: float = 0, tokens: int = 0):
        self.calls.append(priority)
        if len(self.calls) == self.expected:
            self.arrived.set()
        await self.release.wait()
        return {"choices": [{"message": {"content": "42"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1}}, "fake"


def job(question: str = "What is 6 * 7? Answer with the number only.", temperature: float = 0) -> ChatJob:
    return ChatJob(request_id="r", caller=Caller("tenant", "batch"), model="m", priority=0,
                   body={"model": "m", "messages": [{"role": "user", "content": question}], "temperature": temperature},
                   shape=MergeShape(None, question), merge_key="k", prompt_tokens=20, max_tokens=30, deadline=1e12,
                   enqueued_at=0)


async def test_shadow_calls_run_in_the_background_at_the_lowest_priority_within_the_token_budget():
    pools, metrics = HeldPools(expected=2), Metrics()
    runner = ShadowRunner(pools, rate=1.0, tpm=120, guard=QualityGuard(GuardSettings()),  # type: ignore[arg-type]
                          metrics=metrics, clock=FakeClock())
    runner.offer(job(), "42", 2)  # returns at once: the caller already has its answer
    runner.offer(job(), "42", 2)  # 2 x 50 tokens reserved of 120
    runner.offer(job(), "42", 2)  # no budget left this minute
    runner.offer(job(temperature=0.7), "42", 2)  # not deterministic: never sampled, never counted
    await asyncio.wait_for(pools.arrived.wait(), 5)
    assert pools.calls == [float("-inf")] * 2
    assert sample(metrics, "mergebroker_shadow_total", result="over_budget") == 1
    pools.release.set()
    await runner.drain()
    assert sample(metrics, "mergebroker_shadow_total", result="agree") == 2


async def test_with_no_rate_nothing_is_shadowed():
    pools, metrics = HeldPools(), Metrics()
    runner = ShadowRunner(pools, rate=0.0, tpm=1000, guard=QualityGuard(GuardSettings()),  # type: ignore[arg-type]
                          metrics=metrics)
    assert not runner.enabled
    runner.offer(job(), "42", 2)
    await runner.drain()
    assert pools.calls == []
