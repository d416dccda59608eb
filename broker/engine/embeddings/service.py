"""`/v1/embeddings` after validation: limits, then the batcher (cache, coalescing, window batching).

Models listed in `embeddings.local_models` are served by the built-in sentence-transformers model
(the same loaded copy the merge engine uses); every other model goes to the provider pools. Token-array
inputs skip the cache and go straight upstream. Each caller waits at most its tier's
`request_timeout_s` (or its shorter `broker.timeout_s`); with `embeddings.cache_scope: tenant` the
cache and in-flight coalescing are per tenant instead of shared by everyone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from mergebroker.broker.engine.embeddings.batcher import EmbeddingBatcher
from mergebroker.broker.engine.embeddings.stats import CoalescerStats
from mergebroker.broker.engine.embeddings.window_rules import cache_metrics_hook
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.schemas import EmbeddingRequest
from mergebroker.broker.engine.ground.settings import EmbeddingSettings, ProviderSettings, Settings
from mergebroker.broker.engine.ground.tokens import count_text_tokens, estimate_embedding_tokens
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.engine.limits.limiter import Limiter
from mergebroker.broker.engine.limits.ratelimit import LimitSpec
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import DeadlineExceeded, InvalidRequest
from mergebroker.merge.cache import TwoLevelCache
from mergebroker.merge.lru import LruCache
from mergebroker.merge.redis_cache import RedisCache
from mergebroker.merge.vector_codec import to_base64
from mergebroker.providers.base import EmbedResult
from mergebroker.providers.local.embeddings import LocalEmbeddingBackend
from mergebroker.providers.local.model import SentenceModelHost
from mergebroker.providers.pool import ProviderPools
from mergebroker.token_usage import TokenUsage


def check_input_size(inputs: Any, tokens: int, limits: EmbeddingSettings) -> None:
    """400 for a request over the per-request input limits (`embeddings.max_inputs`, `max_input_tokens`):
    one caller's huge request would otherwise hold the model for a minute past its own deadline."""
    count = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else 1
    if count > limits.max_inputs:
        raise InvalidRequest(f"Invalid value for 'input': at most {limits.max_inputs} inputs per request.",
                             param="input", code="too_many_inputs")
    if tokens > limits.max_input_tokens:
        raise InvalidRequest(f"Invalid value for 'input': about {tokens} tokens, over the {limits.max_input_tokens} "
                             "allowed per request; split it into several requests.", param="input",
                             code="too_many_tokens")


@dataclass(frozen=True)
class EmbeddingResponse:
    body: dict[str, Any]
    cache_summary: str  # "hit" when every text came from cache, "coalesced"/"miss" otherwise
    upstream_s: float
    limit_headers: dict[str, str]


class EmbeddingService:
    """Admits embedding requests and answers them through the batcher."""

    def __init__(self, settings: Settings, *, batcher: EmbeddingBatcher, pools: ProviderPools, limiter: Limiter,
                 local_models: list[str], clock: Clock = monotonic) -> None:
        self._settings = settings
        self._batcher = batcher
        self._pools = pools
        self._limiter = limiter
        self._local = local_models
        self._clock = clock

    def serves(self, model: str) -> bool:
        return model in self._local or self._pools.serves(model)

    def local_models(self) -> list[str]:
        return list(self._local)

    async def start(self) -> None:
        return None

    def stats(self) -> CoalescerStats:
        """The coalescer's counts and figures (cache-hit rate, coalesced ratio, mean batch size, pending window)."""
        return self._batcher.stats()

    async def stop(self) -> None:
        """Send what waits in open windows, then fail anything left (shutdown never strands a caller)."""
        await self._batcher.drain()
        await self._batcher.close()

    async def embed_texts(self, model: str, texts: list[str]) -> EmbedResult:
        """Embed texts through the cache path without admission (used by `mergebroker warm-cache`)."""
        return await self._batcher.embed(model, texts)

    async def create(self, caller: Caller, parsed: EmbeddingRequest, body: dict[str, Any]) -> EmbeddingResponse:
        """Answer one request within its deadline (504 past it); its rate-limit reservation is always settled.

        The deadline is the tier's `request_timeout_s`, or the request's shorter `broker.timeout_s`. A
        caller that runs out of time only stops waiting: a batch it shares goes on for the others.
        """
        tier = self._settings.tier(caller.tier)
        budget = tier.timeout_for(parsed.broker.timeout_s if parsed.broker else None)
        tokens = estimate_embedding_tokens(parsed.input)
        check_input_size(parsed.input, tokens, self._settings.embeddings)
        reservation = await self._limiter.reserve(caller.limits(LimitSpec(f"tier:{tier.name}", tier.rpm, tier.tpm)),
                                                  tokens)
        started = self._clock()
        try:
            async with self._clock.timeout_at(started + budget):
                body_out, summary, spent = await self._answer(caller, parsed, body, started + budget, tokens)
        except TimeoutError:
            await reservation.settle(0)
            raise DeadlineExceeded(f"The request did not complete within its deadline ({budget:g} s).") from None
        except BaseException:
            await reservation.settle(0)
            raise
        await reservation.settle(spent)
        return EmbeddingResponse(body_out, summary, self._clock() - started, reservation.headers())

    async def _answer(self, caller: Caller, parsed: EmbeddingRequest, body: dict[str, Any], deadline: float,
                      tokens: int) -> tuple[dict[str, Any], str, int]:
        """The response body, its cache summary and the tokens spent."""
        texts = [parsed.input] if isinstance(parsed.input, str) else parsed.input
        if not all(isinstance(t, str) for t in texts):
            if parsed.model in self._local:
                raise InvalidRequest("Token-array input is not supported by local embedding models.", param="input")
            reply, _ = await self._pools.embeddings(parsed.model, body, deadline=deadline, tokens=tokens,
                                                    tenant=caller.tenant)
            usage = TokenUsage.from_body(reply)
            return reply, "miss", usage.prompt_tokens if usage is not None else tokens
        # The embeddings cache is shared by every tenant unless the operator scopes it (README, /v1/embeddings).
        scope = f"tenant:{caller.tenant}" if self._settings.embeddings.cache_scope == "tenant" else None
        strings = cast(list[str], texts)  # all strings: checked above
        result = await self._batcher.embed(parsed.model, list(strings), dimensions=parsed.dimensions, scope=scope)
        summary = "hit" if result.cached == len(texts) else ("coalesced" if result.coalesced else "miss")
        return _response_body(parsed, result), summary, result.prompt_tokens


