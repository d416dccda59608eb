"""The local embedding provider answers with the real all-MiniLM-L6-v2 vectors from one shared, off-loop model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from mergebroker.broker.engine.embeddings.batcher import EmbeddingBatcher
from mergebroker.errors import InvalidRequest, NotFound
from mergebroker.providers.local.embeddings import LocalEmbeddingBackend
from mergebroker.providers.local.model import LocalEmbedder, SentenceModelHost
from mergebroker.vectors import normalize_rows

pytestmark = pytest.mark.model

PARAPHRASES = [
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How do I reset my password?", "How can I change my password?"),
    ("The cat sits on the mat.", "A cat is sitting on a mat."),
]
UNRELATED = [
    ("What is the capital of France?", "How do I bake sourdough bread at home?"),
    ("The cat sits on the mat.", "Quarterly revenue grew by twelve percent."),
    ("How do I reset my password?", "Explain the theory of general relativity."),
]


@pytest.fixture(scope="module")
def host() -> Iterator[SentenceModelHost]:
    # The host's worker thread outlives event loops, so one load serves every test's loop.
    model_host = SentenceModelHost(threads=2)
    asyncio.run(model_host.load())
    yield model_host
    model_host.close()


async def test_vectors_equal_sentence_transformers_own_normalised_encoding(host: SentenceModelHost) -> None:
    from sentence_transformers import SentenceTransformer

    texts = [a for a, _ in PARAPHRASES] + ["", "a much longer sentence " * 20]
    result = await LocalEmbeddingBackend(host)("all-MiniLM-L6-v2", texts, None)
    assert isinstance(host.model, SentenceTransformer)
    reference = host.model.encode(texts, normalize_embeddings=True)
    assert np.allclose(np.stack(result.vectors), reference, atol=1e-6)
    assert all(v.shape == (384,) and v.dtype == np.float32 for v in result.vectors)


async def test_paraphrases_are_close_and_unrelated_texts_are_far(host: SentenceModelHost) -> None:
    backend = LocalEmbeddingBackend(host)
    for pairs, check in ((PARAPHRASES, lambda c: c > 0.8), (UNRELATED, lambda c: c < 0.3)):
        for a, b in pairs:
            va, vb = (await backend("local-minilm", [a, b], None)).vectors
            assert check(float(va @ vb)), (a, b, float(va @ vb))


async def test_dimensions_truncates_and_renormalises_like_openai(host: SentenceModelHost) -> None:
    backend = LocalEmbeddingBackend(host)
    full = (await backend("all-MiniLM-L6-v2", ["shorten me"], None)).vectors[0]
    short = (await backend("all-MiniLM-L6-v2", ["shorten me"], 64)).vectors[0]
    assert short.shape == (64,)
    assert abs(float(np.linalg.norm(short)) - 1.0) < 1e-5
    assert np.allclose(short, normalize_rows(full[:64]), atol=1e-6)


async def test_prompt_tokens_are_counted_with_the_models_tokenizer(host: SentenceModelHost) -> None:
    texts = ["hello world", "tokenisation counts word pieces"]
    result = await LocalEmbeddingBackend(host)("all-MiniLM-L6-v2", texts, None)
    ids = host.model.tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert result.prompt_tokens == sum(len(row) for row in ids) > 4


async def test_unknown_models_and_impossible_dimensions_are_refused(host: SentenceModelHost) -> None:
    backend = LocalEmbeddingBackend(host, model_names=("only-this",))
    with pytest.raises(NotFound) as missing:
        await backend("all-MiniLM-L6-v2", ["x"], None)
    assert missing.value.code == "model_not_found"
    with pytest.raises(InvalidRequest) as too_wide:
        await backend("only-this", ["x"], 385)
    assert too_wide.value.param == "dimensions"


async def test_the_merge_engine_embedder_and_the_provider_share_one_loaded_model(host: SentenceModelHost) -> None:
    model = host.model
    await host.load()
    assert host.model is model
    embedder = LocalEmbedder(host)
    assert embedder.ready
    from_embedder = await embedder.embed(["shared model"])
    from_provider = await LocalEmbeddingBackend(host)("local-minilm", ["shared model"], None)
    assert np.allclose(from_embedder[0], from_provider.vectors[0], atol=1e-6)


async def test_the_batcher_serves_concurrent_callers_from_the_local_model(host: SentenceModelHost) -> None:
    batcher = EmbeddingBatcher(LocalEmbeddingBackend(host), cache=None, cache_version="1", window_s=0.002,
                               max_batch_size=32, max_batch_tokens=8192, count_tokens=lambda t: len(t.split()),
                               ttl_s=None)
    first, second = await asyncio.gather(batcher.embed("local-minilm", ["What is the capital of France?"]),
                                         batcher.embed("local-minilm", ["Which city is the capital of France?"]))
    assert float(first.vectors[0] @ second.vectors[0]) > 0.8
    assert first.prompt_tokens > 0 and batcher.pending == 0


async def test_loading_runs_off_the_event_loop_and_is_shared_by_concurrent_callers() -> None:
    fresh = SentenceModelHost()
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while not fresh.ready and ticks < 20:
            ticks += 1
            await asyncio.sleep(0)  # a yield, not a wait: counts loop turns taken during the load

    try:
        assert not fresh.ready
        beat = asyncio.create_task(heartbeat())
        await asyncio.gather(fresh.load(), fresh.load(), fresh.encode(["waits for the load"]))
        await beat
        assert fresh.ready and fresh.dimension == 384
        assert ticks == 20  # the loop kept turning while the model loaded
    finally:
        fresh.close()
