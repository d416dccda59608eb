"""Every Prometheus metric the broker exports, in one registry per broker instance.

One `Metrics` object is built by `create_app` and handed to the components that record;
a per-instance registry keeps two brokers in one process (tests) from mixing their counts.
The Grafana dashboard and alert rules in `configs/` query exactly these names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mergebroker.broker.engine.ground.lockfree_metrics import LockFreeCounter, LockFreeHistogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
HOP_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1)
BATCH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64, 128)
FIDELITY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)
SHADOW_RESULTS = ("agree", "differ", "failed", "over_budget", "busy")
MAX_MODEL_LABELS = 200
OTHER_MODEL = "other"
"""The `model` label of every model name past the first `MAX_MODEL_LABELS`."""


class Metrics:
    """The broker's metric families; attribute names follow the exported names without the prefix."""

    def __init__(self, *, max_model_labels: int = MAX_MODEL_LABELS) -> None:
        self._max_model_labels = max_model_labels
        self._model_labels: set[str] = set()
        self._request_series: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._cost_series: dict[tuple[str, str], tuple[Any, Any]] = {}
        r = self.registry = CollectorRegistry()
        p = "mergebroker_"
        # Foundation: requests and upstream calls. The families every request counts into are lock-free
        # (`lockfree_metrics`): the same series, counted without prometheus_client's lock per increment.
        self.requests = LockFreeCounter(p + "requests", "Requests answered, by endpoint, tier and HTTP status.",
                                        ["endpoint", "tier", "status"], registry=r)
        self.request_latency = LockFreeHistogram(p + "request_latency_seconds", "Time from request to answer.",
                                                 ["endpoint", "tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_calls = LockFreeCounter(p + "upstream_calls", "Upstream calls by provider and outcome.",
                                              ["provider", "outcome"], registry=r)
        self.upstream_latency = LockFreeHistogram(p + "upstream_latency_seconds", "Upstream call latency.",
                                                  ["provider"], buckets=LATENCY_BUCKETS, registry=r)
        self.retries = LockFreeCounter(p + "retries", "Upstream retries by provider and reason.",
                                       ["provider", "reason"], registry=r)
        # Tiers and queues.
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting in a tier's queue.", ["tier"], registry=r)
        self.queue_wait = LockFreeHistogram(p + "queue_wait_seconds", "Time a request waited before dispatch.",
                                            ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = LockFreeCounter(p + "rejected", "Requests refused, by tier and reason "
                                        "(rate_limited, queue_full, deadline, unauthorized, forbidden).",
                                        ["tier", "reason"], registry=r)
        self.forced_flush = Counter(p + "forced_flush", "Windows flushed early because the queue was full.",
                                    ["tier"], registry=r)
        # Merge engine.
        self.merged_requests = Counter(p + "merged_requests", "Requests answered from a merged call.",
                                       ["tier"], registry=r)
        self.batches = LockFreeCounter(p + "batches", "Upstream dispatches (a batch of one is a passthrough).",
                                       ["tier"], registry=r)
        self.batch_size = LockFreeHistogram(p + "batch_size", "Members per dispatched batch.", ["tier"],
                                            buckets=BATCH_BUCKETS, registry=r)
        self.cache_events = LockFreeCounter(p + "cache_events", "Chat response cache results (hit, miss, coalesced).",
                                            ["result"], registry=r)
        self.tokens_saved = LockFreeCounter(p + "tokens_saved", "Estimated prompt tokens not sent thanks to merging.",
                                            registry=r)
        self.upstream_calls_saved = LockFreeCounter(p + "upstream_calls_saved",
                                                    "Upstream calls not made thanks to merging, coalescing and caching.",
                                                    registry=r)
        self.split_fallback = Counter(p + "split_fallback", "Merged members re-sent alone, by reason.",
                                      ["reason"], registry=r)
        self.merge_skipped = Counter(p + "merge_skipped", "Requests of mergeable groups sent unmerged, by reason "
                                     "(similarity_slow: the model missed its budget; similarity_failed).",
                                     ["reason"], registry=r)
        self.embedding_seconds = Histogram(p + "embedding_seconds", "Similarity-embedding time per window batch.",
                                           buckets=LATENCY_BUCKETS, registry=r)
        # Merge quality (broker.shadow): merged answers scored against the same request sent alone.
        self.merge_fidelity = Histogram(p + "merge_fidelity", "Shadow comparisons: how close a merged answer was "
                                        "to the same request answered alone (0..1), by tier, model and batch size.",
                                        ["tier", "model", "batch_size"], buckets=FIDELITY_BUCKETS, registry=r)
        self.shadow = Counter(p + "shadow", "Merged members sampled for a shadow call, by result "
                              "(agree, differ, failed, over_budget, busy).", ["result"], registry=r)
        for result in SHADOW_RESULTS:
            self.shadow.labels(result)
        self.merge_guard_pauses = Counter(p + "merge_guard_pauses", "Merging paused for a tenant and model by the "
                                          "quality guard, by reason (fallbacks, fidelity).", ["reason"], registry=r)
        for reason in ("fallbacks", "fidelity"):
            self.merge_guard_pauses.labels(reason)
        # Breakers and degradation.
        self.breaker_state = Gauge(p + "breaker_state", "Breaker state per provider: 0 closed, 1 half-open, 2 open.",
                                   ["provider"], registry=r)
        self.breaker_transitions = Counter(p + "breaker_transitions", "Breaker state changes.",
                                           ["provider", "to"], registry=r)
        self.degraded = Gauge(p + "degraded", "1 while merging is paused for a model.", ["model"], registry=r)
        self.fast_fail = Counter(p + "fast_fail", "Requests answered 503 at once because no upstream is healthy.",
                                 ["model"], registry=r)
        # Embeddings endpoint.
        self.embedding_cache_events = Counter(p + "embedding_cache_events", "Embedding cache lookups per text.",
                                              ["level", "result"], registry=r)
        self.embedding_coalesced = Counter(p + "embedding_coalesced", "Embedding texts that joined a pending one.",
                                           registry=r)
        self.embedding_batch_size = Histogram(p + "embedding_batch_size", "Texts per upstream embedding call.",
                                              buckets=BATCH_BUCKETS, registry=r)
        self.embedding_window_pending = Gauge(p + "embedding_window_pending",
                                              "Embedding texts waiting in the batching window.", registry=r)
        # Client connections (broker/http/connections.py).
        self.connections_open = Gauge(p + "connections_open", "Client connections held by this process.", registry=r)
        self.connections_closed = Counter(p + "connections_closed", "Client connections closed by the broker's "
                                          "limits, by reason.", ["reason"], registry=r)
        self.drain_requests = Counter(p + "drain_requests", "Requests the shutdown drain refused (new ones while "
                                      "draining) or cut (still running at its deadline).", ["outcome"], registry=r)
        self.config_reloads = Counter(p + "config_reloads", "Config reloads (SIGHUP, POST /v1/broker/reload) by "
                                      "result: applied, unchanged or refused.", ["result"], registry=r)
        # Cluster mode (broker.cluster): partitions on Redis Streams, front-ends and workers.
        self.cluster_backlog = Gauge(p + "cluster_backlog", "Jobs in a partition stream not yet read by a worker "
                                     "(exported by the partition's owner; an autoscaling signal).",
                                     ["tier", "partition"], registry=r)
        self.cluster_pending = Gauge(p + "cluster_pending", "Jobs read by a partition's owner and not yet answered.",
                                     ["tier", "partition"], registry=r)
        self.cluster_lag = Gauge(p + "cluster_lag_seconds", "Age of the oldest unanswered job in a partition stream.",
                                 ["tier", "partition"], registry=r)
        self.cluster_partitions_owned = Gauge(p + "cluster_partitions_owned", "Partitions this worker holds.",
                                              registry=r)
        self.cluster_lease_changes = Counter(p + "cluster_lease_changes", "Partition leases acquired, released "
                                             "(rebalancing) or lost (another worker holds it now, or renewal failed).",
                                             ["event"], registry=r)
        self.cluster_claims = Counter(p + "cluster_claims", "Jobs taken over: a dead worker's at once, a silent "
                                      "worker's after claim_idle_ms.", registry=r)
        self.cluster_jobs = Counter(p + "cluster_jobs", "Jobs a worker finished, by outcome (answered, failed, "
                                    "expired: dropped past its deadline, coalesced, unreadable, withdrawn: every caller left before "
                                    "it was sent, fenced: dropped unsent by a worker that lost it, taken_over).",
                                    ["outcome"], registry=r)
        self.cluster_duplicates_dropped = Counter(p + "cluster_duplicates_dropped", "Replies a front-end dropped: "
                                                  "a later reply for a job already answered or no longer awaited.",
                                                  registry=r)
        self.cluster_hop = Histogram(p + "cluster_hop_seconds", "What cluster mode adds to a request: a front-end's "
                                     "round trip through Redis minus the worker's own time.",
                                     buckets=HOP_BUCKETS, registry=r)
        self.cluster_fallback = Gauge(p + "cluster_fallback", "1 while a front-end merges in-process because Redis "
                                      "is unreachable.", registry=r)
        self.cluster_fallback_transitions = Counter(p + "cluster_fallback_transitions", "Front-end switches between "
                                                    "cluster mode and in-process fallback.", ["to"], registry=r)
        # Batch API (bulk jobs).
        self.bulk_lines = Counter(p + "bulk_lines", "Batch API lines answered, by outcome (completed, failed).",
                                  ["outcome"], registry=r)
        self.bulk_upstream_requests = Counter(p + "bulk_upstream_requests", "Compacted upstream requests of bulk "
                                              "jobs, by mode (pool, batch_api) and kind (merged, single).",
                                              ["mode", "kind"], registry=r)
        self.bulk_duplicate_lines = Counter(p + "bulk_duplicate_lines", "Bulk lines answered by an identical "
                                            "line's request.", registry=r)
        self.bulk_batches = Counter(p + "bulk_batches", "Bulk jobs ended, by final status.", ["status"], registry=r)
        self.bulk_active = Gauge(p + "bulk_active", "Bulk jobs running.", registry=r)
        self.window_decisions = Counter(p + "window_decisions", "Requests that opened a merge window (wait) or were "
                                        "sent at once because no partner was likely (skip), by tier.",
                                        ["tier", "decision"], registry=r)
        self.early_released = Counter(p + "early_released", "Merged members answered as soon as their block "
                                      "closed, before the merged reply ended, by tier.", ["tier"], registry=r)
        self.cost_usd = LockFreeCounter(p + "cost_usd", "Dollars at the configured prices, by tier and model: what "
                                        "requests cost (kind=actual) and what they would have cost sent alone with "
                                        "the provider's prompt cache (kind=alone).", ["tier", "model", "kind"],
                                        registry=r)
        self.merged_stream_ttft = Histogram(p + "merged_stream_ttft_seconds", "Time to first token of streamed "
                                            "members of a merged call, by position in the batch.", ["position"],
                                            registry=r)

    def cost(self, tier: str, model: str, actual_usd: float, alone_usd: float) -> None:
        """Count one request's dollars: what it cost, and what it would have cost alone."""
        label = self.model_label(model)  # first: client-chosen names must not grow the lookup below
        pair = self._cost_series.get((tier, label))
        if pair is None:  # looked up once per tier and model label, as `request_series` is
            pair = self._cost_series[(tier, label)] = (self.cost_usd.labels(tier, label, "actual"),
                                                       self.cost_usd.labels(tier, label, "alone"))
        pair[0].inc(actual_usd)
        pair[1].inc(alone_usd)

    def request_series(self, endpoint: str, tier: str, status: int) -> tuple[Any, Any]:
        """The `requests` counter and `request_latency` histogram children for these labels, looked up once
        (`labels()` costs more than the observation itself, and every answered request asks)."""
        key = (endpoint, tier, status)
        pair = self._request_series.get(key)
        if pair is None:
            pair = self._request_series[key] = (self.requests.labels(endpoint, tier, str(status)),
                                                self.request_latency.labels(endpoint, tier))
        return pair

    def model_label(self, model: str) -> str:
        """The `model` label value for `model`: the name itself for the first `max_model_labels` distinct
        names, `"other"` after that.

        Clients choose model names (a wildcard upstream accepts any), and every label value is a series
        kept for the life of the process, so every metric labelled by model goes through here.
        """
        if model in self._model_labels:
            return model
        if len(self._model_labels) < self._max_model_labels:
            self._model_labels.add(model)
            return model
        return OTHER_MODEL

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)


# The lower layers report through callbacks and observers; these adapters turn their reports into metrics.

BREAKER_STATE_LEVEL = {"closed": 0, "half-open": 1, "open": 2}


def breaker_listener(metrics: Metrics, provider: str) -> Callable[[str, str, str, dict[str, Any]], None]:
    """A breaker transition callback that keeps `breaker_state` and `breaker_transitions` up to date.

    Building it sets the provider's state to closed, so the series exists before the first transition.
    """
    metrics.breaker_state.labels(provider=provider).set(0)

    def on_transition(name: str, _from: str, to: str, _reason: dict[str, Any]) -> None:
        metrics.breaker_state.labels(provider=name).set(BREAKER_STATE_LEVEL[to])
        metrics.breaker_transitions.labels(provider=name, to=to).inc()

    return on_transition


def merging_listener(metrics: Metrics) -> Callable[[str, bool], None]:
    """A degradation-policy callback that exports whether merging is paused per model."""

    def on_merging(model: str, allowed: bool) -> None:
        metrics.degraded.labels(model=metrics.model_label(model)).set(0 if allowed else 1)

    return on_merging


def guard_listener(metrics: Metrics) -> Callable[[str, str, str], None]:
    """A quality-guard callback that counts pauses by reason (tenants are not a label: clients choose them)."""

    def on_pause(_tenant: str, _model: str, reason: str) -> None:
        metrics.merge_guard_pauses.labels(reason).inc()

    return on_pause


UPSTREAM_OUTCOMES = ("success", "5xx", "429", "auth", "timeout", "connection", "bad_response", "other",
                     "client_error", "breaker_open", "deadline", "cancelled", "stream_broken")
RETRY_REASONS = ("429", "5xx", "auth", "timeout", "connection", "bad_response", "other")
REJECT_REASONS = ("rate_limited", "queue_full", "deadline", "unauthorized", "forbidden")
BULK_STATUSES = ("completed", "failed", "expired", "cancelled")
MAX_BATCH_LABEL = 8
"""Batch sizes and positions in a batch are label values up to the hard cap on a merged call's members."""
FALLBACK_REASONS = ("missing", "empty", "duplicated", "malformed", "truncated", "foreign_id", "leak",
                    "merged_call_failed", "bad_reply")


def preinitialise(metrics: Metrics, *, tiers: list[str], providers: list[str], models: list[str]) -> None:
    """Create every series whose label values are known at start-up, at zero.

    A labelled series exists only once it has been touched; without this, a healthy broker's /metrics
    lacks whole families until their first event, and dashboards and alerts show "No data" instead of 0.
    """
    m = metrics
    for tier in [*tiers, "unknown"]:
        for endpoint in ("chat", "embeddings"):
            m.requests.labels(endpoint, tier, "200")
            m.request_latency.labels(endpoint, tier)
        for family in (m.queue_depth, m.queue_wait, m.forced_flush, m.merged_requests, m.batches, m.batch_size):
            family.labels(tier)
        for reason in REJECT_REASONS:
            m.rejected.labels(tier, reason)
    for provider in providers:
        m.upstream_latency.labels(provider)
        for outcome in UPSTREAM_OUTCOMES:
            m.upstream_calls.labels(provider, outcome)
        for reason in RETRY_REASONS:
            m.retries.labels(provider, reason)
        for to in BREAKER_STATE_LEVEL:
            m.breaker_transitions.labels(provider, to)
    for model in models or [OTHER_MODEL]:  # a wildcard pool names no model: "other" holds the families' zero
        label = m.model_label(model) if models else OTHER_MODEL
        m.degraded.labels(label)
        m.fast_fail.labels(label)
        for tier in tiers:
            for kind in ("actual", "alone"):
                m.cost_usd.labels(tier, label, kind)
            for size in range(2, MAX_BATCH_LABEL + 1):
                m.merge_fidelity.labels(tier, label, str(size))
    for tier in tiers:
        m.early_released.labels(tier)
        for decision in ("wait", "skip"):
            m.window_decisions.labels(tier, decision)
    for position in range(1, MAX_BATCH_LABEL + 1):
        m.merged_stream_ttft.labels(str(position))
    for status in BULK_STATUSES:
        m.bulk_batches.labels(status)
    for outcome in ("completed", "failed"):
        m.bulk_lines.labels(outcome)
    for mode in ("pool", "batch_api"):
        for kind in ("merged", "single"):
            m.bulk_upstream_requests.labels(mode, kind)
    for family, values in ((m.cache_events, ("hit", "miss", "coalesced")), (m.split_fallback, FALLBACK_REASONS),
                           (m.merge_skipped, ("similarity_slow", "similarity_failed"))):
        for value in values:
            family.labels(value)
    for level in ("l1", "l2"):
        for result in ("hit", "miss"):
            m.embedding_cache_events.labels(level=level, result=result)


CLUSTER_JOB_OUTCOMES = ("answered", "failed", "expired", "coalesced", "unreadable", "withdrawn", "fenced",
                        "taken_over")
LEASE_EVENTS = ("acquired", "released", "lost")


def preinitialise_cluster(metrics: Metrics) -> None:
    """The cluster-mode families a front-end or worker exports, at zero before their first event."""
    for outcome in CLUSTER_JOB_OUTCOMES:
        metrics.cluster_jobs.labels(outcome)
    for event in LEASE_EVENTS:
        metrics.cluster_lease_changes.labels(event)
    for to in ("local", "cluster"):
        metrics.cluster_fallback_transitions.labels(to)


CONNECTION_CLOSE_REASONS = ("header_timeout", "body_timeout", "idle_timeout", "evicted", "refused")


def connections_listener(metrics: Metrics, open_count: Callable[[], int]) -> Callable[[str], None]:
    """The connection guard's close callback; every reason's series starts at zero."""
    metrics.connections_open.set_function(open_count)
    children = {reason: metrics.connections_closed.labels(reason) for reason in CONNECTION_CLOSE_REASONS}
    return lambda reason: children[reason].inc()


DRAIN_OUTCOMES = ("refused", "cut")


def drain_listener(metrics: Metrics) -> Callable[[str, int], None]:
    """The shutdown drain's callback (`http.drain.DrainListener`); both outcomes' series start at zero."""
    children = {outcome: metrics.drain_requests.labels(outcome) for outcome in DRAIN_OUTCOMES}
    return lambda outcome, count: children[outcome].inc(count)


RELOAD_RESULTS = ("applied", "unchanged", "refused")


def reload_listener(metrics: Metrics) -> Callable[[Any], None]:
    """The config reloader's callback: counts each `ReloadResult` by its result (every series from zero)."""
    children = {result: metrics.config_reloads.labels(result) for result in RELOAD_RESULTS}
    return lambda result: children[result.result].inc()


class PoolMetrics:
    """The provider pools' observer: retries, calls by outcome and call latency per provider."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}  # `labels()` costs more than counting

    def retried(self, provider: str, reason: str) -> None:
        self._metrics.retries.labels(provider, reason).inc()

    def called(self, provider: str, outcome: str, latency_s: float | None) -> None:
        pair = self._children.get((provider, outcome))
        if pair is None:
            pair = self._children[(provider, outcome)] = (self._metrics.upstream_calls.labels(provider, outcome),
                                                          self._metrics.upstream_latency.labels(provider))
        pair[0].inc()
        if latency_s is not None:
            pair[1].observe(latency_s)
