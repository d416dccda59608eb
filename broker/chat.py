"""The chat-completions path after validation: limits, cache, coalescing, queue, deadline.

Each accepted request gets exactly one outcome or one error before its deadline. Identical requests
in flight share one queued job (singleflight); a caller that leaves or times out does not cancel it
for the others, and a job nobody waits for any more is dropped before dispatch.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import structlog

from broker.admission import Caller
from broker.clock import Clock, monotonic
from broker.errors import DeadlineExceeded, UpstreamUnavailable
from broker.jobs import ChatJob, ChatOutcome
from broker.metrics import Metrics
from broker.queue import MergeQueue, aged_rank
from broker.ratelimit import LimitSpec, Reservation
from broker.settings import Settings, TierSettings
from broker.tokens import estimate_prompt_tokens
from merge.cache import TwoLevelCache
from merge.coalesce import SingleFlight
from merge.fingerprint import chat_fingerprint
from merge.shape import compatibility_key, merge_shape
from providers.pool import ProviderPools

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ChatResult:
    """A finished chat request: the outcome, how the cache took part, and the rate-limit headers."""

    outcome: ChatOutcome
    cache: str  # "hit" | "coalesced" | "miss"
    limit_headers: dict[str, str]
    prompt_estimate: int = 0  # estimated prompt tokens had it been sent alone


@dataclass(frozen=True)
class CacheControl:
    read: bool = True
    write: bool = True

    @classmethod
    def from_header(cls, value: str | None) -> "CacheControl":
        if not value:
            return _READ_WRITE
        directives = {d.strip().lower() for d in value.split(",")}
        return cls(read="no-cache" not in directives, write="no-store" not in directives)


_READ_WRITE = CacheControl()


class ChatService:
    """Admits, caches, coalesces and queues chat requests."""

    def __init__(self, settings: Settings, *, queue: MergeQueue[ChatJob], pools: ProviderPools, limiter: Any,
                 cache: TwoLevelCache | None, metrics: Metrics, clock: Clock = monotonic) -> None:
        self._settings = settings
        self._queue = queue
        self._pools = pools
        self._limiter = limiter
        self._cache = cache
        self._metrics = metrics
        self._clock = clock
        self._flights: SingleFlight[str, ChatOutcome] = SingleFlight()
        self._tiers = {t.name: t for t in settings.tiers}
        self._tier_limits = {t.name: LimitSpec(f"tier:{t.name}", t.rpm, t.tpm) for t in settings.tiers}
        self._estimate_prompts = prompt_estimate_needed(settings)
        self._cache_events: dict[str, Any] = {}  # labelled children by result, looked up once

    def limit_specs(self, caller: Caller) -> list[LimitSpec]:
        """The admission limits that apply to `caller`: its tier's, and its API key's when it has any."""
        specs = [self._tier_limits[caller.tier]]
        if caller.key_id and (caller.key_rpm or caller.key_tpm):
            specs.append(LimitSpec(f"key:{caller.key_id}", caller.key_rpm, caller.key_tpm))
        return specs

    async def admit(self, caller: Caller, body: dict[str, Any]) -> tuple[Reservation, int, int]:
        """Reserve rate-limit budget: estimated prompt tokens plus the output budget.

        The prompt estimate is 0 when nothing would read it (see `prompt_estimate_needed`).
        """
        prompt_tokens = estimate_prompt_tokens(body.get("messages") or []) if self._estimate_prompts else 0
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens")
                         or self._settings.merge.default_max_tokens)
        try:
            reservation = await self._limiter.reserve(self.limit_specs(caller), prompt_tokens + max_tokens)
        except Exception:
            self._metrics.rejected.labels(caller.tier, "rate_limited").inc()
            raise
        return reservation, prompt_tokens, max_tokens

    def check_fast_fail(self, model: str) -> None:
        retry_after = self._pools.fast_fail_after(model)
        if retry_after is not None:
            self._metrics.fast_fail.labels(model).inc()
            raise UpstreamUnavailable(retry_after)

    async def complete(self, caller: Caller, request_id: str, body: dict[str, Any], *, timeout_s: float | None,
                       merge_opt_out: bool, cache_control: CacheControl) -> ChatResult:
        """Answer one non-streaming chat request."""
        tier = self._tiers[caller.tier]
        if tier.omitted_temperature_is_zero and body.get("temperature") is None:
            body = {**body, "temperature": 0}
        deadline = self._clock() + min(tier.request_timeout_s, timeout_s or tier.request_timeout_s)
        self.check_fast_fail(body["model"])
        reservation, prompt_tokens, max_tokens = await self.admit(caller, body)
        try:
            result = await self._answer(caller, tier, request_id, body, deadline, prompt_tokens, max_tokens,
                                        merge_opt_out, cache_control, reservation)
        except BaseException:
            await reservation.settle(0)
            raise
        usage = result.outcome.body.get("usage") or {}
        spent = 0 if result.cache == "hit" else int(usage.get("total_tokens") or prompt_tokens + max_tokens)
        await reservation.settle(spent)
        return result

    async def _answer(self, caller: Caller, tier: TierSettings, request_id: str, body: dict[str, Any],
                      deadline: float, prompt_tokens: int, max_tokens: int, merge_opt_out: bool,
                      cache_control: CacheControl, reservation: Reservation) -> ChatResult:
        scope = self._scope(caller, tier)
        key = scope + ":" + chat_fingerprint(
            body, lowercase=self._settings.merge.lowercase, cache_version=self._settings.merge.cache_version)
        cacheable = self._cache is not None and self._cacheable(body)
        if cacheable and cache_control.read:
            cached = await self._cache.get(key)  # type: ignore[union-attr]
            if cached is not None:
                self._count_cache("hit")
                self._metrics.upstream_calls_saved.inc()
                outcome = ChatOutcome(json.loads(cached), None, 0.0)
                return ChatResult(outcome, "hit", reservation.headers(), prompt_tokens)

        def submit() -> asyncio.Future[ChatOutcome]:
            # Only the first of identical requests queues a job; SingleFlight cancels its future (the
            # queue then drops the job before dispatch) once every caller waiting for it has left.
            job = self._job(caller, tier, scope, request_id, body, deadline, prompt_tokens, max_tokens,
                            merge_opt_out)
            self._queue.submit(job)
            return job.future

        try:
            # asyncio.timeout, not wait_for: no extra task per request.
            async with asyncio.timeout(max(0.0, deadline - self._clock())):
                outcome, shared = await self._flights.join(key, submit)
        except TimeoutError:
            self._metrics.rejected.labels(caller.tier, "deadline").inc()
            raise DeadlineExceeded(f"The request did not complete within its deadline "
                                   f"({tier.request_timeout_s:g} s for tier '{tier.name}').") from None
        cache = "coalesced" if shared else "miss"
        self._count_cache(cache)
        if shared:
            self._metrics.upstream_calls_saved.inc()
        if cacheable and cache_control.write and _complete(outcome.body):
            await self._cache.set(key, json.dumps(outcome.body).encode())  # type: ignore[union-attr]
        return ChatResult(outcome, cache, reservation.headers(), prompt_tokens)

    def _count_cache(self, result: str) -> None:
        # `labels()` costs more than the increment itself, so each child is looked up once.
        child = self._cache_events.get(result)
        if child is None:
            child = self._cache_events[result] = self._metrics.cache_events.labels(result)
        child.inc()

    def _job(self, caller: Caller, tier: TierSettings, scope: str, request_id: str, body: dict[str, Any],
             deadline: float, prompt_tokens: int, max_tokens: int, merge_opt_out: bool) -> ChatJob:
        shape = None if merge_opt_out or not tier.merge or not self._settings.merge.enabled else merge_shape(body)
        merge_key = None
        if shape is not None:
            merge_key = compatibility_key(body, shape, scope_value=scope,
                                          include_system=tier.system_prompts == "exact")
        now = self._clock()
        return ChatJob(request_id=request_id, caller=caller, body=body, model=body["model"],
                       priority=aged_rank(tier.priority, now, self._settings.server.aging_per_s),
                       shape=shape, merge_key=merge_key, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                       deadline=deadline, enqueued_at=now)

    def _scope(self, caller: Caller, tier: TierSettings) -> str:
        scope = self._settings.merge.scope
        if scope == "global":
            return "global"
        if scope == "tier":
            return f"tier:{tier.name}"
        if scope == "user":
            return f"tenant:{caller.tenant}:user:{caller.user or ''}"
        return f"tenant:{caller.tenant}"

    def _cacheable(self, body: dict[str, Any]) -> bool:
        return body.get("temperature") == 0 or self._settings.cache.cache_nondeterministic

    async def stream(self, caller: Caller, body: dict[str, Any], *, timeout_s: float | None
                     ) -> tuple[AsyncIterator[bytes], str, Reservation]:
        """Open an upstream stream for a streaming request (dispatched alone, never merged)."""
        tier = self._tiers[caller.tier]
        deadline = self._clock() + min(tier.request_timeout_s, timeout_s or tier.request_timeout_s)
        self.check_fast_fail(body["model"])
        reservation, prompt_tokens, max_tokens = await self.admit(caller, body)
        try:
            chunks, provider = await self._pools.stream_chat(body["model"], body, deadline=deadline,
                                                             priority=aged_rank(tier.priority, self._clock(),
                                                                                self._settings.server.aging_per_s),
                                                             tokens=prompt_tokens + max_tokens)
        except BaseException:
            await reservation.settle(0)
            raise
        return chunks, provider, reservation


def prompt_estimate_needed(settings: Settings) -> bool:
    """Whether some part of the broker reads a chat request's prompt-token estimate under `settings`.

    Its readers: token-per-minute limits (a tier's, an API key's, a provider's), merge planning (the
    context budget and the tokens-saved count) and the usage ledger (`alone_prompt_tokens`). With
    none of them configured, counting the prompt's tokens on every request would be wasted work.
    """
    ledger = settings.ledger.path or settings.ledger.postgres_dsn
    merging = settings.merge.enabled and any(t.merge for t in settings.tiers)
    tpm = (any(t.tpm for t in settings.tiers) or any(k.tpm for k in settings.auth.keys)
           or any(p.tpm for p in settings.providers))
    return bool(ledger or merging or tpm)


def _complete(body: dict[str, Any]) -> bool:
    """Only whole answers are cached: no truncated (`length`) or filtered choices."""
    choices = body.get("choices") or []
    return bool(choices) and all(c.get("finish_reason") == "stop" for c in choices)
