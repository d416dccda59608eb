"""The embedding seam: `Embedder` turns texts into unit vectors, whoever computes them.

The torch runtime (`SentenceModelHost`, `LocalEmbedder`) lives with the providers in
`providers.local_model`; this module holds the seam, the wrappers every embedder shares (batching
concurrent calls, caching vectors by text), the upstream-backed embedder, and `FakeEmbedder`, the small
deterministic stand-in for unit tests of other components.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import structlog

from mergebroker.errors import UpstreamBadResponse
from mergebroker.vectors import normalize_rows

log = structlog.get_logger(__name__)


class Embedder(Protocol):
    """Turns texts into vectors for similarity.

    Contract: `embed(texts)` returns a float32 array of shape `(len(texts), dim)` whose rows are
    L2-normalised (a zero row only where the source gives no direction), in input order; an empty
    input gives shape `(0, dim)`. Failures raise `broker.errors.BrokerError` subclasses.
    `ready` is false while the embedder cannot answer yet (its model still loading).
    """

    @property
    def ready(self) -> bool: ...

    async def embed(self, texts: Sequence[str]) -> np.ndarray: ...


class RemoteEmbedder:
    """The `Embedder` over an OpenAI-compatible upstream; the caller supplies the call itself.

    `embed_fn(texts)` returns one row per text (any float array-like). Rows are normalised here,
    since not every upstream returns unit vectors; a reply of the wrong shape is an
    `UpstreamBadResponse`.
    """

    def __init__(self, embed_fn: Callable[[list[str]], Awaitable[np.ndarray]]) -> None:
        self._embed_fn = embed_fn

    @property
    def ready(self) -> bool:
        return True

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors from the upstream, one call for the whole list."""
        texts = list(texts)
        vectors = np.asarray(await self._embed_fn(texts), dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(texts):
            raise UpstreamBadResponse(
                f"embedding upstream returned shape {vectors.shape} for {len(texts)} inputs")
        return normalize_rows(vectors)


@runtime_checkable
class Paced(Protocol):
    """An embedder that can tell how far behind it is, so that callers with a deadline need not queue work
    that cannot finish in time."""

    @property
    def backlog_s(self) -> float:
        """Seconds the texts queued now (and the call running) are expected to take, at the recent pace."""


@runtime_checkable
class Backlogged(Paced, Protocol):
    """A `Paced` embedder that also tells which texts would add no work (`CachingEmbedder`)."""

    def covers(self, texts: Sequence[str]) -> bool:
        """Whether every one of `texts` is cached or already being encoded (asking adds no work)."""


PACE_WEIGHT = 0.3
"""Weight of the latest model call in the pace (seconds per text) a backlog is judged by."""


class BatchingEmbedder:
    """An `Embedder` whose concurrent calls share model calls: while one encode runs, the calls that arrive
    gather and go together in the next one (up to `max_batch` texts).

    No timer: a lone call is encoded at once, and under load batches grow by themselves, which is where
    the model is cheapest per text (several ms per text in a batch, 15-23 ms for a batch of one). It keeps
    the pace of its recent calls (wall seconds per text, so a host that starves the model thread shows),
    and `backlog_s` is the texts waiting or running at that pace.
    """

    def __init__(self, inner: Embedder, *, max_batch: int = 256, clock: Callable[[], float] = time.monotonic) -> None:
        self._inner = inner
        self._max_batch = max_batch
        self._clock = clock
        self._waiting: list[tuple[list[str], asyncio.Future[np.ndarray]]] = []
        self._running: asyncio.Task[None] | None = None
        self._queued = 0  # texts waiting or in the running call
        self._pace = 0.0  # wall seconds per text of recent calls

    @property
    def ready(self) -> bool:
        return self._inner.ready

    @property
    def backlog_s(self) -> float:
        """Seconds the queued and running texts are expected to take at the recent pace."""
        return self._queued * self._pace

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors for `texts`, possibly computed in one call with other callers' texts."""
        if not texts:
            return await self._inner.embed([])
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._waiting.append((list(texts), future))
        self._queued += len(texts)
        if self._running is None or self._running.done():
            self._running = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch: list[tuple[list[str], asyncio.Future[np.ndarray]]] = []
            size = 0
            while self._waiting and (not batch or size + len(self._waiting[0][0]) <= self._max_batch):
                texts, future = self._waiting.pop(0)
                if not future.done():  # a caller that left is dropped before the call
                    batch.append((texts, future))
                    size += len(texts)
                else:
                    self._queued -= len(texts)
            if not batch:
                continue
            started = self._clock()
            try:
                vectors = await self._inner.embed([t for texts, _ in batch for t in texts])
            except Exception as exc:  # noqa: BLE001 - every waiter of this call gets the error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            finally:
                self._queued -= size
            pace = (self._clock() - started) / size
            self._pace = pace if self._pace == 0.0 else PACE_WEIGHT * pace + (1 - PACE_WEIGHT) * self._pace
            start = 0
            for texts, future in batch:
                if not future.done():
                    future.set_result(vectors[start:start + len(texts)])
                start += len(texts)


class CachingEmbedder:
    """An `Embedder` that remembers vectors by text hash (LRU) and asks `inner` only for unseen texts.

    All misses of one `embed` call, duplicates collapsed, go to `inner` in a single call; a text already
    being encoded for another caller is awaited, not encoded again (prefetched texts rely on this).
    """

    def __init__(self, inner: Embedder, *, max_entries: int = 10000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._inner = inner
        self._max_entries = max_entries
        self._vectors: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future[np.ndarray]] = {}

    @property
    def ready(self) -> bool:
        return self._inner.ready

    def __len__(self) -> int:
        return len(self._vectors)

    @property
    def backlog_s(self) -> float:
        """The inner embedder's backlog (`Paced`), or 0 when it cannot tell."""
        return self._inner.backlog_s if isinstance(self._inner, Paced) else 0.0

    def covers(self, texts: Sequence[str]) -> bool:
        """Whether every one of `texts` is cached or already being encoded."""
        return all(key in self._vectors or key in self._pending for key in map(_text_key, texts))

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors for `texts`; cached rows come from memory, texts being encoded for another caller
        are awaited (never encoded twice), the rest come from one `inner` call."""
        if not texts:
            return await self._inner.embed([])
        keys = [_text_key(t) for t in texts]
        found: dict[bytes, np.ndarray] = {}
        waiting: dict[bytes, asyncio.Future[np.ndarray]] = {}
        misses: dict[bytes, str] = {}
        for key, text in zip(keys, texts):
            vector = self._vectors.get(key)
            if vector is not None:
                self._vectors.move_to_end(key)
                found[key] = vector
            elif key in self._pending:
                waiting[key] = self._pending[key]
            else:
                misses.setdefault(key, text)
        if misses:
            found.update(await self._encode(misses))
        for key, future in waiting.items():
            found[key] = await asyncio.shield(future)
        return np.stack([found[key] for key in keys]).astype(np.float32, copy=False)

    async def _encode(self, misses: dict[bytes, str]) -> dict[bytes, np.ndarray]:
        loop = asyncio.get_running_loop()
        futures = {key: loop.create_future() for key in misses}
        self._pending.update(futures)
        try:
            fresh = await self._inner.embed(list(misses.values()))
        except BaseException as exc:
            for key, future in futures.items():
                self._pending.pop(key, None)
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
                    future.exception()  # seen: the caller below raises it
            raise
        vectors = {}
        for (key, future), vector in zip(futures.items(), fresh):
            self._pending.pop(key, None)
            vectors[key] = self._remember(key, vector)
            future.set_result(vectors[key])
        return vectors

    def _remember(self, key: bytes, vector: np.ndarray) -> np.ndarray:
        stored = np.array(vector, dtype=np.float32)
        stored.setflags(write=False)  # shared between callers: np.stack copies it out for them
        self._vectors[key] = stored
        self._vectors.move_to_end(key)
        while len(self._vectors) > self._max_entries:
            self._vectors.popitem(last=False)
        return stored


def _text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def fake_vector(text: str, dim: int = 256) -> np.ndarray:
    """A deterministic unit vector from hashed, signed character trigrams: shared trigrams, high cosine."""
    padded = f"  {text.lower()}  "
    vector = np.zeros(dim, dtype=np.float32)
    grams = [padded[i:i + 3] for i in range(len(padded) - 2)]
    for gram in grams:
        digest = hashlib.blake2b(gram.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
        vector[value % dim] += 1.0 if (value >> 63) & 1 else -1.0
    if not vector.any():
        vector[0] = 1.0
    return normalize_rows(vector)


class FakeEmbedder:
    """A deterministic `Embedder` for unit tests: trigram vectors, and a record of every call."""

    def __init__(self, dim: int = 256, *, ready: bool = True) -> None:
        self.dim = dim
        self.calls: list[list[str]] = []
        self._ready = ready

    @property
    def ready(self) -> bool:
        return self._ready

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Trigram vectors for `texts`; the call is appended to `calls`."""
        self.calls.append(list(texts))
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([fake_vector(t, self.dim) for t in texts])
