"""The onnxruntime int8 copy of the similarity model: exported once from the bundled weights into a cache
directory, close to the float model, reused by the next host, rebuilt when damaged, and replaced by the
torch int8 copy (one warning) where it cannot be built."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from mergebroker.providers.local import onnx_export
from mergebroker.providers.local.model import (
    LocalEmbedder,
    SentenceModelHost,
    default_model_path,
)
from mergebroker.providers.local.onnx_encoder import OnnxEncoder, plan_calls

PARAPHRASES = [
    ("How do I reset my password?", "Hi, how can I reset my password? Thanks."),
    ("Can I freeze cooked rice?", "Is it safe to freeze cooked rice?"),
    ("Do I need a visa to visit Japan?", "Is a visa required to visit Japan?"),
]
DIFFERENT = [
    ("What is the capital of France?", "What is the capital of Germany?"),
    ("How do I cancel my subscription?", "How do I upgrade my subscription?"),
    ("How do I reset my password?", "Which planet is the largest in the solar system?"),
]


def onnx_host(cache_dir: Path) -> SentenceModelHost:
    return SentenceModelHost(threads=1, int8_copy=True, int8_runtime="onnx", onnx_cache_dir=cache_dir)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="module")
def host(cache_dir: Path) -> Iterator[SentenceModelHost]:
    # The host's worker thread outlives event loops, so one load (and one export) serves every test's loop.
    model_host = onnx_host(cache_dir)
    asyncio.run(model_host.load())
    yield model_host
    model_host.close()


def test_calls_are_planned_by_length_within_the_token_budget() -> None:
    lengths = [300, 10, 40, 12, 11, 100, 13]
    calls = plan_calls(lengths, max_tokens=64)
    assert sorted(i for call in calls for i in call) == list(range(len(lengths)))
    assert [lengths[i] for call in calls for i in call] == sorted(lengths)
    assert [300] in [[lengths[i] for i in call] for call in calls]  # too long to share: alone
    assert all(len(call) == 1 or max(lengths[i] for i in call) * len(call) <= 64 for call in calls)
    assert plan_calls([]) == []


@pytest.mark.model
async def test_the_export_lands_in_the_cache_dir_and_its_vectors_stay_close_to_the_float_model(
        host: SentenceModelHost, cache_dir: Path) -> None:
    assert host.int8_runtime == "onnx"
    assert [p.name for p in cache_dir.iterdir()] == [onnx_export.export_name(default_model_path())]
    texts = [t for pair in PARAPHRASES + DIFFERENT for t in pair] + ["", "a much longer prompt " * 80]
    cheap, exact = await LocalEmbedder(host, int8=True).embed(texts), await LocalEmbedder(host).embed(texts)
    assert cheap.shape == exact.shape == (len(texts), 384) and cheap.dtype == np.float32
    assert np.allclose(np.linalg.norm(cheap, axis=1), 1.0, atol=1e-5)
    assert float(np.min(np.sum(cheap * exact, axis=1))) > 0.97


@pytest.mark.model
async def test_the_085_threshold_separates_paraphrases_from_near_misses(host: SentenceModelHost) -> None:
    embedder = LocalEmbedder(host, int8=True)
    for pairs, same in ((PARAPHRASES, True), (DIFFERENT, False)):
        for a, b in pairs:
            va, vb = await embedder.embed([a, b])
            assert (float(va @ vb) > 0.85) is same, (a, b, float(va @ vb))


@pytest.mark.model
async def test_a_second_host_reuses_the_export_without_exporting_again(
        host: SentenceModelHost, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_export(*args: object) -> None:
        raise AssertionError("exported again")

    monkeypatch.setattr(onnx_export, "export_float", no_export)
    second = onnx_host(cache_dir)
    try:
        await second.load()
        assert second.int8_runtime == "onnx"
        text = ["Is a visa required to visit Japan?"]
        assert np.allclose(await second.encode(text, int8=True), await host.encode(text, int8=True), atol=1e-6)
    finally:
        second.close()


@pytest.mark.model
async def test_a_damaged_cached_export_is_replaced_by_a_fresh_one(tmp_path: Path) -> None:
    damaged = tmp_path / onnx_export.export_name(default_model_path())
    damaged.write_bytes(b"not an onnx model")
    fresh = onnx_host(tmp_path)
    try:
        await fresh.load()
        assert fresh.int8_runtime == "onnx"
        assert damaged.stat().st_size > 1_000_000
    finally:
        fresh.close()


@pytest.mark.model
async def test_without_a_usable_cache_dir_the_host_falls_back_to_torch_int8_with_one_warning(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file-not-a-dir"
    blocked.write_text("")
    fallback = onnx_host(blocked)
    try:
        with capture_logs() as logs:
            await fallback.load()
            vectors = await LocalEmbedder(fallback, int8=True).embed(["How do I reset my password?"])
        assert fallback.int8_runtime == "torch"
        warnings = [e for e in logs if e["event"] == "embedding_onnx_unavailable"]
        assert len(warnings) == 1 and warnings[0]["fallback"] == "torch-int8"
        assert vectors.shape == (1, 384)
    finally:
        fallback.close()


async def test_an_export_that_drifts_from_the_float_model_is_refused() -> None:
    class Session:
        def get_inputs(self) -> list:
            return [type("Input", (), {"name": name})() for name in ("input_ids", "attention_mask")]

        def run(self, outputs: object, feed: dict) -> list[np.ndarray]:
            return [np.ones((*feed["input_ids"].shape, 4), dtype=np.float32)]  # every text the same vector

    class Tokenizer:
        def encode_batch(self, texts: list[str]) -> list:
            return [type("Encoding", (), {"ids": [101, 7, 102]})() for _ in texts]

    encoder = OnnxEncoder(Session(), Tokenizer(), dimension=4)
    expected = np.eye(4, dtype=np.float32)[:3]
    with pytest.raises(ValueError, match="drift"):
        encoder.check(expected)
