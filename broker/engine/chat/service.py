"""The chat-completions path after validation: limits, cache, coalescing, queue, deadline.

Each accepted request gets exactly one outcome or one error before its deadline. Identical requests
in flight share one queued job (singleflight) when they also share the tier and the merge opt-out; a
caller that leaves or times out does not cancel it for the others, a job nobody waits for any more is
dropped before dispatch, and every caller keeps its own deadline (see `ChatService._share`). A request's
scope, fingerprint and merge key follow its tier's `merge.mergeable.UnitRules`, the rule bulk lines follow too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import structlog

from mergebroker import jsonio, tracing
from mergebroker.broker.engine.chat.job_queue import JobQueue
from mergebroker.broker.engine.chat.jobs import ChatJob, ChatOutcome, aged_rank
from mergebroker.broker.engine.chat.stream_usage import MeteredStream, caller_wants_usage, with_usage_requested
from mergebroker.broker.engine.chat.units import unit_rules
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.settings import Settings, TierSettings
from mergebroker.broker.engine.ground.tokens import estimate_prompt_tokens
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.engine.limits.limiter import Limiter
from mergebroker.broker.engine.limits.ratelimit import LimitSpec, Reservation
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import BrokerError, DeadlineExceeded, UpstreamUnavailable
from mergebroker.frozen_init import direct_init
from mergebroker.merge.cache import TwoLevelCache
from mergebroker.merge.coalesce import Lead, SingleFlight
from mergebroker.providers.base import Pool

log = structlog.get_logger(__name__)


@direct_init  # built on every request
@dataclass(frozen=True)
class ChatResult:
    """A finished chat request: the outcome, how the cache took part, and the rate-limit headers."""

    outcome: ChatOutcome
    cache: str  # "hit" | "coalesced" | "miss"
    limit_headers: dict[str, str]
    prompt_estimate: int | None = 0  # estimated prompt tokens had it been sent alone (None: not counted)


@dataclass(frozen=True)
class StreamStart:
    """A stream as it starts: the SSE events to relay, the outcome (provider, batch, the usage to come),
    the rate-limit reservation to settle, and the prompt's estimated tokens had it been sent alone."""

    chunks: AsyncIterable[bytes]
    outcome: ChatOutcome
    reservation: Reservation
    prompt_estimate: int = 0


@dataclass(frozen=True)
class CacheControl:
    read: bool = True
    write: bool = True

    @classmethod
    def from_header(cls, value: str | None) -> CacheControl:
        if not value:
            return _READ_WRITE
        directives = {d.strip().lower() for d in value.split(",")}
        return cls(read="no-cache" not in directives, write="no-store" not in directives)


_READ_WRITE = CacheControl()


