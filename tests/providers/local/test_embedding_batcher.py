"""The embeddings engine sends each distinct missing text once, in shared batches, and answers every caller right."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import redis.asyncio as redis_asyncio

from mergebroker.broker.engine.embeddings.batcher import EmbeddingBatcher
from mergebroker.broker.engine.embeddings.window_rules import (
    TimerHandle,
    cache_metrics_hook,
    share_tokens,
    window_decision,
)
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.errors import Overloaded, UpstreamBadResponse, UpstreamHTTPError, UpstreamTimeout
from mergebroker.merge.cache import LruCache, RedisCache, TwoLevelCache, make_redis_client
from mergebroker.merge.embedder import fake_vector
from mergebroker.providers.base import EmbedResult

DIM = 16


def expected(text: str, model: str = "m") -> np.ndarray:
    return fake_vector(f"{model}|{text}", DIM)


class ManualTimer:
    """A `CallLater` seam for tests: nothing fires until `fire_all()`; `delays` records what was asked."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._handles: list[_ManualHandle] = []

    def __call__(self, delay: float, callback: Callable[[], None]) -> TimerHandle:
        self.delays.append(delay)
        handle = _ManualHandle(callback)
        self._handles.append(handle)
        return handle

    @property
    def active(self) -> int:
        """Timers scheduled and neither fired nor cancelled."""
        return sum(1 for h in self._handles if h.live)

    def fire_all(self) -> int:
        """Run every live callback once; returns how many ran."""
        live = [h for h in self._handles if h.live]
        self._handles = []
        for handle in live:
            handle.live = False
            handle.callback()
        return len(live)


@dataclass(eq=False, slots=True)
class _ManualHandle:
    callback: Callable[[], None]
    live: bool = True

    def cancel(self) -> None:
        self.live = False


class FakeBackend:
    """Records every call; waits on `gate` when given; fails batches containing `fail_on` with `fail_status`."""

    def __init__(self, gate: asyncio.Event | None = None, fail_on: str | None = None, fail_status: int = 500) -> None:
        self.calls: list[tuple[str, list[str], int | None]] = []
        self.started = asyncio.Event()
        self.gate = gate
        self.fail_on = fail_on
        self.fail_status = fail_status

    async def __call__(self, model: str, texts: list[str], dimensions: int | None) -> EmbedResult:
        self.calls.append((model, list(texts), dimensions))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_on is not None and self.fail_on in texts:
            raise UpstreamHTTPError(self.fail_status, "boom")
        return EmbedResult([expected(t, model) for t in texts], prompt_tokens=sum(words(t) for t in texts))

    @property
    def inputs(self) -> list[str]:
        return [text for _, texts, _ in self.calls for text in texts]


def words(text: str) -> int:
    return len(text.split())


def l1_cache() -> TwoLevelCache:
    return TwoLevelCache(LruCache(max_entries=1000, max_bytes=1 << 20, ttl_s=None), None)


def make_batcher(backend: FakeBackend, *, cache: TwoLevelCache | None = None, timer: ManualTimer | None = None,
                 metrics: Metrics | None = None, **overrides: object) -> EmbeddingBatcher:
    options: dict[str, object] = dict(cache=cache, cache_version="1", window_s=0.005, max_batch_size=64,
                                      max_batch_tokens=10_000, count_tokens=words, ttl_s=60.0, metrics=metrics,
                                      call_later=timer)
    options.update(overrides)
    return EmbeddingBatcher(backend, **options)  # type: ignore[arg-type]


async def until(predicate: Callable[[], bool]) -> None:
    """Let other tasks run until `predicate` holds (loop turns, not wall-clock time)."""
    for _ in range(200):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


def sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_window_decision_closes_before_a_text_that_would_overflow_the_tokens_and_after_a_full_window() -> None:
    limits = dict(max_batch_size=3, max_batch_tokens=10)
    assert window_decision(0, 0, 4, **limits) == (False, False)
    assert window_decision(1, 8, 4, **limits) == (True, False)
    assert window_decision(2, 4, 1, **limits) == (False, True)
    assert window_decision(0, 0, 12, **limits) == (False, True)


def test_share_tokens_splits_a_batch_total_in_proportion() -> None:
    assert share_tokens(10, [1, 4]) == [2.0, 8.0]
    assert share_tokens(3, [0, 0, 0]) == [1.0, 1.0, 1.0]


