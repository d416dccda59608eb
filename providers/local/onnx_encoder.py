"""The similarity model run by onnxruntime: the quantised export of all-MiniLM-L6-v2 (`onnx_export`).

Tokenising (the model's own `tokenizer.json`), mean pooling and normalising happen here, as
sentence-transformers does them, so vectors match the torch model's up to quantisation. Measured on
one thread (`python -m bench.embedding_backends`) against the torch int8 copy: 1.5-2.7x less CPU per
short question, 1.35-2.3x less per prompt of 20-200 words, and pair cosines ~3x closer to the float
model's (at most 0.03 off, against 0.08). Blocking: the host runs it on its model thread.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mergebroker.vectors import normalize_rows

MAX_CALL_TOKENS = 256
"""Padded tokens per onnxruntime call. Measured: texts of 100+ tokens cost ~2x more each in a call of 32
than alone (activations outgrow the caches), while short texts gain from sharing a call."""

PROBE_TEXTS = ("How do I reset my password?", "Is it safe to freeze cooked rice? Thanks.",
               "Write a short poem about the sea and the wind.")
MIN_PROBE_COSINE = 0.97
"""An export whose probe vectors fall below this cosine against the float model's is refused: a broken
export must never decide what merges (a sound one measures above 0.99)."""


def plan_calls(lengths: Sequence[int], max_tokens: int = MAX_CALL_TOKENS) -> list[list[int]]:
    """Indices of texts, grouped into model calls: sorted by token count so a call pads little, each call's
    padded size (its longest text times its count) at most `max_tokens`; a longer text goes alone."""
    calls: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and lengths[index] * (len(current) + 1) > max_tokens:
            calls.append(current)
            current = []
        current.append(index)
    if current:
        calls.append(current)
    return calls


class OnnxEncoder:
    """Unit vectors from an onnxruntime session over the exported transformer (token vectors out)."""

    def __init__(self, session: Any, tokenizer: Any, *, dimension: int) -> None:
        self._session = session
        self._tokenizer = tokenizer
        self._inputs = {i.name for i in session.get_inputs()}
        self.dimension = dimension

    @classmethod
    def load(cls, onnx_path: str | Path, model_path: str | Path, *, threads: int, max_seq_length: int
             ) -> OnnxEncoder:
        """A session over `onnx_path` using `threads` threads (0: onnxruntime's choice) and the tokenizer of the
        model in `model_path`, truncating at `max_seq_length` tokens as sentence-transformers does."""
        import onnxruntime as ort
        from tokenizers import Tokenizer

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3  # its own warnings would bypass the broker's structured logs
        # Idle pool threads spin by default: on a busy host that takes CPU from the event loop.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        tokenizer.no_padding()  # the file pads to 128; calls here pad to their own longest text
        tokenizer.enable_truncation(max_seq_length)
        dimension = int(json.loads((Path(model_path) / "config.json").read_text())["hidden_size"])
        return cls(session, tokenizer, dimension=dimension)

    def encode(self, texts: Sequence[str], *, normalize: bool = True) -> np.ndarray:
        """Mean-pooled vectors for `texts` as float32 `(len(texts), dimension)`, unit length if `normalize`."""
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        if not texts:
            return out
        ids = [e.ids for e in self._tokenizer.encode_batch(list(texts))]
        for call in plan_calls([len(row) for row in ids]):
            out[call] = self._pooled([ids[i] for i in call])
        return normalize_rows(out) if normalize else out

    def check(self, expected: np.ndarray) -> float:
        """The lowest cosine between this encoder's `PROBE_TEXTS` vectors and `expected` (the float model's);
        raises `ValueError` below `MIN_PROBE_COSINE`."""
        lowest = float(np.min(np.sum(self.encode(PROBE_TEXTS) * normalize_rows(expected), axis=1)))
        if not lowest >= MIN_PROBE_COSINE:
            raise ValueError(f"the ONNX model's vectors drift from the float model's (cosine {lowest:.3f})")
        return lowest

    def _pooled(self, rows: list[list[int]]) -> np.ndarray:
        width = max(len(row) for row in rows)
        ids = np.zeros((len(rows), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = row
            mask[i, :len(row)] = 1
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        tokens = self._session.run(None, {k: v for k, v in feed.items() if k in self._inputs})[0]
        weights = mask[..., None].astype(np.float32)
        return (tokens * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)


def load_checked(model: Any, model_path: str | Path, cache_dir: str | Path, *, threads: int) -> OnnxEncoder:
    """An `OnnxEncoder` over the quantised export of `model` (a loaded SentenceTransformer), exported into
    `cache_dir` if needed and checked against `model` itself. A cached file that fails to load or to pass
    the check is deleted and exported afresh once; what still fails raises (the caller falls back to torch)."""
    from mergebroker.providers.local.onnx_export import export_name, quantised_model

    expected = model.encode(list(PROBE_TEXTS), normalize_embeddings=True, convert_to_numpy=True,
                            show_progress_bar=False)

    def checked(path: Path) -> OnnxEncoder:
        try:
            encoder = OnnxEncoder.load(path, model_path, threads=threads, max_seq_length=int(model.max_seq_length))
            encoder.check(expected)
            return encoder
        except Exception:
            path.unlink(missing_ok=True)  # damaged or drifted: never reused
            raise

    cached = (Path(cache_dir) / export_name(model_path)).exists()
    try:
        return checked(quantised_model(model, model_path, cache_dir))
    except Exception:
        if not cached:
            raise
    return checked(quantised_model(model, model_path, cache_dir))
