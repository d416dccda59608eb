"""The engine behind /v1/embeddings: cache, in-flight coalescing and window batching in front of one backend.

Per input text: fingerprint -> L1 -> L2 (one MGET for all of a request's L1 misses) -> join the
text's pending future if any caller already waits for it -> otherwise add it to the open window
of its (model, dimensions). A window closes after `window_s` (a `call_later` timer, never polling),
or at once when it holds `max_batch_size` texts or `max_batch_tokens` tokens, and becomes exactly
one backend call whose vectors are handed to every waiting future and written to both caches.

Failure and cancellation: a failed call fails only the futures of its own texts and caches
nothing. When the upstream blames the input (a caller-fault 4xx) for a batch of several texts, each
text is retried alone, so one caller's bad input fails only the callers of that text. A caller that
leaves (cancelled, timed out) releases its texts; a text nobody waits for any more is dropped before
its call, while one still wanted by others stays in the batch.

In-flight coalescing lives here rather than in `merge.coalesce.SingleFlight` because a waiting text
is not a call of its own: many texts share one backend call, so each owns a future, not a task.

Usage accounting: a batch's `prompt_tokens` is shared among its texts in proportion to
`count_tokens`, so a request alone in its batch reports exactly what the backend counted; a cached
text reports `count_tokens(text)`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import structlog

from mergebroker.background import spawn
from mergebroker.broker.engine.embeddings.stats import CoalescerStats
from mergebroker.broker.engine.embeddings.window_rules import (
    CallLater,
    TimerHandle,
    caller_fault,
    share_tokens,
    window_decision,
)
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.errors import BrokerError, Overloaded, UpstreamBadResponse, UpstreamError, UpstreamTimeout
from mergebroker.merge.cache import TwoLevelCache
from mergebroker.merge.fingerprint import embedding_fingerprint
from mergebroker.merge.vector_codec import VectorDtype, decode_vector, encode_vector
from mergebroker.providers.base import EmbedResult, still_wanted

log = structlog.get_logger(__name__)


Backend = Callable[[str, list[str], int | None], Awaitable[EmbedResult]]
"""`backend(model, texts, dimensions)`: one vector per text, in order; raises `BrokerError` subclasses."""


@dataclass(eq=False, slots=True)
class _Pending:
    """One distinct text awaiting its vector; `waiters` counts the callers holding its future."""

    key: str
    text: str
    tokens: int
    group: tuple[str, int | None]
    future: asyncio.Future[tuple[np.ndarray, float]]
    waiters: int = 0
    dispatched: bool = False


@dataclass(eq=False, slots=True)
class _Window:
    items: list[_Pending] = field(default_factory=list)
    tokens: int = 0
    timer: TimerHandle | None = None


class EmbeddingBatcher:
    """Serves embedding requests through the caches, coalescing and batched backend calls (see module doc).

    `cache_version` is part of every key (with the dtype, so switching float32/float16 never misreads
    an old entry); new vectors are cached as `dtype` bytes for `ttl_s` seconds. `call_timeout_s`
    bounds each backend call (None: the backend's own timeout is trusted).
    """

    def __init__(self, backend: Backend, *, cache: TwoLevelCache | None, cache_version: str, window_s: float,
                 max_batch_size: int, max_batch_tokens: int, count_tokens: Callable[[str], int],
                 dtype: VectorDtype = "float32", ttl_s: float | None, metrics: Metrics | None = None,
                 call_timeout_s: float | None = None, call_later: CallLater | None = None) -> None:
        if window_s < 0 or max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError("window_s must be >= 0, max_batch_size and max_batch_tokens >= 1")
        encode_vector(np.zeros(1), dtype)  # rejects an unknown dtype now rather than at the first write
        self._backend = backend
        self._cache = cache
        self._key_version = f"{cache_version}/{dtype}"
        self._window_s = window_s
        self._max_batch_size = max_batch_size
        self._max_batch_tokens = max_batch_tokens
        self._count_tokens = count_tokens
        self._dtype: VectorDtype = dtype
        self._ttl_s = ttl_s
        self._metrics = metrics
        self._call_timeout_s = call_timeout_s
        self._call_later = call_later or (lambda delay, cb: asyncio.get_running_loop().call_later(delay, cb))
        self._inflight: dict[str, _Pending] = {}
        self._windows: dict[tuple[str, int | None], _Window] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._counts: Counter[str] = Counter()  # the `CoalescerStats` counts

    @property
    def pending(self) -> int:
        """Distinct texts waiting in a window or in a backend call (their futures not yet cleaned up)."""
        return len(self._inflight)

    @property
    def waiting(self) -> int:
        """Caller-text pairs waiting on those pending texts (a text two callers wait for counts twice)."""
        return sum(pending.waiters for pending in self._inflight.values())

    def stats(self) -> CoalescerStats:
        """Counts since start and what waits now (see `CoalescerStats`)."""
        in_windows = sum(len(window.items) for window in self._windows.values())
        return CoalescerStats(**self._counts, pending_window=in_windows, in_flight=self.pending, waiting=self.waiting)

    async def embed(self, model: str, texts: Sequence[str], *, dimensions: int | None = None,
                    scope: str | None = None) -> EmbedResult:
        """One unit vector per text, in input order, with the request's usage; raises the batch's `BrokerError`.

        `scope` (e.g. "tenant:acme") gives the texts keys of their own: equal texts of different scopes
        neither share cache entries nor coalesce. None shares both across every caller.
        """
        texts = list(texts)
        # Readable, versioned keys ({version}/{dtype}:{model}:{sha256}) so an operator can drop one version.
        keys = [f"{self._key_version}:{model}:"
                + embedding_fingerprint(model, t, dimensions=dimensions, cache_version=self._key_version, scope=scope)
                for t in texts]
        first_text: dict[str, str] = {}
        for key, text in zip(keys, texts):
            first_text.setdefault(key, text)
        cached = await self._lookup(list(first_text))
        held: dict[str, _Pending] = {}
        joined: set[str] = set()
        try:
            for key, text in first_text.items():
                if key in cached:
                    continue
                pending = self._inflight.get(key)
                if pending is None:
                    pending = self._enqueue((model, dimensions), key, text)
                else:
                    joined.add(key)
                pending.waiters += 1
                held[key] = pending
            fresh = await self._wait(held) if held else {}
        finally:
            self._release(held.values())
        return self._assemble(texts, keys, cached, fresh, joined)

    async def drain(self) -> None:
        """Send every open window now and wait until all running batches are done (graceful shutdown)."""
        for group in list(self._windows):
            self._close_window(group)
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def close(self) -> None:
        """Fail every waiting text with `Overloaded` and stop running batches; call once, at shutdown."""
        for group in list(self._windows):
            window = self._windows.pop(group)
            if window.timer is not None:
                window.timer.cancel()
            self._gauge(-len(window.items))
            self._fail(window.items, Overloaded("the embedding service is shutting down"))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A batch cancelled before its first step never ran its own clean-up.
        self._fail(list(self._inflight.values()), Overloaded("the embedding service is shutting down"))

    async def _lookup(self, keys: list[str]) -> dict[str, np.ndarray]:
        if self._cache is None or not keys:
            return {}
        try:
            values = await self._cache.get_many(keys)
        except Exception as exc:  # a cache must never fail a request: every key is a miss then
            log.warning("embedding_cache_read_failed", error_type=type(exc).__name__)
            return {}
        found: dict[str, np.ndarray] = {}
        for key, data in zip(keys, values):
            if data is None:
                continue
            try:
                vector = decode_vector(data, self._dtype)
            except ValueError:
                log.warning("embedding_cache_entry_corrupt", size=len(data))
                continue
            vector.setflags(write=False)
            found[key] = vector
        return found

    def _enqueue(self, group: tuple[str, int | None], key: str, text: str) -> _Pending:
        tokens = max(1, self._count_tokens(text))
        window = self._windows.get(group)
        close_before, close_after = window_decision(
            len(window.items) if window else 0, window.tokens if window else 0, tokens,
            max_batch_size=self._max_batch_size, max_batch_tokens=self._max_batch_tokens)
        if close_before:
            self._close_window(group)
        window = self._windows.get(group)
        if window is None:
            window = self._windows[group] = _Window()
            window.timer = self._call_later(self._window_s, partial(self._on_timer, group, window))
        pending = _Pending(key, text, tokens, group, asyncio.get_running_loop().create_future())
        window.items.append(pending)
        window.tokens += tokens
        self._inflight[key] = pending
        self._gauge(1)
        if close_after:
            self._close_window(group)
        return pending

    def _on_timer(self, group: tuple[str, int | None], window: _Window) -> None:
        # A window closed early by a limit may have a successor in the same group: leave that one be.
        if self._windows.get(group) is window:
            window.timer = None
            self._close_window(group)

    def _close_window(self, group: tuple[str, int | None]) -> None:
        window = self._windows.pop(group)
        if window.timer is not None:
            window.timer.cancel()
        self._gauge(-len(window.items))
        if not window.items:
            return
        for item in window.items:
            item.dispatched = True
        spawn(self._tasks, self._run_batch(group, window.items), f"embedding-batch-{group[0]}")

    async def _run_batch(self, group: tuple[str, int | None], items: list[_Pending]) -> None:
        # Callers may have left between the window closing and this task starting.
        self._drop([item for item in items if item.waiters == 0])
        items = [item for item in items if item.waiters > 0]
        if not items:
            return
        model, dimensions = group
        self._counts.update(batches=1, batched_texts=len(items))
        if self._metrics is not None:
            self._metrics.embedding_batch_size.observe(len(items))
        # A backend that queues its work (the local model) skips a call nobody waits for any more.
        still_wanted.set(lambda: any(item.waiters > 0 for item in items))
        try:
            result = await self._call_backend(model, [item.text for item in items], dimensions)
        except asyncio.CancelledError:
            if all(item.waiters == 0 for item in items):
                self._drop(items)  # abandoned by every caller (`_release`): nobody to tell
            else:
                self._fail(items, Overloaded("the embedding service is shutting down"))
            raise
        except BrokerError as exc:
            log.warning("embedding_batch_failed", model=model, size=len(items), error_type=type(exc).__name__)
            if caller_fault(exc) and len(items) > 1:
                # One caller's bad text (too long, rejected) must not fail everyone sharing its window:
                # each text is tried alone, so only the callers of the bad one get the error.
                await asyncio.gather(*(self._run_batch(group, [item]) for item in items))
            else:
                self._fail(items, exc)
            return
        await self._deliver(items, result)

    async def _call_backend(self, model: str, texts: list[str], dimensions: int | None) -> EmbedResult:
        try:
            async with asyncio.timeout(self._call_timeout_s):
                result = await self._backend(model, texts, dimensions)
        except TimeoutError as exc:
            raise UpstreamTimeout("the embedding backend did not answer in time") from exc
        except BrokerError:
            raise
        except Exception as exc:
            raise UpstreamError(f"the embedding backend failed: {type(exc).__name__}") from exc
        if len(result.vectors) != len(texts):
            raise UpstreamBadResponse(f"embedding backend returned {len(result.vectors)} vectors "
                                      f"for {len(texts)} inputs")
        return result

    async def _deliver(self, items: list[_Pending], result: EmbedResult) -> None:
        shares = share_tokens(result.prompt_tokens, [item.tokens for item in items])
        entries: dict[str, bytes] = {}
        for item, raw, share in zip(items, result.vectors, shares):
            vector = np.array(raw, dtype=np.float32).reshape(-1)
            vector.setflags(write=False)  # one array is handed to every waiter of the text
            if not item.future.done():
                item.future.set_result((vector, share))
            entries[item.key] = encode_vector(vector, self._dtype)
        try:
            # Until the write is done, late arrivals still find the texts here and take the result.
            if self._cache is not None:
                await self._cache.set_many(entries, ttl_s=self._ttl_s)
        except Exception as exc:
            log.warning("embedding_cache_write_failed", error_type=type(exc).__name__)
        finally:
            self._forget(items)

    async def _wait(self, held: dict[str, _Pending]) -> dict[str, tuple[np.ndarray, float]]:
        # asyncio.wait, unlike gather, never cancels the shared futures when this caller is cancelled.
        await asyncio.wait([pending.future for pending in held.values()])
        # Reading every exception marks each as retrieved, so none is reported as lost.
        errors = [error for p in held.values() if (error := p.future.exception()) is not None]
        if errors:
            raise errors[0]
        return {key: pending.future.result() for key, pending in held.items()}

    def _release(self, held: Iterable[_Pending]) -> None:
        for pending in held:
            pending.waiters -= 1
            if pending.waiters == 0 and not pending.dispatched and not pending.future.done():
                self._remove_from_window(pending)
                self._drop([pending])


    def _remove_from_window(self, pending: _Pending) -> None:
        window = self._windows.get(pending.group)
        if window is None or pending not in window.items:
            return
        window.items.remove(pending)
        window.tokens -= pending.tokens
        self._gauge(-1)
        if not window.items:
            del self._windows[pending.group]
            if window.timer is not None:
                window.timer.cancel()

    def _drop(self, items: list[_Pending]) -> None:
        for item in items:
            item.future.cancel()
        self._forget(items)

    def _fail(self, items: list[_Pending], exc: BaseException) -> None:
        for item in items:
            if item.future.done():
                continue
            # Nobody would retrieve the exception of an abandoned text: cancel it quietly instead.
            if item.waiters > 0:
                item.future.set_exception(exc)
            else:
                item.future.cancel()
        self._forget(items)

    def _forget(self, items: list[_Pending]) -> None:
        for item in items:
            if self._inflight.get(item.key) is item:
                del self._inflight[item.key]

    def _assemble(self, texts: list[str], keys: list[str], cached: dict[str, np.ndarray],
                  fresh: dict[str, tuple[np.ndarray, float]], joined: set[str]) -> EmbedResult:
        vectors: list[np.ndarray] = []
        tokens = 0.0
        n_cached = n_coalesced = 0
        seen: set[str] = set()
        for text, key in zip(texts, keys):
            if key in cached:
                vectors.append(cached[key])
                tokens += self._count_tokens(text)
                n_cached += 1
            else:
                vector, share = fresh[key]
                vectors.append(vector)
                tokens += share
                if key in joined or key in seen:
                    n_coalesced += 1
            seen.add(key)
        self._counts.update(texts=len(texts), cached=n_cached, coalesced=n_coalesced)
        if self._metrics is not None and n_coalesced:
            self._metrics.embedding_coalesced.inc(n_coalesced)
        return EmbedResult(vectors, round(tokens), cached=n_cached, coalesced=n_coalesced)

    def _gauge(self, delta: int) -> None:
        if self._metrics is not None and delta:
            self._metrics.embedding_window_pending.inc(delta)

