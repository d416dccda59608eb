"""The embedding coalescer's figures: cache-hit rate, coalesced ratio, mean batch size, pending-window count.

A frozen snapshot of counts kept by `EmbeddingBatcher` since it started; the rates are derived here, so
every reader (the library's `stats()`, `/v1/broker/stats`, the MCP `broker_stats` tool) computes them alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CoalescerStats:
    """Counts since start: texts asked for, of those answered from cache or by joining a pending text, backend
    batches and the texts they carried, and what waits now: texts in open windows, texts in windows or backend
    calls, and callers waiting on those (a text two callers wait for counts twice)."""

    texts: int = 0
    cached: int = 0
    coalesced: int = 0
    batches: int = 0
    batched_texts: int = 0
    pending_window: int = 0
    in_flight: int = 0
    waiting: int = 0

    @property
    def cache_hit_rate(self) -> float:
        """Share of texts answered from the L1/L2 cache."""
        return self.cached / self.texts if self.texts else 0.0

    @property
    def coalesced_ratio(self) -> float:
        """Share of texts that shared another caller's (or an earlier copy's) pending computation."""
        return self.coalesced / self.texts if self.texts else 0.0

    @property
    def mean_batch_size(self) -> float:
        """Texts per backend call."""
        return self.batched_texts / self.batches if self.batches else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The counts and the derived figures, JSON-ready."""
        return {**asdict(self), "cache_hit_rate": self.cache_hit_rate, "coalesced_ratio": self.coalesced_ratio,
                "mean_batch_size": self.mean_batch_size}
