"""The running engine: the `Engine` container of every part `assemble` built, its readiness and its stats.

Every way in (HTTP, the library, a cluster worker, MCP) holds one; nothing here knows how it was reached.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mergebroker.breaker.circuit import CircuitBreaker
from mergebroker.breaker.policy import DegradationPolicy
from mergebroker.broker.engine.accounting.costs import CostBook
from mergebroker.broker.engine.accounting.ledger import Ledger
from mergebroker.broker.engine.chat.job_queue import JobQueue
from mergebroker.broker.engine.chat.service import ChatService
from mergebroker.broker.engine.chat.shadow import ShadowRunner
from mergebroker.broker.engine.embeddings.service import EmbeddingService
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.response_store import ResponseStore, SqliteResponseStore
from mergebroker.broker.engine.ground.settings import ProviderSettings, Settings
from mergebroker.broker.engine.limits.admission import Authenticator
from mergebroker.broker.engine.limits.limiter import Limiter
from mergebroker.broker.engine.native.calls import NativeCalls
from mergebroker.clock import Clock, Sleep, monotonic
from mergebroker.merge.cache import TwoLevelCache
from mergebroker.merge.embedder import CachingEmbedder
from mergebroker.providers.local.model import SentenceModelHost
from mergebroker.providers.pool import ProviderPools


@dataclass
class Engine:
    """Everything a running broker holds; built once per app."""

    settings: Settings
    metrics: Metrics
    auth: Authenticator
    pools: ProviderPools
    queue: JobQueue  # the seam the chat path submits to (in-process: engine.chat.workers.LocalJobQueue)
    chat: ChatService
    embeddings: EmbeddingService
    policy: DegradationPolicy
    breakers: dict[str, CircuitBreaker]
    model_host: SentenceModelHost | None
    simulated_upstream: Any = None
    redis: Any = None
    shared_breakers: Any = None
    ledger: Ledger | None = None
    shadow: ShadowRunner | None = None
    embedder: CachingEmbedder | None = None  # the similarity model's, when merging uses one
    limiter: Limiter | None = None
    providers: tuple[ProviderSettings, ...] = ()  # as configured, or the simulated upstream's
    clock: Clock = monotonic
    sleep: Sleep | None = None
    costs: CostBook | None = None  # dollars: what requests cost, and what they would have cost alone
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    native: NativeCalls | None = None  # requests sent to upstreams that speak their API (Responses, Messages)
    responses: ResponseStore = field(default_factory=SqliteResponseStore)  # stored Responses API responses
    chat_cache: TwoLevelCache | None = None  # the chat answers' cache (kept by a reload that leaves its settings)

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready to serve: providers configured, workers running, the embedding model loaded (if used)."""
        model_loaded = self.model_host is None or self.model_host.ready
        checks = {
            "providers": len(self.pools.upstreams) > 0,
            "workers": self.queue.alive(),
            "embedding_model": model_loaded,
        }
        return all(checks.values()), checks

    def stats(self) -> dict[str, Any]:
        """A JSON snapshot for gateways and humans without Prometheus."""
        m = self.metrics
        tiers = {}
        for t in self.settings.tiers:
            batches = _sample(m, "mergebroker_batches_total", tier=t.name)
            merged = _sample(m, "mergebroker_merged_requests_total", tier=t.name)
            requests = sum(_sample(m, "mergebroker_requests_total", endpoint="chat", tier=t.name, status=s)
                           for s in _statuses(m))
            tiers[t.name] = {"queue_depth": self.queue.depth(t.name), "requests": requests,
                             "merge_rate": merged / requests if requests else 0.0,
                             "mean_batch_size": _mean(m, "mergebroker_batch_size", tier=t.name),
                             "batches": batches}
        providers = {u.name: {"in_flight": u.in_flight,
                              **(u.breaker.snapshot() if u.breaker else {"state": "closed"})}
                     for u in self.pools.upstreams}
        stats = {"tiers": tiers, "providers": providers, "chat_cache": self._chat_cache_stats(),
                 "embeddings": self.embeddings.stats().as_dict()}
        if self.costs is not None:
            stats["cost"] = self.costs.stats()
        return stats

    def _chat_cache_stats(self) -> dict[str, Any]:
        """Chat answers by how the cache took part: from cache (hit), shared with an identical one in flight."""
        counts = {r: int(_sample(self.metrics, "mergebroker_cache_events_total", result=r))
                  for r in ("hit", "coalesced", "miss")}
        total = sum(counts.values())
        return {**counts, "hit_rate": counts["hit"] / total if total else 0.0,
                "coalesced_ratio": counts["coalesced"] / total if total else 0.0}


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return float(value or 0.0)


def _mean(metrics: Metrics, name: str, **labels: str) -> float:
    count = _sample(metrics, name + "_count", **labels)
    return _sample(metrics, name + "_sum", **labels) / count if count else 0.0


def _statuses(metrics: Metrics) -> set[str]:
    return {s.labels["status"] for family in metrics.requests.collect() for s in family.samples
            if "status" in s.labels}

