"""`assemble(settings)`: build and start the engine that every way in shares (HTTP, the library, a cluster
worker, MCP, warm-cache), and `stop_engine` to stop it.

The way in chooses the queue: by default jobs go to the in-process merge windows and workers; a
cluster-mode front-end passes a `QueueChoice` that wraps that local queue (kept as its fallback).
Nothing here knows HTTP.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import structlog

from mergebroker import gc_policy
from mergebroker.background import spawn
from mergebroker.breaker.circuit import CircuitBreaker
from mergebroker.breaker.policy import DegradationPolicy
from mergebroker.breaker.shared_state import SharedBreakerState
from mergebroker.broker.engine.accounting.costs import CostBook
from mergebroker.broker.engine.accounting.ledger import Ledger
from mergebroker.broker.engine.accounting.merge_economy import MergeEconomy, economy_for
from mergebroker.broker.engine.accounting.store import open_store
from mergebroker.broker.engine.chat.dispatch import Dispatcher, MergeOptions, TierMergePolicy
from mergebroker.broker.engine.chat.job_queue import JobQueue
from mergebroker.broker.engine.chat.merge_queue import MergeQueue, TierWindow
from mergebroker.broker.engine.chat.service import ChatService
from mergebroker.broker.engine.chat.shadow import ShadowRunner
from mergebroker.broker.engine.chat.workers import LocalJobQueue
from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.embeddings.service import build_embedding_service
from mergebroker.broker.engine.ground.metrics import (
    Metrics,
    PoolMetrics,
    breaker_listener,
    guard_listener,
    merging_listener,
    preinitialise,
)
from mergebroker.broker.engine.ground.response_store import open_response_store
from mergebroker.broker.engine.ground.settings import HTTP_PROVIDER_KINDS, ProviderSettings, Settings
from mergebroker.broker.engine.ground.tokens import count_text_tokens
from mergebroker.broker.engine.limits.admission import Authenticator
from mergebroker.broker.engine.limits.limiter import Limiter
from mergebroker.broker.engine.limits.ratelimit import RateLimiter
from mergebroker.broker.engine.limits.redis_limiter import RedisRateLimiter
from mergebroker.broker.engine.native.calls import NativeCalls
from mergebroker.broker.engine.wiring.upstreams import breaker_settings, build_upstreams
from mergebroker.clock import Clock, Sleep, monotonic
from mergebroker.merge.cache import TwoLevelCache
from mergebroker.merge.embedder import BatchingEmbedder, CachingEmbedder
from mergebroker.merge.lru import LruCache
from mergebroker.merge.quality_guard import GuardSettings, QualityGuard
from mergebroker.merge.redis_cache import RedisCache, make_redis_client
from mergebroker.providers.local.model import LocalEmbedder, SentenceModelHost
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.retry import RetryPolicy

log = structlog.get_logger(__name__)


class QueueChoice(Protocol):
    """Wraps the in-process queue in another (a cluster front-end's); the local one stays its fallback."""

    def __call__(self, local: JobQueue, *, metrics: Metrics, clock: Clock, sleep: Sleep) -> JobQueue: ...


async def assemble(settings: Settings, *, queue: QueueChoice | None = None, clock: Clock = monotonic,
                   sleep: Sleep | None = None, keep: Engine | None = None) -> Engine:
    """Build and start every component; `clock` drives all time-based parts (tests inject a fake).

    `sleep` (default `clock.sleep`) is what retry backoffs and background loops wait with, for tests that
    let those waits pass at once. `keep` is the running engine a config reload replaces: the new one shares
    its process-wide parts (`KEPT_ON_RELOAD`: metrics, Redis, the similarity model, the ledger, stored
    responses, the rate limiter's counts, the cost book's totals and calibration), the breakers of providers
    whose breaker settings did not change, and the chat cache while its settings are the same.
    """
    sleep = sleep or clock.sleep
    metrics = keep.metrics if keep is not None else Metrics()
    simulated = None
    providers = list(settings.providers)
    if not providers and keep is not None and keep.simulated_upstream is not None:
        simulated = keep.simulated_upstream
        providers = list(keep.providers)
    elif not providers:
        from mergebroker.providers.simulator.server import start_simulator

        simulated = await start_simulator()
        providers = [ProviderSettings(name="simulated", base_url=simulated.url)]
        log.warning("simulated_upstream", url=simulated.url,
                    message="No provider configured: serving from the built-in simulated upstream "
                            "(answers are synthetic). Configure providers or pass --upstream URL.")
    if keep is not None:
        redis = keep.redis
    else:
        redis = make_redis_client(settings.redis.url) if settings.redis.url else None
    breakers = {p.name: _breaker(p, keep, metrics, clock) for p in providers if p.kind in HTTP_PROVIDER_KINDS}
    upstreams = build_upstreams(providers, breakers, clock, settings.merge.default_max_tokens)
    preinitialise(metrics, tiers=[t.name for t in settings.tiers], providers=list(breakers),
                  models=sorted({m for p in providers for m in p.models if "*" not in m}))
    pools = ProviderPools(upstreams, strategy=settings.routing, retry=RetryPolicy(**settings.retry.model_dump()),
                          clock=clock, sleep=sleep, observer=PoolMetrics(metrics))
    routes: dict[str, list[str]] = {}
    for p in providers:
        for model in p.models:
            routes.setdefault(model, []).append(p.name)
    policy = DegradationPolicy(routes, breakers, merging_listener(metrics))
    host, embedder = (keep.model_host, keep.embedder) if keep is not None else _similarity_model(settings, providers)
    ledger = keep.ledger if keep is not None else _ledger(settings, clock)
    guard = _guard(settings, clock, metrics)
    shadow = ShadowRunner(pools, rate=settings.merge.shadow_rate, tpm=settings.merge.shadow_tpm, guard=guard,
                          metrics=metrics, embedder=embedder, record=ledger.record if ledger else None, clock=clock)
    costs = CostBook(settings.price_table(), metrics=metrics, clock=clock)
    if keep is not None and keep.costs is not None:  # new prices; what was spent and learnt stays
        costs.totals, costs.calibration = keep.costs.totals, keep.costs.calibration
    economy = economy_for(settings, costs, clock)
    dispatcher = _dispatcher(settings, pools, embedder, policy, metrics, clock, guard, shadow, economy, costs)
    tiers = [TierWindow(t.name, t.priority, t.window_ms / 1000, t.max_batch, t.max_queue, t.queue_hard_cap,
                        adaptive=t.window_policy == "adaptive", min_partners=t.window_min_partners)
             for t in settings.tiers]
    windows = MergeQueue(tiers, aging_per_s=settings.server.aging_per_s, clock=clock, metrics=metrics,
                         on_partners=dispatcher.prefetch)
    jobs: JobQueue = LocalJobQueue(windows, dispatcher, size=settings.server.workers, metrics=metrics, clock=clock)
    if queue is not None:  # e.g. cluster mode: jobs go to the workers, the local queue is the fallback
        jobs = queue(jobs, metrics=metrics, clock=clock, sleep=sleep)
    local = RateLimiter(clock)
    limiter: Limiter = local
    if keep is not None and keep.limiter is not None:  # the counts carry over; the new limits apply to them
        limiter = keep.limiter
    elif redis is not None and settings.redis.share_limits:
        limiter = RedisRateLimiter(redis, fallback=local, clock=clock)
    same_cache = keep is not None and (keep.settings.cache, keep.settings.merge.cache_version) == (
        settings.cache, settings.merge.cache_version)
    cache = keep.chat_cache if same_cache and keep is not None else _chat_cache(settings, redis, clock)
    chat = ChatService(settings, queue=jobs, pools=pools, limiter=limiter, cache=cache, metrics=metrics, clock=clock)
    embeddings = build_embedding_service(settings, pools=pools, host=host, redis=redis, limiter=limiter,
                                         metrics=metrics, providers=providers, clock=clock)
    auth = Authenticator(settings.auth, tiers=tuple(t.name for t in settings.tiers), default_tier=settings.default_tier)
    shared = keep.shared_breakers if keep is not None else None
    if shared is not None:
        for b in breakers.values():
            if b not in keep.breakers.values():  # type: ignore[union-attr]
                shared.attach(b)
    elif keep is None and redis is not None and settings.redis.share_breakers:
        shared = SharedBreakerState(redis, clock=clock, sleep=clock.sleep)
        for b in breakers.values():
            shared.attach(b)
    broker = Engine(settings, metrics, auth, pools, jobs, chat, embeddings, policy, breakers, host,
                    simulated_upstream=simulated, redis=redis, shared_breakers=shared, ledger=ledger,
                    shadow=shadow, embedder=embedder, limiter=limiter, providers=tuple(providers), clock=clock,
                    sleep=sleep, costs=costs, native=NativeCalls(settings, chat, pools, clock), chat_cache=cache,
                    responses=keep.responses if keep is not None else open_response_store(
                        settings.responses.backend, path=settings.responses.store_path,
                        retention_s=settings.responses.retention_s, redis=redis, cluster=settings.cluster.enabled))
    await _start(broker, providers, fresh=keep is None)
    return broker


def _breaker(p: ProviderSettings, keep: Engine | None, metrics: Metrics, clock: Clock) -> CircuitBreaker:
    """`p`'s circuit breaker: the running one where a reload left its settings alone (an open breaker stays
    open), else a new one."""
    old = keep.breakers.get(p.name) if keep is not None else None
    kept = next((q for q in keep.providers if q.name == p.name), None) if keep is not None else None
    if old is not None and kept is not None and breaker_settings(kept) == breaker_settings(p):
        return old
    return CircuitBreaker(p.name, breaker_settings(p), clock=clock, on_transition=breaker_listener(metrics, p.name))


def _similarity_model(settings: Settings, providers: list[ProviderSettings]
                      ) -> tuple[SentenceModelHost | None, CachingEmbedder | None]:
    """The one local model (if merging or /v1/embeddings needs it) and the merge engine's embedder over it.

    A cluster-mode front-end never loads it for merging: its workers do (its in-process fallback sends
    what needs similarity unmerged).
    """
    needs_model = not settings.cluster.enabled and settings.merge.enabled and settings.merge.embedder != "none" and any(
        t.merge and t.similarity_threshold > 0 for t in settings.tiers)
    int8 = settings.merge.embedder in ("local-onnx", "local-int8")
    if not needs_model and not any(p.kind == "local" for p in providers):
        return None, None
    host = SentenceModelHost(threads=settings.embeddings.model_threads, int8_copy=needs_model and int8,
                             int8_runtime="onnx" if settings.merge.embedder == "local-onnx" else "torch",
                             onnx_cache_dir=settings.embeddings.onnx_cache_dir)
    embedder = CachingEmbedder(BatchingEmbedder(LocalEmbedder(host, int8=int8))) if needs_model else None
    return host, embedder


def _ledger(settings: Settings, clock: Clock) -> Ledger | None:
    dsn = settings.ledger.postgres_dsn
    target = dsn.get_secret_value() if dsn else settings.ledger.path
    if not target:
        return None
    return Ledger(open_store(target), flush_interval_s=settings.ledger.flush_interval_s, sleep=clock.sleep)


def _guard(settings: Settings, clock: Clock, metrics: Metrics) -> QualityGuard:
    m = settings.merge
    return QualityGuard(GuardSettings(m.quality_guard_ratio, m.quality_guard_min_batches, m.quality_guard_cooldown_s,
                                      min_fidelity=m.quality_guard_min_fidelity,
                                      fidelity_window=m.quality_guard_fidelity_window),
                        clock=clock, on_pause=guard_listener(metrics))


def _dispatcher(settings: Settings, pools: ProviderPools, embedder: CachingEmbedder | None,
                policy: DegradationPolicy, metrics: Metrics, clock: Clock, guard: QualityGuard,
                shadow: ShadowRunner, economy: MergeEconomy, costs: CostBook) -> Dispatcher:
    tiers = {t.name: TierMergePolicy(t.merge, t.similarity_threshold, t.max_batch, t.system_prompts == "tagged",
                                     t.similarity_budget_ms / 1000)
             for t in settings.tiers}
    m = settings.merge
    return Dispatcher(
        pools, tiers=tiers,
        options=MergeOptions(m.header, m.leak_min_words, m.context_tokens, m.default_context_tokens),
        embedder=embedder,
        guard=guard, merging_allowed=policy.merging_allowed, metrics=metrics, clock=clock,
        on_merged_answer=shadow.offer if shadow.enabled else None, economy=economy, on_call_tokens=costs.observe_call)


def _chat_cache(settings: Settings, redis: Any, clock: Clock) -> TwoLevelCache | None:
    if not settings.cache.enabled:
        return None
    l2 = None
    if redis is not None:
        l2 = RedisCache(redis, prefix=f"mb:chat:{settings.merge.cache_version}:", ttl_s=settings.cache.ttl_s,
                        jitter_ratio=settings.cache.jitter_ratio)
    return TwoLevelCache(LruCache(max_entries=settings.cache.max_entries, max_bytes=settings.cache.max_bytes,
                                  ttl_s=settings.cache.ttl_s, clock=clock), l2)


async def _start(broker: Engine, providers: list[ProviderSettings], *, fresh: bool = True) -> None:
    """Start what `assemble` built; `fresh` is False for a reload, whose kept parts already run."""
    await asyncio.to_thread(count_text_tokens, "load the tokenizer before the first request")
    broker.queue.start()
    if fresh and broker.ledger is not None:
        await broker.ledger.start()
    if fresh and broker.shared_breakers is not None:
        await broker.shared_breakers.start()
    if fresh and broker.model_host is not None:
        _background(broker, _load_model(broker.model_host), "model_load")
    for p, u in zip([p for p in providers if p.kind in HTTP_PROVIDER_KINDS], broker.pools.upstreams):
        if p.warmup_connections:
            _background(broker, u.provider.warm_up(p.warmup_connections), "warmup")
    if broker.auth.mode == "open":
        log.warning("auth_open", message="Authentication is off (auth.mode=open): every caller is tenant "
                    f"'{broker.settings.auth.default_tenant}'. Use mode 'keys' or 'gateway' in production.")
    await broker.embeddings.start()
    freeze_startup_objects()
    log.info("broker_started", providers=[u.name for u in broker.pools.upstreams],
             tiers=[t.name for t in broker.settings.tiers], auth=broker.auth.mode,
             redis=broker.redis is not None)


def freeze_startup_objects() -> None:
    """Move everything built at start-up out of the garbage collector's sight (`mergebroker.gc_policy`).

    Measured in the passthrough bench: full collections walking start-up objects paused the loop ~55 ms
    (most of the p99), and young collections at the default threshold cost ~50 us per request while
    finding almost nothing; frozen objects and a higher threshold remove both.
    """
    gc_policy.PROCESS.start_up()


async def _load_model(host: SentenceModelHost) -> None:
    await host.load()
    await host.encode(["warm the model up before the first real group"], int8=True)  # first calls are slow
    freeze_startup_objects()  # the model's objects too


def _background(broker: Engine, coro: Any, name: str) -> None:
    spawn(broker.background, coro, name)


async def stop_engine(broker: Engine, *, successor: Engine | None = None) -> None:
    """Stop every part `assemble` started, in the order that lets each finish its work; the parts a reload's
    `successor` took over (`assemble(keep=broker)`) keep running."""
    await broker.queue.stop()
    if successor is not None:
        if broker.shadow is not None:
            await broker.shadow.close()
        await broker.embeddings.stop()
        await broker.pools.close()
        for task in list(broker.background):
            task.cancel()
        await asyncio.gather(*broker.background, return_exceptions=True)
        return
    if broker.shared_breakers is not None:
        await broker.shared_breakers.stop()
    for task in list(broker.background):
        task.cancel()
    await asyncio.gather(*broker.background, return_exceptions=True)
    if broker.shadow is not None:
        await broker.shadow.close()
    await broker.embeddings.stop()
    if broker.ledger is not None:
        await broker.ledger.stop()
    await broker.pools.close()
    await broker.responses.close()
    if broker.model_host is not None:
        broker.model_host.close()
    if broker.redis is not None:
        await broker.redis.aclose()
    if broker.simulated_upstream is not None:
        await broker.simulated_upstream.close()
