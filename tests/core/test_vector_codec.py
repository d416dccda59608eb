"""Vectors survive the byte codecs: float32 exactly, float16 within its documented error, base64 as OpenAI's float32."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from mergebroker.merge.embedder import fake_vector
from mergebroker.merge.vector_codec import decode_vector, encode_vector, from_base64, to_base64
from mergebroker.vectors import normalize_rows


def unit_vectors(n: int = 200, dim: int = 384) -> np.ndarray:
    rng = np.random.default_rng(7)
    return normalize_rows(rng.standard_normal((n, dim)))


def test_float32_round_trip_is_exact_and_four_bytes_per_component() -> None:
    vec = unit_vectors(1)[0]
    data = encode_vector(vec, "float32")
    assert len(data) == 4 * 384
    assert np.array_equal(decode_vector(data, "float32"), vec)


def test_float16_halves_the_bytes_and_stays_within_half_a_step_of_each_component() -> None:
    vectors = unit_vectors()
    for vec in vectors:
        data = encode_vector(vec, "float16")
        assert len(data) == 2 * 384
        back = decode_vector(data, "float16")
        assert back.dtype == np.float32
        assert np.abs(back - vec).max() <= 2.0 ** -12
        cosine = float(back @ vec / np.linalg.norm(back))
        assert cosine >= 1 - 1e-6


def test_float16_keeps_similarity_between_different_texts_within_1e_3() -> None:
    texts = ["what is the capital of france", "capital city of france?", "how to bake bread", "bread recipe"]
    vectors = np.stack([fake_vector(t, 384) for t in texts])
    back = np.stack([decode_vector(encode_vector(v, "float16"), "float16") for v in vectors])
    assert np.abs(vectors @ vectors.T - back @ back.T).max() < 1e-3


def test_base64_is_little_endian_float32_bytes_as_openai_sends_them() -> None:
    assert to_base64(np.array([1.0, -2.0])) == base64.b64encode(b"\x00\x00\x80\x3f\x00\x00\x00\xc0").decode()
    vec = unit_vectors(1)[0]
    decoded = np.frombuffer(base64.b64decode(to_base64(vec)), dtype="<f4")
    assert np.array_equal(decoded, vec)
    assert np.array_equal(from_base64(to_base64(vec)), vec)


def test_decoded_vectors_are_writable_copies_not_views_of_the_bytes() -> None:
    back = decode_vector(encode_vector(np.ones(3), "float32"), "float32")
    back[0] = 5.0
    assert back.tolist() == [5.0, 1.0, 1.0]


def test_bad_lengths_and_unknown_dtypes_are_refused() -> None:
    with pytest.raises(ValueError):
        decode_vector(b"\x00\x00\x00", "float32")
    with pytest.raises(ValueError):
        encode_vector(np.ones(2), "int8")  # type: ignore[arg-type]
