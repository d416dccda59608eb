"""Typed application state: the `Broker` container and the `web.AppKey`s the handlers read it by.

A leaf of the service layer (as in aiohttp's background-tasks example): `app`, `routes` and `middleware`
all import the keys from here, so none of them imports another to find its state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from mergebroker.breaker.circuit import CircuitBreaker
from mergebroker.breaker.policy import DegradationPolicy
from mergebroker.broker.admission import Authenticator
from mergebroker.broker.batches import BatchService
from mergebroker.broker.chat import ChatService
from mergebroker.broker.embeddings import EmbeddingService
from mergebroker.broker.job_queue import JobQueue
from mergebroker.broker.ledger import Ledger
from mergebroker.broker.metrics import Metrics
from mergebroker.broker.settings import Settings
from mergebroker.broker.shadow import ShadowRunner
from mergebroker.providers.local_model import SentenceModelHost
from mergebroker.providers.pool import ProviderPools


@dataclass
class Broker:
    """Everything a running broker holds; built once per app."""

    settings: Settings
    metrics: Metrics
    auth: Authenticator
    pools: ProviderPools
    queue: JobQueue  # the seam the chat path submits to (in-process: broker.workers.LocalJobQueue)
    chat: ChatService
    embeddings: EmbeddingService
    policy: DegradationPolicy
    breakers: dict[str, CircuitBreaker]
    model_host: SentenceModelHost | None
    simulated_upstream: Any = None
    redis: Any = None
    shared_breakers: Any = None
    ledger: Ledger | None = None
    batches: BatchService | None = None
    shadow: ShadowRunner | None = None
    background: set[asyncio.Task[Any]] = field(default_factory=set)

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
        return {"tiers": tiers, "providers": providers, "chat_cache": self._chat_cache_stats(),
                "embeddings": self.embeddings.stats().as_dict()}

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


BROKER = web.AppKey("broker", Broker)
SETTINGS_MAX_BODY = web.AppKey("max_body_bytes", int)
"""Set before the broker is built, so a body over the limit is refused even during start-up."""