def _response_body(parsed: EmbeddingRequest, result: EmbedResult) -> dict[str, Any]:
    data = []
    for index, vector in enumerate(result.vectors):
        embedding: Any = to_base64(vector) if parsed.encoding_format == "base64" else np.asarray(
            vector, dtype=np.float32).tolist()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    usage = TokenUsage(prompt_tokens=result.prompt_tokens).as_embeddings()
    return {"object": "list", "data": data, "model": parsed.model, "usage": usage}


def build_embedding_service(settings: Settings, *, pools: ProviderPools, host: SentenceModelHost | None, redis: Any,
                            limiter: Limiter, metrics: Metrics, providers: list[ProviderSettings],
                            clock: Clock = monotonic) -> EmbeddingService:
    """Wire the batcher with its cache levels and its backends (local model or provider pools)."""
    emb = settings.embeddings
    declared = [m for p in providers if p.kind == "local" for m in p.models if m != "*"]
    local_models = (declared or list(emb.local_models)) if host is not None else []
    local = LocalEmbeddingBackend(host, model_names=tuple(local_models)) if host is not None else None

    async def backend(model: str, texts: list[str], dimensions: int | None) -> EmbedResult:
        if local is not None and model in local_models:
            return await local(model, texts, dimensions)
        body: dict[str, Any] = {"model": model, "input": texts, "encoding_format": "float"}
        if dimensions:
            body["dimensions"] = dimensions
        reply, _ = await pools.embeddings(model, body, deadline=clock() + 60.0,
                                          tokens=sum(count_text_tokens(t) for t in texts))
        rows = sorted(reply.get("data") or [], key=lambda d: d.get("index", 0))
        vectors = [np.asarray(r["embedding"], dtype=np.float32) for r in rows]
        usage = TokenUsage.from_body(reply)
        return EmbedResult(vectors=vectors, prompt_tokens=usage.prompt_tokens if usage is not None else 0,
                           cached=0, coalesced=0)

    l2 = RedisCache(redis, prefix="emb:", ttl_s=settings.cache.ttl_s,
                    jitter_ratio=settings.cache.jitter_ratio) if redis is not None else None
    cache = TwoLevelCache(LruCache(max_entries=1_000_000, max_bytes=settings.cache.max_bytes, ttl_s=settings.cache.ttl_s,
                                   clock=clock), l2,
                          metrics_hook=cache_metrics_hook(metrics))
    batcher = EmbeddingBatcher(backend, cache=cache, cache_version=emb.cache_version, window_s=emb.window_ms / 1000,
                               max_batch_size=emb.max_batch_size, max_batch_tokens=emb.max_batch_tokens,
                               count_tokens=count_text_tokens, dtype=emb.dtype, ttl_s=settings.cache.ttl_s,
                               metrics=metrics, call_later=lambda delay, cb: clock.call_at(clock() + delay, cb))
    return EmbeddingService(settings, batcher=batcher, pools=pools, limiter=limiter, local_models=local_models,
                            clock=clock)