async def test_fifty_concurrent_identical_requests_send_the_text_to_the_backend_once() -> None:
    gate = asyncio.Event()
    backend = FakeBackend(gate)
    metrics = Metrics()
    batcher = make_batcher(backend, cache=l1_cache(), metrics=metrics)
    early = [asyncio.create_task(batcher.embed("m", ["same prompt"])) for _ in range(25)]
    await backend.started.wait()  # the window closed and the call is running: the rest join it in flight
    late = [asyncio.create_task(batcher.embed("m", ["same prompt"])) for _ in range(25)]
    await until(lambda: batcher.waiting == 50)
    gate.set()
    results = await asyncio.gather(*early, *late)
    assert backend.inputs == ["same prompt"]
    assert all(np.allclose(r.vectors[0], expected("same prompt")) for r in results)
    assert sum(r.coalesced for r in results) == 49
    assert sample(metrics, "mergebroker_embedding_coalesced_total") == 49
    assert batcher.pending == 0


async def test_partial_hits_send_only_the_misses_and_answers_keep_input_order() -> None:
    backend = FakeBackend()
    batcher = make_batcher(backend, cache=l1_cache())
    await batcher.embed("m", ["a", "b"])
    result = await batcher.embed("m", ["c", "a", "d", "c", "b"])
    assert backend.calls[1] == ("m", ["c", "d"], None)
    for vector, text in zip(result.vectors, ["c", "a", "d", "c", "b"]):
        assert np.allclose(vector, expected(text))
    assert (result.cached, result.coalesced) == (2, 1)


async def test_usage_of_a_lone_request_is_the_backends_count_and_cached_texts_use_count_tokens() -> None:
    backend = FakeBackend()
    batcher = make_batcher(backend, cache=l1_cache())
    first = await batcher.embed("m", ["one two", "three four five"])
    assert first.prompt_tokens == 5
    second = await batcher.embed("m", ["one two", "six"])
    assert second.prompt_tokens == 3 and second.cached == 1


async def test_a_full_window_is_sent_at_once_without_waiting_for_its_timer() -> None:
    backend = FakeBackend()
    timer = ManualTimer()  # never fires unless told
    batcher = make_batcher(backend, timer=timer, max_batch_size=3, window_s=3600)
    async with asyncio.timeout(5):
        results = await asyncio.gather(*(batcher.embed("m", [t]) for t in ["x", "y", "z"]))
    assert backend.calls == [("m", ["x", "y", "z"], None)]
    assert [np.allclose(r.vectors[0], expected(t)) for r, t in zip(results, "xyz")] == [True] * 3
    assert timer.delays == [3600] and timer.active == 0


async def test_texts_of_concurrent_callers_wait_for_the_window_timer_and_share_one_call() -> None:
    backend = FakeBackend()
    timer = ManualTimer()
    batcher = make_batcher(backend, timer=timer, window_s=0.05)
    tasks = [asyncio.create_task(batcher.embed("m", texts)) for texts in (["p", "q"], ["r"], ["q"])]
    await until(lambda: batcher.pending == 3)
    assert backend.calls == []
    assert timer.fire_all() == 1
    results = await asyncio.gather(*tasks)
    assert backend.calls == [("m", ["p", "q", "r"], None)]
    assert np.allclose(results[2].vectors[0], expected("q"))


async def test_the_real_loop_timer_closes_a_window() -> None:
    backend = FakeBackend()
    batcher = make_batcher(backend, window_s=0.001, call_later=None)
    results = await asyncio.gather(batcher.embed("m", ["a"]), batcher.embed("m", ["b"]))
    assert backend.calls == [("m", ["a", "b"], None)]
    assert np.allclose(results[1].vectors[0], expected("b"))


async def test_a_text_that_would_overflow_the_token_limit_starts_a_new_batch() -> None:
    backend = FakeBackend()
    timer = ManualTimer()
    batcher = make_batcher(backend, timer=timer, max_batch_tokens=5)
    tasks = [asyncio.create_task(batcher.embed("m", [t])) for t in ["a b c", "d e f", "g h i"]]
    await until(lambda: len(backend.calls) == 2)
    assert [texts for _, texts, _ in backend.calls] == [["a b c"], ["d e f"]]
    timer.fire_all()
    await asyncio.gather(*tasks)
    assert backend.calls[2][1] == ["g h i"]


async def test_models_and_dimensions_are_batched_separately() -> None:
    backend = FakeBackend()
    timer = ManualTimer()
    batcher = make_batcher(backend, timer=timer)
    tasks = [asyncio.create_task(batcher.embed(model, ["t"], dimensions=dims))
             for model, dims in [("m", None), ("m", 8), ("other", None), ("m", None)]]
    await until(lambda: batcher.waiting == 4)
    assert batcher.pending == 3
    timer.fire_all()
    results = await asyncio.gather(*tasks)
    assert sorted((m, str(d)) for m, _, d in backend.calls) == [("m", "8"), ("m", "None"), ("other", "None")]
    assert np.allclose(results[2].vectors[0], expected("t", "other"))


