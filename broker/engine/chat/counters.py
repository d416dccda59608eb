"""The dispatcher's counters: batches and their sizes, merged answers and what they saved, fallbacks,
similarity skipped, early releases and merged streams' first tokens. Without metrics every call is a no-op.

Labelled children are looked up once per label value: `labels()` costs more than the increment itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mergebroker.broker.engine.ground.metrics import Metrics


class DispatchCounters:
    """What dispatch counts, in its own words; the Prometheus families stay in `broker.engine.ground.metrics`."""

    def __init__(self, metrics: Metrics | None) -> None:
        self._metrics = metrics
        self._batch_children: dict[str, tuple[Any, Any]] = {}

    def batch(self, tier: str, size: int) -> None:
        """A batch (one member or several) is about to be sent."""
        if self._metrics is None:
            return
        children = self._batch_children.get(tier)
        if children is None:
            m = self._metrics
            children = self._batch_children[tier] = (m.batches.labels(tier), m.batch_size.labels(tier))
        children[0].inc()
        children[1].observe(size)

    def similarity_skipped(self, reason: str, members: int) -> None:
        """A group went out unmerged because its vectors were late or failed."""
        if self._metrics is not None:
            self._metrics.merge_skipped.labels(reason).inc(members)

    def embedding_time(self, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.embedding_seconds.observe(seconds)

    def merged(self, tier: str, *, answered: int, batch_size: int, tokens_saved: int) -> None:
        """A merged call answered `answered` of its `batch_size` members."""
        if self._metrics is None or not answered:
            return
        self._metrics.merged_requests.labels(tier).inc(answered)
        self._metrics.upstream_calls_saved.inc(batch_size - 1)
        self._metrics.tokens_saved.inc(max(0, tokens_saved))

    def early_released(self, tier: str) -> None:
        if self._metrics is not None:
            self._metrics.early_released.labels(tier).inc()

    def fallback(self, reason: str, members: int = 1) -> None:
        """Members re-sent alone (or failed) for `reason`."""
        if self._metrics is not None:
            self._metrics.split_fallback.labels(reason).inc(members)

    def first_tokens(self, by_position: Iterable[tuple[int, float]]) -> None:
        """Merged streams: each member's time to first token, by its position in the batch."""
        if self._metrics is not None:
            for position, seconds in by_position:
                self._metrics.merged_stream_ttft.labels(str(position)).observe(seconds)
