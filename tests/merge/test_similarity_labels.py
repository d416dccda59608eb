"""The similarity model separates paraphrases from unrelated questions at the default 0.85 threshold."""

from __future__ import annotations

import numpy as np
import pytest

from mergebroker.providers.local.model import LocalEmbedder, SentenceModelHost

PARAPHRASES = [
    ("How do I reset my password?", "How can I reset my password?"),
    ("What is the capital of France?", "What's the capital city of France?"),
    ("How do I cancel my subscription?", "How can I cancel my subscription?"),
    ("Summarise this article in three sentences.", "Summarize this article in three sentences."),
]
UNRELATED = [
    ("How do I reset my password?", "Which planet is the largest in the solar system?"),
    ("What is the capital of France?", "Write a haiku about autumn leaves."),
    ("How do I cancel my subscription?", "Explain how photosynthesis works."),
    ("Summarise this article in three sentences.", "What time zone is Tokyo in?"),
]


@pytest.fixture(scope="module")
def host():
    host = SentenceModelHost(threads=1, int8_copy=True)
    yield host
    host.close()


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
async def test_threshold_separates_the_labelled_pairs(host, int8):
    embedder = LocalEmbedder(host, int8=int8)
    for pairs, above in ((PARAPHRASES, True), (UNRELATED, False)):
        for a, b in pairs:
            va, vb = await embedder.embed([a, b])
            similarity = float(np.dot(va, vb))
            assert (similarity > 0.85) is above, (a, b, similarity)


async def test_int8_vectors_stay_close_to_the_float_model(host):
    texts = [a for a, _ in PARAPHRASES + UNRELATED]
    exact = await LocalEmbedder(host).embed(texts)
    quantised = await LocalEmbedder(host, int8=True).embed(texts)
    assert float(np.min(np.sum(exact * quantised, axis=1))) > 0.9