class ChatService:
    """Admits, caches, coalesces and queues chat requests."""

    def __init__(self, settings: Settings, *, queue: JobQueue, pools: Pool, limiter: Limiter,
                 cache: TwoLevelCache | None, metrics: Metrics, clock: Clock = monotonic) -> None:
        self._settings = settings
        self._queue = queue
        self._pools = pools
        self._limiter = limiter
        self._cache = cache
        self._metrics = metrics
        self._clock = clock
        self._flights: SingleFlight[str, ChatOutcome] = SingleFlight()
        self._pending: dict[str, tuple[ChatJob, asyncio.Future[ChatOutcome]]] = {}  # flight key -> its job
        # and future until answered, for followers' deadlines
        self._tiers = {t.name: t for t in settings.tiers}
        self._tier_limits = {t.name: LimitSpec(f"tier:{t.name}", t.rpm, t.tpm) for t in settings.tiers}
        self._units = {t.name: unit_rules(settings, t) for t in settings.tiers}  # the rule bulk jobs follow too
        self._estimate_prompts = prompt_estimate_needed(settings)
        self._cache_events: dict[str, Any] = {}  # labelled children by result, looked up once

    def merges(self, tier: str) -> bool:
        """Whether requests of `tier` may merge (merging is on, and the tier merges)."""
        return self._units[tier].merging

    def limit_specs(self, caller: Caller) -> list[LimitSpec]:
        """The admission limits that apply to `caller`: its tier's, and its API key's when it has any."""
        return caller.limits(self._tier_limits[caller.tier])

    async def admit(self, caller: Caller, body: dict[str, Any]) -> tuple[Reservation, int, int]:
        """Reserve rate-limit budget: estimated prompt tokens plus the output budget.

        The prompt estimate is 0 when nothing would read it (see `prompt_estimate_needed`).
        """
        reservation, prompt_tokens, max_tokens = await self._admit(caller, body, count_late=False)
        return reservation, prompt_tokens or 0, max_tokens

    async def _admit(self, caller: Caller, body: dict[str, Any], *,
                     count_late: bool) -> tuple[Reservation, int | None, int]:
        """`admit`; `count_late`: count the prompt now only where a token limit of the caller reserves it, else
        its estimate is None and its job counts it where something reads it (`ChatJob.counted_prompt`).
        Counting is the largest part of a lone request's own work (the tokenizer), and a request sent alone,
        where nothing limits or prices tokens, never needs it."""
        specs = self.limit_specs(caller)
        prompt_tokens: int | None = 0
        if self._estimate_prompts:
            prompt_tokens = (estimate_prompt_tokens(body.get("messages") or [])
                             if not count_late or any(s.tpm for s in specs) else None)
        max_tokens = self._units[caller.tier].budget(body)
        try:
            reservation = await self._limiter.reserve(specs, (prompt_tokens or 0) + max_tokens)
        except Exception:
            self._metrics.rejected.labels(caller.tier, "rate_limited").inc()
            raise
        return reservation, prompt_tokens, max_tokens

    def check_fast_fail(self, model: str) -> None:
        retry_after = self._pools.fast_fail_after(model)
        if retry_after is not None:
            self._metrics.fast_fail.labels(self._metrics.model_label(model)).inc()
            raise UpstreamUnavailable(retry_after)

    async def complete(self, caller: Caller, request_id: str, body: dict[str, Any], *, timeout_s: float | None,
                       merge_opt_out: bool, cache_control: CacheControl) -> ChatResult:
        """Answer one non-streaming chat request."""
        tier = self._tiers[caller.tier]
        body = self._units[tier.name].read(body)
        limit_s = tier.timeout_for(timeout_s)
        deadline = self._clock() + limit_s
        self.check_fast_fail(body["model"])
        reservation, prompt_tokens, max_tokens = await self._admit(caller, body, count_late=True)
        try:
            result = await self._answer(caller, tier, request_id, body, (deadline, limit_s), prompt_tokens,
                                        max_tokens, merge_opt_out, cache_control, reservation)
        except BaseException:
            await reservation.settle(0)
            raise
        usage = result.outcome.usage
        spent = 0 if result.cache == "hit" else (usage.total_tokens if usage else (prompt_tokens or 0) + max_tokens)
        await reservation.settle(spent)
        return result

    async def _answer(self, caller: Caller, tier: TierSettings, request_id: str, body: dict[str, Any],
                      time_limit: tuple[float, float], prompt_tokens: int | None, max_tokens: int, merge_opt_out: bool,
                      cache_control: CacheControl, reservation: Reservation) -> ChatResult:
        deadline, limit_s = time_limit
        scope = self._scope(caller, tier)
        key = self._units[tier.name].fingerprint(body, scope)
        cacheable = self._cache is not None and self._cacheable(body)
        if cacheable and cache_control.read:
            cached = await self._cache.get(key)  # type: ignore[union-attr]
            if cached is not None:
                self._count_cache("hit")
                self._metrics.upstream_calls_saved.inc()
                outcome = ChatOutcome(jsonio.loads(cached), None, 0.0)
                return ChatResult(outcome, "hit", reservation.headers(), prompt_tokens)

        # A follower shares the leader's job: its tier (window, priority) and its merge opt-out must match.
        flight = f"{key}|{tier.name}|{'alone' if merge_opt_out else 'mergeable'}"
        made: list[ChatJob] = []  # this caller's own job, whose prompt count (if one was made) it reports

        def submit() -> asyncio.Future[ChatOutcome] | Lead[ChatOutcome]:
            # Only the first of identical requests queues a job; SingleFlight cancels its future (the
            # queue then drops the job before dispatch) once every caller waiting for it has left.
            # A job that cannot merge is run by this caller's own task when the queue allows it; should
            # this caller leave mid-call while identical requests wait on it, it goes to the queue for them.
            job = self._job(caller, tier, scope, request_id, body, deadline, prompt_tokens, max_tokens,
                            merge_opt_out)
            made.append(job)
            run = self._queue.run_now(job)
            future = job.future if run is not None else self._queue.submit(job)
            self._pending[flight] = (job, future)
            future.add_done_callback(partial(self._untrack, flight, job))
            return future if run is None else Lead(future, run, partial(self._hand_over, job))

        try:
            # A timeout context, not wait_for: no extra task per request.
            async with self._clock.timeout_at(deadline):
                outcome, shared = await self._share(flight, submit, deadline)
        except TimeoutError:
            self._metrics.rejected.labels(caller.tier, "deadline").inc()
            raise DeadlineExceeded(f"The request did not complete within its deadline "
                                   f"({limit_s:g} s in tier '{tier.name}').") from None
        cache = "coalesced" if shared else "miss"
        self._count_cache(cache)
        if shared:
            self._metrics.upstream_calls_saved.inc()
        if cacheable and cache_control.write and cacheable_reply(outcome.body, body):
            await self._cache.set(key, jsonio.dumps(outcome.body))  # type: ignore[union-attr]
        return ChatResult(outcome, cache, reservation.headers(), made[0].prompt_tokens if made else prompt_tokens)

    async def _share(self, flight: str, submit: Callable[[], asyncio.Future[ChatOutcome] | Lead[ChatOutcome]],
                     deadline: float) -> tuple[ChatOutcome, bool]:
        """The outcome of the pending job for `flight` (or of a new one), and whether it was shared.

        A follower asks the queue to extend a job not yet sent to its own deadline. A job already sent
        runs on the deadline it was sent with; when that earlier deadline cuts it short, this caller,
        still in time, starts over with a job of its own.
        """
        while True:
            pending = self._pending.get(flight)
            # An answered job whose clean-up callback has not run yet is no one to join: `join` starts afresh.
            joined = pending[0] if pending is not None and not pending[1].done() else None
            if joined is not None:
                self._queue.extend(joined, deadline)
            try:
                return await self._flights.join(flight, submit)
            except DeadlineExceeded:  # the pool's error when the job's deadline, not the upstream, ran out
                if joined is None or joined.deadline >= deadline or self._clock() >= deadline:
                    raise
                log.info("coalesced_retry", reason="shared_job_deadline")

    def _hand_over(self, job: ChatJob) -> None:
        """Queue a job whose caller left while running it, for the identical requests still waiting on it."""
        try:
            self._queue.submit(job)
        except BrokerError as exc:  # shutting down, or the tier is full: they hear why
            job.fail(exc)

    def _untrack(self, flight: str, job: ChatJob, _future: asyncio.Future[ChatOutcome]) -> None:
        # A newer job may own the key already (the old one was cancelled as its callers left).
        if (self._pending.get(flight) or (None,))[0] is job:
            del self._pending[flight]

    def _count_cache(self, result: str) -> None:
        # `labels()` costs more than the increment itself, so each child is looked up once.
        child = self._cache_events.get(result)
        if child is None:
            child = self._cache_events[result] = self._metrics.cache_events.labels(result)
        child.inc()

    def _job(self, caller: Caller, tier: TierSettings, scope: str, request_id: str, body: dict[str, Any],
             deadline: float, prompt_tokens: int | None, max_tokens: int, merge_opt_out: bool, *,
             stream: bool = False) -> ChatJob:
        shape, merge_key = self._units[tier.name].identity(body, scope, mergeable=not merge_opt_out, stream=stream)
        now = self._clock()
        return ChatJob(request_id=request_id, caller=caller, body=body, model=body["model"],
                       priority=aged_rank(tier.priority, now, self._settings.server.aging_per_s),
                       shape=shape, merge_key=merge_key, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                       deadline=deadline, enqueued_at=now, stream=stream, trace_context=tracing.current())

    def _scope(self, caller: Caller, tier: TierSettings) -> str:
        return self._units[tier.name].scope_of(tenant=caller.tenant, tier=tier.name, user=caller.user)

    def _cacheable(self, body: dict[str, Any]) -> bool:
        return deterministic(body) or self._settings.cache.cache_nondeterministic

    async def stream(self, caller: Caller, body: dict[str, Any], *, timeout_s: float | None,
                     request_id: str = "", merge_opt_out: bool = False) -> StreamStart:
        """Open a stream for a streaming request: its own upstream stream, or, in a tier with
        `merge_streams`, its block of a merged call (queued like any mergeable request).

        Either way the outcome's `settled_usage` settles with the stream's usage once it ends (the
        provider's, asked for upstream whether or not the caller did; counted when it sends none)."""
        tier = self._tiers[caller.tier]
        deadline = self._clock() + tier.timeout_for(timeout_s)
        self.check_fast_fail(body["model"])
        reservation, prompt_tokens, max_tokens = await self.admit(caller, body)
        try:
            if not merge_opt_out and self._streams_merge(tier, body):
                job = self._job(caller, tier, self._scope(caller, tier), request_id, body, deadline, prompt_tokens,
                                 max_tokens, False, stream=True)
                async with self._clock.timeout_at(deadline):
                    outcome = await self._queue.submit(job)
                return StreamStart(outcome.stream, outcome, reservation, prompt_tokens)  # type: ignore[arg-type]
            chunks, provider = await self._pools.stream_chat(body["model"], with_usage_requested(body),
                                                             deadline=deadline,
                                                             priority=aged_rank(tier.priority, self._clock(),
                                                                                self._settings.server.aging_per_s),
                                                             tokens=prompt_tokens + max_tokens, tenant=caller.tenant)
        except TimeoutError:
            await reservation.settle(0)
            self._metrics.rejected.labels(caller.tier, "deadline").inc()
            raise DeadlineExceeded(f"The stream did not start within its deadline in tier '{tier.name}'.") from None
        except BaseException:
            await reservation.settle(0)
            raise
        metered = MeteredStream(chunks, relay_usage=caller_wants_usage(body), prompt_tokens=prompt_tokens)
        return StreamStart(metered, ChatOutcome({}, provider, 0.0, settled_usage=metered.usage), reservation,
                           prompt_tokens)

    def _streams_merge(self, tier: TierSettings, body: dict[str, Any]) -> bool:
        """Whether a streaming request may wait for merge partners: the tier allows it, the upstreams take
        merged calls as streams, no stop sequences (they would have to be held back too), not cluster mode."""
        return (tier.streams_merge and tier.merge and self._settings.merge.enabled
                and not self._settings.cluster.enabled and not body.get("stop")
                and self._pools.streams_merged(body["model"]))


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


def deterministic(request: Mapping[str, Any]) -> bool:
    """Whether a chat request asks for a repeatable answer: `temperature` 0, or a `seed`."""
    return request.get("temperature") == 0 or request.get("seed") is not None


def cacheable_reply(reply: Mapping[str, Any], request: Mapping[str, Any]) -> bool:
    """Whether `reply` may answer `request` again from the cache: only whole answers, never a truncated
    (`length`) or filtered choice; tool calls only for a `deterministic` request, because an agent that
    re-sends a turn at a temperature expects a fresh sample. (The key holds `tools` and `tool_choice`.)"""
    choices = reply.get("choices") or []
    whole = _WHOLE_REPEATABLE if deterministic(request) else _WHOLE
    if len(choices) == 1:  # most replies
        return choices[0].get("finish_reason") in whole
    return bool(choices) and {c.get("finish_reason") for c in choices} <= whole


_WHOLE = frozenset({"stop"})
_WHOLE_REPEATABLE = frozenset({"stop", "tool_calls"})
