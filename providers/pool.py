"""Provider pools: which upstream serves a call, failover between them, retries around that.

One attempt tries the model's upstreams in routing order (least in flight, or smooth weighted round
robin), skipping those whose breaker is open and failing over on retryable errors; retries (with
backoff that honours Retry-After) repeat the attempt until the request's deadline. When every upstream
of the model is open, the call fails at once with `UpstreamUnavailable` (503 + Retry-After).
Each upstream's concurrency and declared RPM/TPM are enforced here and only here: an attempt waits for
them within the request's deadline, and a successful reply's real usage settles the token estimate.
Each attempt's timeout is the read timeout (`read_timeout_for`), cut short by the request's deadline;
when the deadline is what ran out, the attempt ends as `DeadlineExceeded`, which the breaker ignores:
a caller's short deadline says nothing about the upstream's health.
Retries are counted per provider and reason, for streams as for plain calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import structlog

from mergebroker import tracing
from mergebroker.breaker.circuit import PROBE_BUSY_RETRY_S, BreakerOpenError
from mergebroker.breaker.policy import all_open_retry_after
from mergebroker.clock import Clock, Sleep, monotonic
from mergebroker.errors import (
    DeadlineExceeded,
    NotFound,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
    UpstreamUnsupported,
)
from mergebroker.output_budget import token_budget
from mergebroker.providers import attempt_trace
from mergebroker.providers.held_stream import HeldStream
from mergebroker.providers.openai.compat import read_timeout_for
from mergebroker.providers.opened_stream import first_chunk_opener
from mergebroker.providers.retry import RetryPolicy, call_with_retries, remaining, retry_reason
from mergebroker.providers.upstream import NullObserver, PoolObserver, Strategy, Upstream, order_upstreams
from mergebroker.token_usage import TokenUsage

log = structlog.get_logger(__name__)
T = TypeVar("T")
EMBEDDINGS_TIMEOUT_S = 30.0
DEADLINE_SLACK_S = 0.05
"""A timeout this close to the request's deadline is the deadline's doing (timers fire a little late or early)."""


Attempt = Callable[[Upstream, float], Awaitable[T]]
"""One call on one upstream, given the upstream and the call's timeout in seconds."""


@dataclass(slots=True)
class _CallSpec:
    """What a pooled call needs besides its attempt: budget, pacing, and how long it holds its slot."""

    deadline: float
    priority: float
    tokens: int
    read_timeout: Callable[[Upstream], float]
    holds_slot: bool = False  # streams keep their upstream slot until the last chunk
    tenant: str | None = None  # whom the call is for: the breaker's blame rule (breaker.blame)
    operation: str = "chat"  # gen_ai.operation.name of its attempts' spans
    body: dict[str, Any] | None = None  # the request, read by tracing only (recorded when content may be)