async def test_a_failed_batch_fails_only_its_own_waiters_and_caches_nothing() -> None:
    backend = FakeBackend(fail_on="boom")
    timer = ManualTimer()
    batcher = make_batcher(backend, cache=l1_cache(), timer=timer)
    doomed = [asyncio.create_task(batcher.embed("m", texts)) for texts in (["boom"], ["fine"])]
    await until(lambda: batcher.pending == 2)
    timer.fire_all()
    survivor = asyncio.create_task(batcher.embed("m", ["fine", "other"]))
    await until(lambda: batcher.pending >= 1 and len(backend.calls) == 1)
    for task in doomed:
        with pytest.raises(UpstreamHTTPError):
            await task
    timer.fire_all()
    result = await survivor
    assert np.allclose(result.vectors[0], expected("fine"))
    assert backend.calls[1][1] == ["fine", "other"]  # "fine" failed before, so it was not cached
    assert batcher.pending == 0


async def test_an_input_the_upstream_rejects_fails_only_its_callers_and_the_rest_of_the_window_succeeds() -> None:
    backend = FakeBackend(fail_on="far too long", fail_status=400)
    timer = ManualTimer()
    batcher = make_batcher(backend, cache=l1_cache(), timer=timer)
    good = asyncio.create_task(batcher.embed("m", ["first fine", "second fine"]))
    bad = asyncio.create_task(batcher.embed("m", ["far too long"]))
    also_bad = asyncio.create_task(batcher.embed("m", ["third fine", "far too long"]))
    await until(lambda: batcher.pending == 4)
    timer.fire_all()
    result = await good
    assert [np.allclose(v, expected(t)) for v, t in zip(result.vectors, ["first fine", "second fine"])] == [True, True]
    for task in (bad, also_bad):
        with pytest.raises(UpstreamHTTPError) as info:
            await task
        assert info.value.status == 400
    assert backend.calls[0][1] == ["first fine", "second fine", "far too long", "third fine"]
    assert sorted(texts[0] for _, texts, _ in backend.calls[1:]) == sorted(backend.calls[0][1])
    assert batcher.pending == 0
    assert (await batcher.embed("m", ["third fine"])).cached == 1  # the good texts' vectors were cached


async def test_a_rejected_unknown_model_fails_the_batch_without_retrying_each_text() -> None:
    backend = FakeBackend(fail_on="a", fail_status=404)
    batcher = make_batcher(backend, max_batch_size=2)
    with pytest.raises(UpstreamHTTPError):
        await batcher.embed("m", ["a", "b"])
    assert len(backend.calls) == 1


async def test_scoped_texts_share_neither_cache_entries_nor_pending_calls_across_scopes() -> None:
    backend = FakeBackend()
    timer = ManualTimer()
    batcher = make_batcher(backend, cache=l1_cache(), timer=timer)
    calls = [asyncio.create_task(batcher.embed("m", ["same text"], scope=s)) for s in ("tenant:a", "tenant:b")]
    await until(lambda: batcher.pending == 2)
    timer.fire_all()
    first, second = await asyncio.gather(*calls)
    assert first.coalesced == second.coalesced == 0
    assert backend.inputs == ["same text", "same text"]
    assert (await batcher.embed("m", ["same text"], scope="tenant:a")).cached == 1
    other = asyncio.create_task(batcher.embed("m", ["same text"], scope="tenant:c"))
    await until(lambda: batcher.pending == 1)  # a miss: it waits in a window
    timer.fire_all()
    assert (await other).cached == 0


