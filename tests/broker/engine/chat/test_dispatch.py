"""The dispatcher never lets a slow similarity model hold a group: past its budget the group goes out unmerged."""

from __future__ import annotations

import asyncio

from mergebroker.broker.engine.chat.dispatch import Dispatcher, MergeOptions, TierMergePolicy
from mergebroker.broker.engine.chat.jobs import ChatJob
from mergebroker.broker.engine.chat.merge_queue import ReleasedGroup
from mergebroker.broker.engine.ground.metrics import Metrics, PoolMetrics
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.clock import Clock, FakeClock, monotonic
from mergebroker.merge.embedder import FakeEmbedder
from mergebroker.merge.quality_guard import GuardSettings, QualityGuard
from mergebroker.merge.shape import merge_shape
from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.simulator.server import answer_for
from mergebroker.providers.upstream import Upstream


class StuckEmbedder(FakeEmbedder):
    """A model that never finishes (until released)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def embed(self, texts):
        await self.release.wait()
        return await super().embed(texts)


def job(text: str, clock: Clock = monotonic) -> ChatJob:
    """A job enqueued now on `clock`, with 30 s to go: on the clock the dispatcher under test reads."""
    body = {"model": "sim-small", "messages": [{"role": "user", "content": text}]}
    return ChatJob(request_id=text, caller=Caller("t", "standard"), body=body, model="sim-small", priority=0,
                   shape=merge_shape(body), merge_key="k", prompt_tokens=5, max_tokens=50,
                   deadline=clock() + 30, enqueued_at=clock())


async def test_a_group_whose_vectors_miss_the_budget_is_sent_unmerged(simulator):
    metrics = Metrics()
    provider = OpenAICompatProvider(HttpProviderSettings(name="sim", base_url=simulator.url))
    pools = ProviderPools([Upstream(provider)], observer=PoolMetrics(metrics))
    embedder = StuckEmbedder()
    dispatcher = Dispatcher(
        pools, tiers={"standard": TierMergePolicy(True, 0.85, 4, similarity_budget_s=0.05)},
        options=MergeOptions(None, 8, {}, 8192), embedder=embedder, guard=QualityGuard(GuardSettings()),
        merging_allowed=lambda model: True, metrics=metrics)
    jobs = [job("How do I reset my password?"), job("How can I reset my password?")]
    try:
        await dispatcher.run_group(ReleasedGroup("standard", "k", jobs, 0.0))
        for j in jobs:
            outcome = j.future.result()
            assert outcome.batch_size == 1
            assert outcome.body["choices"][0]["message"]["content"] == answer_for(j.request_id)
        assert metrics.registry.get_sample_value("mergebroker_merge_skipped_total",
                                                 {"reason": "similarity_slow"}) == 2
        assert simulator.stats()["merged_calls"] == 0
    finally:
        embedder.release.set()
        await pools.close()


async def budget_from_first_arrival(simulator, clock: FakeClock) -> tuple[list[int], float, float]:
    """Two groups that waited past their similarity budget in the window, on `clock`, released while the
    model is stuck and then once it answers: the first group's batch sizes and the similarity_slow skips
    counted after each group."""
    metrics = Metrics()
    provider = OpenAICompatProvider(HttpProviderSettings(name="sim", base_url=simulator.url))
    pools = ProviderPools([Upstream(provider)], observer=PoolMetrics(metrics), clock=clock)
    embedder = StuckEmbedder()
    dispatcher = Dispatcher(
        pools, tiers={"standard": TierMergePolicy(True, 0.85, 4, similarity_budget_s=0.2)},
        options=MergeOptions(None, 8, {}, 8192), embedder=embedder, guard=QualityGuard(GuardSettings()),
        merging_allowed=lambda model: True, metrics=metrics, clock=clock)

    def skipped() -> float:
        return metrics.registry.get_sample_value("mergebroker_merge_skipped_total", {"reason": "similarity_slow"})

    stale = [job("How do I reset my password?", clock), job("How can I reset my password?", clock)]
    for j in stale:
        j.enqueued_at = clock() - 0.5  # arrived before the budget: the model gets no more time at release
    try:
        await asyncio.wait_for(dispatcher.run_group(ReleasedGroup("standard", "k", stale, 0.0)), 10)
        sizes, skipped_stale = [j.future.result().batch_size for j in stale], skipped()
        embedder.release.set()  # the model answers at once now: ready vectors are used however late
        ready = [job("What is the capital of France?", clock), job("What's the capital city of France?", clock)]
        for j in ready:
            j.enqueued_at = clock() - 0.5
        await asyncio.wait_for(dispatcher.run_group(ReleasedGroup("standard", "k", ready, 0.0)), 10)
        return sizes, skipped_stale, skipped()
    finally:
        embedder.release.set()
        await pools.close()


async def test_the_similarity_budget_counts_from_the_groups_first_arrival(simulator):
    """A group that already waited its budget in the window does not wait for the model again at release;
    vectors that are ready (embedded while the window was open) are still used."""
    assert await budget_from_first_arrival(simulator, FakeClock()) == ([1, 1], 2, 2)


class BehindEmbedder(FakeEmbedder):
    """A model with `backlog_s` seconds of work queued ahead (`Backlogged`) that has seen none of these texts."""

    def __init__(self, backlog_s: float) -> None:
        super().__init__()
        self.backlog_s = backlog_s

    def covers(self, texts) -> bool:
        return False


async def test_a_model_further_behind_than_the_budget_gets_no_more_prompts_and_nobody_waits_for_it(simulator):
    """Under sustained overload the model's backlog stays bounded: prompts are neither prefetched nor queued
    at release while the queued work alone outlasts the budget, and the group goes out at once, unmerged."""
    metrics = Metrics()
    provider = OpenAICompatProvider(HttpProviderSettings(name="sim", base_url=simulator.url))
    pools = ProviderPools([Upstream(provider)], observer=PoolMetrics(metrics))
    embedder = BehindEmbedder(backlog_s=5.0)
    dispatcher = Dispatcher(
        pools, tiers={"standard": TierMergePolicy(True, 0.85, 4, similarity_budget_s=1.0)},
        options=MergeOptions(None, 8, {}, 8192), embedder=embedder, guard=QualityGuard(GuardSettings()),
        merging_allowed=lambda model: True, metrics=metrics)
    jobs = [job("How do I reset my password?"), job("How do I reset my password??")]
    try:
        dispatcher.prefetch("standard", jobs)
        await asyncio.wait_for(dispatcher.run_group(ReleasedGroup("standard", "k", jobs, 0.0)), 10)
        assert [j.future.result().batch_size for j in jobs] == [1, 1]
        assert embedder.calls == []  # nothing queued behind a backlog nobody could use in time
        assert metrics.registry.get_sample_value("mergebroker_merge_skipped_total",
                                                 {"reason": "similarity_slow"}) == 2
        embedder.backlog_s = 0.0  # caught up: the same group merges
        again = [job("How do I reset my password?"), job("How do I reset my password??")]
        await asyncio.wait_for(dispatcher.run_group(ReleasedGroup("standard", "k", again, 0.0)), 10)
        assert [j.future.result().batch_size for j in again] == [2, 2]
    finally:
        await pools.close()