class ProviderPools:
    """All upstreams, grouped per model on demand; the only door to providers."""

    def __init__(self, upstreams: list[Upstream], *, strategy: Strategy = "least_in_flight",
                 retry: RetryPolicy = RetryPolicy(), clock: Clock = monotonic, sleep: Sleep | None = None,
                 observer: PoolObserver | None = None) -> None:
        """`clock` measures deadlines and waits for slots and pacing; `sleep` (default `clock.sleep`) is the
        retry backoff's wait."""
        self.upstreams = upstreams
        self._by_model: dict[str, list[Upstream]] = {}
        self._strategy = strategy
        self._retry = retry
        self._clock = clock
        self._sleep = sleep or clock.sleep
        self._observer: PoolObserver = observer or NullObserver()

    def for_model(self, model: str) -> list[Upstream]:
        """The upstreams serving `model`, in configuration order (glob matching done once per model name)."""
        found = self._by_model.get(model)
        if found is None:
            found = [u for u in self.upstreams if u.serves(model)]
            if len(self._by_model) < 10_000:  # callers choose model names: keep the memo bounded
                self._by_model[model] = found
        return found

    def serves(self, model: str) -> bool:
        """True when some upstream serves `model`."""
        return bool(self.for_model(model))

    def limits_tokens(self, model: str) -> bool:
        """True when some upstream of `model` declares a token rate: only then does a call's token estimate
        matter to the pool (callers may skip counting it otherwise)."""
        return any(u.limits_tokens for u in self.for_model(model))

    def streams_merged(self, model: str) -> bool:
        """True when every upstream of `model` takes merged calls as streams (so any failover target can)."""
        upstreams = self.for_model(model)
        return bool(upstreams) and all(u.streams_merged for u in upstreams)

    def explicit_models(self) -> list[str]:
        """Model names configured without wildcards, sorted."""
        return sorted({m for u in self.upstreams for m in u.models if "*" not in m and "?" not in m})

    def has_wildcard(self) -> bool:
        """True when some upstream serves models by pattern (its model list comes from the upstream)."""
        return any("*" in m or "?" in m for u in self.upstreams for m in u.models)

    async def upstream_models(self) -> list[str]:
        """Model names reported by the first wildcard upstream that answers."""
        for u in self.upstreams:
            if not any("*" in m or "?" in m for m in u.models):
                continue
            try:
                return await u.provider.list_models(timeout=5.0)
            except UpstreamError:
                continue
        return []

    def rpm_pressure(self, model: str) -> float:
        """How close the model's upstreams are to their declared RPM, 0..1 (the least pressed one counts:
        a call that fits there costs the limit nothing)."""
        upstreams = [u for u in self.for_model(model) if not u.is_open()]
        if not upstreams:
            return 0.0
        return min(u.limiter.rpm_pressure() if u.limiter is not None else 0.0 for u in upstreams)

    def fast_fail_after(self, model: str) -> float | None:
        """Seconds until the next probe when every upstream of the model is open, else None."""
        return all_open_retry_after([u.breaker for u in self.for_model(model)])

    def chat(self, model: str, body: dict[str, Any], *, deadline: float, priority: float = 0,
             tokens: int = 0, tenant: str | None = None) -> Coroutine[Any, Any, tuple[dict[str, Any], str]]:
        """One chat completion through the pool, to await; returns (body, provider name).

        `tokens` is the estimate taken from the upstream's token budget; the real usage settles it.
        `tenant` is whom the call is for (None: several or unknown), for the breakers' blame rule.
        """
        # The pool's entry points hand back `_call`'s coroutine rather than awaiting it, and each attempt is
        # the provider's own coroutine: every call goes through them, and each awaiting layer costs a frame.
        return self._call(model, lambda u, timeout: u.provider.chat(body, timeout=timeout),
                          _CallSpec(deadline, priority, tokens, lambda u: _read_timeout(body, u.token_rate),
                                    tenant=tenant, body=body))

    def embeddings(self, model: str, body: dict[str, Any], *, deadline: float,
                   tokens: int = 0, tenant: str | None = None) -> Coroutine[Any, Any, tuple[dict[str, Any], str]]:
        """One embeddings call through the pool, to await; returns (body, provider name)."""
        return self._call(model, lambda u, timeout: u.provider.embeddings(body, timeout=timeout),
                          _CallSpec(deadline, 0, tokens, lambda u: EMBEDDINGS_TIMEOUT_S, tenant=tenant,
                                    operation="embeddings"))

    def stream_chat(self, model: str, body: dict[str, Any], *, deadline: float, priority: float = 0,
                    tokens: int = 0, tenant: str | None = None) -> Coroutine[Any, Any, tuple[AsyncIterator[bytes], str]]:
        """Open a stream on the first healthy upstream that answers, to await; failover happens before the first
        byte.

        The stream keeps its upstream's concurrency slot until it ends or is closed.
        """
        def open_stream(u: Upstream, timeout: float) -> AsyncIterator[bytes]:
            return u.provider.stream_chat(body, timeout=timeout)

        return self._call(model, first_chunk_opener(open_stream),
                          _CallSpec(deadline, priority, tokens, lambda u: _read_timeout(body, u.token_rate),
                                    holds_slot=True, tenant=tenant, body=body))

    def speaks(self, model: str, api: str) -> bool:
        """Whether some upstream of `model` takes the inbound `api` natively (`providers.native_api`)."""
        return any(api in getattr(u.provider, "native_apis", ()) for u in self.for_model(model))

    def native(self, model: str, api: str, body: dict[str, Any], *, headers: Mapping[str, str],
               deadline: float, priority: float = 0, tokens: int = 0,
               tenant: str | None = None) -> Coroutine[Any, Any, tuple[dict[str, Any], str]]:
        """One native call of `api` (its body as sent) through the pool, like `chat`. Upstreams that do
        not take `api` natively refuse with `native_unsupported`, so the call fails over to those that do,
        and only when none does is that the error (the caller then translates)."""
        def attempt(u: Upstream, timeout: float) -> Awaitable[dict[str, Any]]:
            return u.provider.native(api, body, headers=headers, timeout=timeout)  # type: ignore[attr-defined]

        return self._call(model, attempt, _CallSpec(deadline, priority, tokens,
                                                    lambda u: _read_timeout(body, u.token_rate), tenant=tenant,
                                                    body=body))

    def stream_native(self, model: str, api: str, body: dict[str, Any], *, headers: Mapping[str, str],
                      deadline: float, priority: float = 0, tokens: int = 0,
                      tenant: str | None = None) -> Coroutine[Any, Any, tuple[AsyncIterator[bytes], str]]:
        """A native stream of `api` through the pool, like `stream_chat` (failover before the first byte)."""
        def open_stream(u: Upstream, timeout: float) -> AsyncIterator[bytes]:
            return u.provider.stream_native(api, body, headers=headers, timeout=timeout)  # type: ignore[attr-defined]

        return self._call(model, first_chunk_opener(open_stream),
                          _CallSpec(deadline, priority, tokens, lambda u: _read_timeout(body, u.token_rate),
                                    holds_slot=True, tenant=tenant, body=body))

    async def close(self) -> None:
        """Close every provider's connections."""
        for u in self.upstreams:
            await u.provider.close()

    async def _call(self, model: str, attempt: Attempt[T], spec: _CallSpec) -> tuple[T, str]:
        upstreams = self.for_model(model)
        if not upstreams:
            raise NotFound(f"The model '{model}' does not exist.", param="model", code="model_not_found")
        return await call_with_retries(partial(self._failover, model, upstreams, attempt, spec), policy=self._retry,
                                       deadline=spec.deadline, clock=self._clock, sleep=self._sleep,
                                       on_retry=self._count_retry)

    def _count_retry(self, exc: BaseException, _wait_s: float) -> None:
        self._observer.retried(getattr(exc, "provider", "pool"), retry_reason(exc))

    async def _failover(self, model: str, upstreams: list[Upstream], attempt: Attempt[T],
                        spec: _CallSpec) -> tuple[T, str]:
        """One round over the model's upstreams in routing order; the first answer wins.

        A retryable failure moves on to the next upstream and, if none answers, is raised (tagged with
        its provider) for the retry loop; a caller fault is raised at once, except a field one kind of
        upstream cannot carry (`UpstreamUnsupported`): that moves on too, and is raised last. When no
        upstream could even be tried (breakers open, or a half-open one busy with its probe) the round
        ends with `UpstreamUnavailable`, which is never retried; when every breaker is open that is the
        fast-fail rule's answer, reached without trying any.
        """
        failure: UpstreamError | None = None
        unsupported: UpstreamUnsupported | None = None
        refusals: list[float] = []
        for u in order_upstreams([u for u in upstreams if not u.is_open()], self._strategy):
            try:
                return await self._try(model, u, attempt, spec), u.name
            except BreakerOpenError as exc:
                refusals.append(exc.retry_after or PROBE_BUSY_RETRY_S)
            except UpstreamUnsupported as exc:  # another kind of upstream may carry what this one cannot
                unsupported = unsupported or exc
            except UpstreamError as exc:
                exc.provider = u.name  # type: ignore[attr-defined]  # labels the retry this may cause
                if not exc.retryable:
                    raise
                failure = exc
        if failure is not None or unsupported is not None:
            raise failure or unsupported  # type: ignore[misc]
        retry_after = self.fast_fail_after(model)
        raise UpstreamUnavailable(retry_after if retry_after is not None else max(0.1, min(refusals, default=1.0)))

    async def _try(self, model: str, u: Upstream, attempt: Attempt[T], spec: _CallSpec) -> T:
        """One attempt on one upstream: breaker check, rate and concurrency slot, the call, the settlement.

        While tracing is on, the call has its own CLIENT span (current while it goes out: its `traceparent`),
        ended with the reply, the failure, or (a stream) the stream's end."""
        if spec.deadline - self._clock() <= 0:
            raise DeadlineExceeded("The request's deadline passed before an upstream answered.")
        if u.breaker is not None and u.waits_for_room:
            u.breaker.before_call(spec.tenant)  # refuse before queueing for a slot or spending rate budget
        taken = await u.acquire(spec.tokens, spec.priority, spec.deadline, self._clock)
        sent = False
        span: tracing.AttemptSpan | None = None
        try:
            left, read_timeout = spec.deadline - self._clock(), spec.read_timeout(u)
            if left <= 0:
                raise DeadlineExceeded("The request's deadline passed while waiting for an upstream slot.")
            sent = True
            if tracing.enabled():
                span = tracing.start_attempt(spec.operation, model, attempt_trace.peer_of(u), self._clock(),
                                             attempt_trace.input_text(spec.body) if spec.body else None)
            try:
                result = await self._guarded(u, attempt, min(left, read_timeout),
                                             deadline=spec.deadline if left < read_timeout else None,
                                             tenant=spec.tenant, request_deadline=spec.deadline)
            finally:
                if span is not None:
                    span.detach()
        except BaseException as exc:
            if span is not None:
                span.failed(self._clock(), exc)
            u.release()
            u.give_back_unspent(exc, sent, taken)
            raise
        if u.limiter is not None:
            used = TokenUsage.from_body(_reply_of(result))
            if used is not None:
                u.limiter.give_back(taken - used.total_tokens)
        if span is not None:
            if spec.holds_slot:
                result = attempt_trace.TracedStream(result, span, self._clock)  # type: ignore[arg-type, assignment]
            else:
                attempt_trace.reply_seen(span, result, self._clock())
        if spec.holds_slot:
            return HeldStream(result, u.release,  # type: ignore[arg-type, return-value]
                               on_broken=lambda exc: self._stream_broke(u, exc, spec.tenant))
        u.release()
        return result

    def _stream_broke(self, u: Upstream, exc: BaseException, tenant: str | None) -> None:
        """A stream whose upstream failed after its first chunk: the call did not succeed after all."""
        self._observer.called(u.name, "stream_broken", None)
        if u.breaker is not None and isinstance(exc, UpstreamError) and exc.retryable:
            u.breaker.record_failure(tenant)

    async def _guarded(self, u: Upstream, attempt: Attempt[T], timeout: float, *, deadline: float | None,
                       tenant: str | None = None, request_deadline: float | None = None) -> T:
        """The call inside `u`'s breaker (its one admission check of this attempt where taking the slot never
        waits). `deadline` is set when the request's deadline, not the read timeout, bounds it: a timeout
        then is the caller's budget running out, and says nothing about the upstream's health, so it leaves
        as `DeadlineExceeded` (neither success nor failure). A call cancelled once `request_deadline` has
        come (its caller's own timer, which may fire in the same loop turn as this one's) is counted as the
        deadline's too, not as a caller that left. A reply's output tokens at `u.token_rate` are time it was
        expected to take (not slow)."""
        started = self._clock()
        outcome = "error"
        try:
            with u.breaker.guard(tenant) if u.breaker is not None else _UNGUARDED as call:
                try:
                    if deadline is None:
                        result = await attempt(u, timeout)
                    else:
                        # The provider's own timeout runs on real time; the deadline is also kept on the injected
                        # clock, which ends the call the moment the deadline passes there (a fake clock's `advance`).
                        async with self._clock.timeout_at(deadline):
                            result = await attempt(u, timeout)
                except TimeoutError:
                    raise DeadlineExceeded("The request's deadline passed before the upstream answered.") from None
                except UpstreamTimeout as exc:
                    # Only when the deadline has really come: a connect timeout firing earlier is the upstream's.
                    if deadline is not None and remaining(deadline, self._clock) <= DEADLINE_SLACK_S:
                        raise DeadlineExceeded("The request's deadline passed before the upstream answered.") from exc
                    raise
                if call is not None:
                    # A stream replaying a whole reply waited for all of it: its output's time is expected.
                    call.allowance = partial(_output_time, result, u.token_rate)
            outcome = "success"
            return result
        except BreakerOpenError:
            outcome = "breaker_open"
            raise
        except DeadlineExceeded:
            outcome = "deadline"
            raise
        except UpstreamError as exc:
            outcome = retry_reason(exc) if exc.retryable else "client_error"
            raise
        except asyncio.CancelledError:
            due = request_deadline is not None and remaining(request_deadline, self._clock) <= DEADLINE_SLACK_S
            outcome = "deadline" if due else "cancelled"
            raise
        finally:
            if outcome != "breaker_open":
                self._observer.called(u.name, outcome, self._clock() - started)
            elif u.waits_for_room:  # refused after waiting for room; a refusal without a wait is a pre-check's
                self._observer.called(u.name, outcome, None)


_UNGUARDED = nullcontext(None)
"""The breaker's place around a call to an upstream that has none."""


def _reply_of(result: Any) -> Any:
    """The reply a call's result carries: a plain call's body, or the whole reply a stream replays (else None)."""
    return result if isinstance(result, dict) else getattr(result, "whole_reply", None)


def _output_time(result: Any, token_rate: float) -> float:
    """The time a reply's output tokens take at `token_rate`: expected, not slow (asked only of slow calls)."""
    usage = TokenUsage.from_body(_reply_of(result))
    return (usage.completion_tokens if usage else 0) / token_rate


def _read_timeout(body: dict[str, Any], token_rate: float) -> float:
    """The chat read timeout: `read_timeout_for` (the one rule) applied to the body's output budget."""
    budget = token_budget(body, 0)
    return read_timeout_for(budget or None, token_rate=token_rate)
