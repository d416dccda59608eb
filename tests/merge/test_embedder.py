"""The embedder wrappers and fake give unit rows in input order, never re-embed cached texts and refuse bad replies."""

from __future__ import annotations

import numpy as np
import pytest

from mergebroker.errors import UpstreamBadResponse
from mergebroker.merge.embedder import CachingEmbedder, FakeEmbedder, RemoteEmbedder, fake_vector
from mergebroker.vectors import normalize_rows


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b)


def test_fake_vectors_are_deterministic_unit_vectors_that_rank_similar_strings_higher() -> None:
    a = fake_vector("What is the capital of France?")
    assert np.array_equal(a, fake_vector("What is the capital of France?"))
    assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-6
    similar = fake_vector("what is the capital of france")
    unrelated = fake_vector("Explain quicksort in Python.")
    assert cosine(a, similar) > 0.8
    assert cosine(a, unrelated) < 0.3
    assert abs(float(np.linalg.norm(fake_vector(""))) - 1.0) < 1e-6


async def test_fake_embedder_records_calls_and_returns_one_row_per_text() -> None:
    fake = FakeEmbedder(dim=16)
    out = await fake.embed(["a", "b"])
    assert out.shape == (2, 16) and out.dtype == np.float32
    assert (await fake.embed([])).shape == (0, 16)
    assert fake.calls == [["a", "b"], []]


def test_normalize_rows_leaves_zero_rows_zero_instead_of_nan() -> None:
    out = normalize_rows(np.array([[3.0, 4.0], [0.0, 0.0]]))
    assert np.allclose(out, [[0.6, 0.8], [0.0, 0.0]])
    assert not np.isnan(out).any()


async def test_caching_embedder_sends_only_unseen_texts_in_one_call_and_keeps_input_order() -> None:
    inner = FakeEmbedder(dim=32)
    caching = CachingEmbedder(inner)
    await caching.embed(["alpha", "beta"])
    out = await caching.embed(["gamma", "alpha", "gamma", "delta", "beta"])
    assert inner.calls == [["alpha", "beta"], ["gamma", "delta"]]
    expected = np.stack([fake_vector(t, 32) for t in ["gamma", "alpha", "gamma", "delta", "beta"]])
    assert np.allclose(out, expected)
    await caching.embed(["delta", "alpha"])
    assert len(inner.calls) == 2


async def test_caching_embedder_evicts_the_least_recently_used_text_beyond_max_entries() -> None:
    inner = FakeEmbedder(dim=8)
    caching = CachingEmbedder(inner, max_entries=2)
    await caching.embed(["a", "b"])
    await caching.embed(["a"])          # "a" is now the most recent
    await caching.embed(["c"])          # evicts "b"
    await caching.embed(["a", "b"])
    assert inner.calls[-1] == ["b"]
    assert len(caching) == 2


async def test_caching_embedder_results_can_be_changed_by_the_caller_without_corrupting_the_cache() -> None:
    caching = CachingEmbedder(FakeEmbedder(dim=8))
    first = await caching.embed(["a"])
    first[0, :] = 0.0
    again = await caching.embed(["a"])
    assert np.allclose(again[0], fake_vector("a", 8))


async def test_remote_embedder_normalises_the_upstream_rows() -> None:
    async def upstream(texts: list[str]) -> np.ndarray:
        return np.array([[3.0, 4.0]] * len(texts))

    out = await RemoteEmbedder(upstream).embed(["x", "y"])
    assert np.allclose(out, [[0.6, 0.8], [0.6, 0.8]])
    assert out.dtype == np.float32


async def test_remote_embedder_refuses_a_reply_with_the_wrong_number_of_rows() -> None:
    async def upstream(texts: list[str]) -> np.ndarray:
        return np.ones((1, 4))

    with pytest.raises(UpstreamBadResponse):
        await RemoteEmbedder(upstream).embed(["x", "y"])


async def test_batching_embedder_gathers_concurrent_calls_into_the_next_model_call():
    import asyncio

    from mergebroker.merge.embedder import BatchingEmbedder, FakeEmbedder

    class Gated(FakeEmbedder):
        def __init__(self) -> None:
            super().__init__()
            self.gate = asyncio.Event()
            self.sizes: list[int] = []

        async def embed(self, texts):
            self.sizes.append(len(texts))
            await self.gate.wait()
            return await super().embed(texts)

    inner = Gated()
    batching = BatchingEmbedder(inner)
    first = asyncio.create_task(batching.embed(["a"]))
    await asyncio.sleep(0)
    later = [asyncio.create_task(batching.embed([f"text {i}", f"more {i}"])) for i in range(5)]
    await asyncio.sleep(0)
    inner.gate.set()
    results = await asyncio.gather(first, *later)
    assert inner.sizes == [1, 10]
    for i, vectors in enumerate(results[1:]):
        assert vectors.shape[0] == 2
        assert (vectors[0] == (await FakeEmbedder().embed([f"text {i}"]))[0]).all()


async def test_caching_embedder_never_encodes_a_text_that_is_already_being_encoded():
    import asyncio

    from mergebroker.merge.embedder import CachingEmbedder, FakeEmbedder

    class Gated(FakeEmbedder):
        def __init__(self) -> None:
            super().__init__()
            self.gate = asyncio.Event()
            self.seen: list[list[str]] = []

        async def embed(self, texts):
            self.seen.append(list(texts))
            await self.gate.wait()
            return await super().embed(texts)

    inner = Gated()
    caching = CachingEmbedder(inner)
    prefetch = asyncio.create_task(caching.embed(["a", "b"]))
    await asyncio.sleep(0)
    group = asyncio.create_task(caching.embed(["a", "b", "c"]))
    await asyncio.sleep(0)
    inner.gate.set()
    first, second = await asyncio.gather(prefetch, group)
    assert inner.seen == [["a", "b"], ["c"]]
    assert (second[:2] == first).all()


async def test_batching_embedder_reports_its_backlog_at_the_pace_of_its_recent_calls():
    """Texts waiting or running, times the wall seconds per text the model took lately (a starved model shows)."""
    import asyncio

    from mergebroker.clock import FakeClock
    from mergebroker.merge.embedder import BatchingEmbedder

    clock = FakeClock()

    class Slow(FakeEmbedder):
        """Takes 10 ms of the fake clock per text, once released."""

        def __init__(self) -> None:
            super().__init__()
            self.go = asyncio.Event()

        async def embed(self, texts):
            await self.go.wait()
            clock.advance(0.01 * len(texts))
            return await super().embed(texts)

    inner = Slow()
    batching = CachingEmbedder(BatchingEmbedder(inner, clock=clock))
    assert batching.backlog_s == 0.0  # no pace known yet
    inner.go.set()
    await batching.embed(["one", "two"])
    assert batching.backlog_s == 0.0 and batching.covers(["one", "two"]) and not batching.covers(["three"])
    inner.go.clear()
    waiting = [asyncio.ensure_future(batching.embed([f"text {i}" for i in range(k, k + 10)])) for k in (0, 10, 20)]
    await asyncio.sleep(0)
    assert batching.backlog_s == pytest.approx(30 * 0.01)  # 30 texts queued at 10 ms each
    assert batching.covers(["text 5"])  # being encoded: asking again adds no work
    inner.go.set()
    await asyncio.gather(*waiting)
    assert batching.backlog_s == 0.0
