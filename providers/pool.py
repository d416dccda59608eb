"""Provider pools: which upstream serves a call, failover between them, retries around that.

One attempt tries the model's upstreams in routing order (least in flight, or smooth weighted round
robin), skipping those whose breaker is open and failing over on retryable errors; retries (with
backoff that honours Retry-After) repeat the attempt until the request's deadline. When every upstream
of the model is open, the call fails at once with `UpstreamUnavailable` (503 + Retry-After).
Each upstream's concurrency and declared RPM/TPM are enforced here and only here.
"""

from __future__ import annotations

import asyncio
import fnmatch
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, TypeVar

import structlog

from breaker.circuit import BreakerOpenError, BreakerState, CircuitBreaker
from broker.clock import Clock, Sleep, monotonic, sleep
from broker.errors import DeadlineExceeded, NotFound, UpstreamError, UpstreamUnavailable
from broker.metrics import Metrics
from broker.upstream_limiter import UpstreamLimiter
from providers.base import Provider
from providers.retry import RetryPolicy, call_with_retries, retry_reason

log = structlog.get_logger(__name__)
T = TypeVar("T")
Strategy = Literal["least_in_flight", "round_robin"]


@dataclass(eq=False)
class Upstream:
    """One provider in a pool, with its own breaker, rate limiter and concurrency cap."""

    provider: Provider
    models: tuple[str, ...] = ("*",)
    weight: int = 1
    breaker: CircuitBreaker | None = None
    limiter: UpstreamLimiter | None = None
    max_in_flight: int | None = None
    token_rate: float = 50.0
    in_flight: int = 0
    _current_weight: int = 0
    _slots: asyncio.Semaphore | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.provider.name

    def serves(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    def is_open(self) -> bool:
        return self.breaker is not None and self.breaker.state is BreakerState.OPEN


def order_upstreams(upstreams: list[Upstream], strategy: Strategy) -> list[Upstream]:
    """Routing order for one attempt (pure apart from the round-robin weights it advances)."""
    if len(upstreams) <= 1:
        return list(upstreams)
    if strategy == "least_in_flight":
        return sorted(upstreams, key=lambda u: (u.in_flight / u.weight, -u.weight))
    total = sum(u.weight for u in upstreams)  # smooth weighted round robin (nginx)
    for u in upstreams:
        u._current_weight += u.weight
    first = max(upstreams, key=lambda u: u._current_weight)
    first._current_weight -= total
    return [first] + [u for u in upstreams if u is not first]


class ProviderPools:
    """All upstreams, grouped per model on demand; the only door to providers."""

    def __init__(self, upstreams: list[Upstream], *, strategy: Strategy = "least_in_flight",
                 retry: RetryPolicy = RetryPolicy(), clock: Clock = monotonic, sleep: Sleep = sleep,
                 metrics: Metrics | None = None) -> None:
        self.upstreams = upstreams
        self._strategy = strategy
        self._retry = retry
        self._clock = clock
        self._sleep = sleep
        self._metrics = metrics
        for u in upstreams:
            if u.max_in_flight:
                u._slots = asyncio.Semaphore(u.max_in_flight)

    def for_model(self, model: str) -> list[Upstream]:
        return [u for u in self.upstreams if u.serves(model)]

    def serves(self, model: str) -> bool:
        return bool(self.for_model(model))

    def explicit_models(self) -> list[str]:
        return sorted({m for u in self.upstreams for m in u.models if "*" not in m and "?" not in m})

    async def upstream_models(self) -> list[str]:
        """Model names reported by the first upstream that answers (for pools serving any model)."""
        for u in self.upstreams:
            try:
                return await u.provider.list_models(timeout=5.0)
            except UpstreamError:
                continue
        return []

    def fast_fail_after(self, model: str) -> float | None:
        """Seconds until the next probe when every upstream of the model is open, else None."""
        upstreams = self.for_model(model)
        if not upstreams or not all(u.is_open() for u in upstreams):
            return None
        return max(0.1, min(u.breaker.seconds_until_probe() for u in upstreams if u.breaker))

    async def chat(self, model: str, body: dict[str, Any], *, deadline: float, priority: int = 0,
                   tokens: int = 0) -> tuple[dict[str, Any], str]:
        """One chat completion through the pool; returns (body, provider name)."""
        async def attempt(u: Upstream, timeout: float) -> dict[str, Any]:
            return await u.provider.chat(body, timeout=timeout)

        return await self._call(model, attempt, deadline=deadline, priority=priority, tokens=tokens,
                                read_timeout=lambda u: _read_timeout(body, u.token_rate))

    async def embeddings(self, model: str, body: dict[str, Any], *, deadline: float,
                         tokens: int = 0) -> tuple[dict[str, Any], str]:
        async def attempt(u: Upstream, timeout: float) -> dict[str, Any]:
            return await u.provider.embeddings(body, timeout=timeout)

        return await self._call(model, attempt, deadline=deadline, priority=0, tokens=tokens,
                                read_timeout=lambda u: 30.0)

    async def _call(self, model: str, attempt: Callable[[Upstream, float], Awaitable[T]], *, deadline: float,
                    priority: int, tokens: int, read_timeout: Callable[[Upstream], float]) -> tuple[T, str]:
        upstreams = self.for_model(model)
        if not upstreams:
            raise NotFound(f"The model '{model}' does not exist.", param="model", code="model_not_found")

        async def one_attempt() -> tuple[T, str]:
            return await self._failover(model, upstreams, attempt, deadline, priority, tokens, read_timeout)

        def on_retry(exc: BaseException, wait_s: float) -> None:
            if self._metrics:
                self._metrics.retries.labels(getattr(exc, "provider", "pool"), retry_reason(exc)).inc()

        return await call_with_retries(one_attempt, policy=self._retry, deadline=deadline, clock=self._clock,
                                       sleep=self._sleep, on_retry=on_retry)

    async def _failover(self, model: str, upstreams: list[Upstream], attempt: Callable[[Upstream, float], Awaitable[T]],
                        deadline: float, priority: int, tokens: int,
                        read_timeout: Callable[[Upstream], float]) -> tuple[T, str]:
        retry_after = self.fast_fail_after(model)
        if retry_after is not None:
            raise UpstreamUnavailable(retry_after)
        last: UpstreamError | None = None
        for u in order_upstreams([u for u in upstreams if not u.is_open()], self._strategy):
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise DeadlineExceeded("The request's deadline passed before an upstream answered.")
            try:
                async with self._slot(u, tokens, priority):
                    result = await self._guarded(u, attempt, min(remaining, read_timeout(u)))
                return result, u.name
            except BreakerOpenError as exc:
                last = exc
            except UpstreamError as exc:
                exc.provider = u.name  # type: ignore[attr-defined]
                last = exc
                if not exc.retryable:
                    raise
        if last is None or isinstance(last, BreakerOpenError):
            retry_after = self.fast_fail_after(model)
            raise UpstreamUnavailable(retry_after if retry_after is not None else 1.0)
        raise last

    async def _guarded(self, u: Upstream, attempt: Callable[[Upstream, float], Awaitable[T]], timeout: float) -> T:
        started = self._clock()
        outcome = "error"
        try:
            if u.breaker is None:
                result = await attempt(u, timeout)
            else:
                async with u.breaker.guard():
                    result = await attempt(u, timeout)
            outcome = "success"
            return result
        except BreakerOpenError:
            outcome = "breaker_open"
            raise
        except UpstreamError as exc:
            outcome = retry_reason(exc) if exc.retryable else "client_error"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if self._metrics:
                self._metrics.upstream_calls.labels(u.name, outcome).inc()
                if outcome != "breaker_open":
                    self._metrics.upstream_latency.labels(u.name).observe(self._clock() - started)

    @asynccontextmanager
    async def _slot(self, u: Upstream, tokens: int, priority: int) -> AsyncIterator[None]:
        if u.limiter is not None:
            await u.limiter.acquire(tokens, priority)
        if u._slots is not None:
            await u._slots.acquire()
        u.in_flight += 1
        try:
            yield
        finally:
            u.in_flight -= 1
            if u._slots is not None:
                u._slots.release()

    async def stream_chat(self, model: str, body: dict[str, Any], *, deadline: float,
                          priority: int = 0, tokens: int = 0) -> tuple[AsyncIterator[bytes], str]:
        """Open a stream on the first healthy upstream that answers; failover happens before the first byte."""
        upstreams = self.for_model(model)
        if not upstreams:
            raise NotFound(f"The model '{model}' does not exist.", param="model", code="model_not_found")

        async def open_one() -> tuple[AsyncIterator[bytes], str]:
            return await self._failover(model, upstreams, _first_chunk_opener(body), deadline, priority, tokens,
                                        lambda u: _read_timeout(body, u.token_rate))

        return await call_with_retries(open_one, policy=self._retry, deadline=deadline, clock=self._clock,
                                       sleep=self._sleep)

    async def close(self) -> None:
        for u in self.upstreams:
            await u.provider.close()


def _first_chunk_opener(body: dict[str, Any]) -> Callable[[Upstream, float], Awaitable[AsyncIterator[bytes]]]:
    """An attempt that succeeds once the upstream sent its first chunk, returning the rest as an iterator."""

    async def attempt(u: Upstream, timeout: float) -> AsyncIterator[bytes]:
        stream = u.provider.stream_chat(body, timeout=timeout)
        first = await stream.__anext__()

        async def relay() -> AsyncIterator[bytes]:
            yield first
            async for chunk in stream:
                yield chunk

        return relay()

    return attempt


def read_budget(body: dict[str, Any]) -> int:
    return int(body.get("max_completion_tokens") or body.get("max_tokens") or 1024)


def _read_timeout(body: dict[str, Any], token_rate: float) -> float:
    """Read timeout = max_tokens / token rate + 5 s (the issue's default rule)."""
    return read_budget(body) / token_rate + 5.0