async def test_a_backend_reply_with_missing_vectors_fails_the_batch() -> None:
    async def short_backend(model: str, texts: list[str], dimensions: int | None) -> EmbedResult:
        return EmbedResult([expected(texts[0])], prompt_tokens=1)

    batcher = make_batcher(short_backend, max_batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(UpstreamBadResponse):
        await batcher.embed("m", ["a", "b"])
    assert batcher.pending == 0


async def test_a_cancelled_callers_text_is_dropped_before_the_call_when_nobody_else_waits() -> None:
    backend = FakeBackend()
    timer = ManualTimer()
    metrics = Metrics()
    batcher = make_batcher(backend, timer=timer, metrics=metrics)
    task = asyncio.create_task(batcher.embed("m", ["lonely", "shared"]))
    other = asyncio.create_task(batcher.embed("m", ["shared"]))
    await until(lambda: batcher.pending == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert batcher.pending == 1
    assert sample(metrics, "mergebroker_embedding_window_pending") == 1
    timer.fire_all()
    result = await other
    assert backend.calls == [("m", ["shared"], None)]
    assert np.allclose(result.vectors[0], expected("shared"))
    assert batcher.pending == 0 and sample(metrics, "mergebroker_embedding_window_pending") == 0


async def test_a_caller_that_times_out_during_the_call_leaves_nothing_pending_and_the_vector_is_cached() -> None:
    gate = asyncio.Event()
    backend = FakeBackend(gate)
    batcher = make_batcher(backend, cache=l1_cache(), max_batch_size=1)
    task = asyncio.create_task(batcher.embed("m", ["slow"]))
    await backend.started.wait()
    task.cancel()  # what asyncio.timeout does to the caller
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    await batcher.drain()
    assert batcher.pending == 0
    again = await batcher.embed("m", ["slow"])
    assert again.cached == 1 and len(backend.calls) == 1


async def test_a_backend_call_past_call_timeout_fails_its_waiters_with_upstream_timeout() -> None:
    backend = FakeBackend(asyncio.Event())  # the gate never opens
    batcher = make_batcher(backend, max_batch_size=1, call_timeout_s=0.01)
    with pytest.raises(UpstreamTimeout):
        await batcher.embed("m", ["stuck"])
    assert batcher.pending == 0


async def test_close_fails_waiting_callers_with_overloaded() -> None:
    backend = FakeBackend(asyncio.Event())
    timer = ManualTimer()
    batcher = make_batcher(backend, timer=timer, max_batch_tokens=1)
    running = asyncio.create_task(batcher.embed("m", ["in call"]))
    await backend.started.wait()
    waiting = asyncio.create_task(batcher.embed("m", ["x"], dimensions=4))
    await until(lambda: batcher.pending == 2)
    await batcher.close()
    for task in (running, waiting):
        with pytest.raises(Overloaded):
            await task
    assert batcher.pending == 0


async def test_metrics_count_batch_sizes_and_cache_results_per_level() -> None:
    metrics = Metrics()
    cache = TwoLevelCache(LruCache(max_entries=100, max_bytes=1 << 20, ttl_s=None), None,
                          metrics_hook=cache_metrics_hook(metrics))
    batcher = make_batcher(FakeBackend(), cache=cache, metrics=metrics)
    await batcher.embed("m", ["a", "b", "c"])
    await batcher.embed("m", ["a", "d"])
    assert sample(metrics, "mergebroker_embedding_batch_size_count") == 2
    assert sample(metrics, "mergebroker_embedding_batch_size_sum") == 4
    assert sample(metrics, "mergebroker_embedding_cache_events_total", {"level": "l1", "result": "hit"}) == 1
    assert sample(metrics, "mergebroker_embedding_cache_events_total", {"level": "l1", "result": "miss"}) == 4


async def test_float16_cache_entries_come_back_close_to_the_fresh_vectors() -> None:
    backend = FakeBackend()
    batcher = make_batcher(backend, cache=l1_cache(), dtype="float16")
    fresh = await batcher.embed("m", ["half"])
    cached = await batcher.embed("m", ["half"])
    assert cached.cached == 1
    assert np.abs(cached.vectors[0] - fresh.vectors[0]).max() <= 2.0 ** -12


async def test_an_empty_request_needs_no_backend_call() -> None:
    backend = FakeBackend()
    result = await make_batcher(backend).embed("m", [])
    assert result == EmbedResult([], 0) and backend.calls == []


@pytest.mark.redis
async def test_a_restarted_batcher_reads_redis_with_one_mget_and_survives_redis_stopping(redis_server) -> None:
    admin = redis_asyncio.Redis.from_url(redis_server.url)
    clients = [make_redis_client(redis_server.url) for _ in range(2)]

    def two_level(client: redis_asyncio.Redis) -> TwoLevelCache:
        return TwoLevelCache(LruCache(max_entries=100, max_bytes=1 << 20, ttl_s=None),
                             RedisCache(client, prefix="emb:", ttl_s=60))

    try:
        first_backend = FakeBackend()
        await make_batcher(first_backend, cache=two_level(clients[0])).embed("m", ["a", "b"])
        restarted_backend = FakeBackend()
        restarted = make_batcher(restarted_backend, cache=two_level(clients[1]))
        await admin.config_resetstat()
        result = await restarted.embed("m", ["b", "a"])
        stats = await admin.info("commandstats")
        assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
        assert restarted_backend.calls == [] and result.cached == 2
        assert np.allclose(result.vectors[0], expected("b"))

        redis_server.stop()
        after = await restarted.embed("m", ["a", "c"])
        assert np.allclose(after.vectors[0], expected("a")) and np.allclose(after.vectors[1], expected("c"))
        assert restarted_backend.inputs == ["c"]  # "a" came from L1, copied there from Redis
    finally:
        for client in (admin, *clients):
            await client.aclose()
