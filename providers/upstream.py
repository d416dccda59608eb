"""One upstream as the pools see it, the observer the pools report to, and the routing order of an attempt.

`Upstream` holds a provider with its own breaker, rate limiter and concurrency cap; `order_upstreams`
decides which of a model's upstreams an attempt tries first (pure apart from the round-robin weights it
advances); `PoolObserver` is how the pools report retries and call outcomes without knowing metric names.
"""

from __future__ import annotations

import asyncio
import fnmatch
from dataclasses import dataclass, field
from typing import Literal, Protocol

from mergebroker.breaker.circuit import BreakerOpenError, BreakerState, CircuitBreaker
from mergebroker.clock import Clock
from mergebroker.errors import DeadlineExceeded, UpstreamHTTPError
from mergebroker.providers.base import Provider
from mergebroker.providers.pacing import UpstreamLimiter

Strategy = Literal["least_in_flight", "round_robin"]


class PoolObserver(Protocol):
    """What the pools report as they work (the service exports it as metrics; the pools know no metric names)."""

    def retried(self, provider: str, reason: str) -> None:
        """A call on `provider` (or "pool") failed with `reason` and will be retried."""

    def called(self, provider: str, outcome: str, latency_s: float | None) -> None:
        """One call on `provider` ended with `outcome`; `latency_s` is None when the breaker refused it."""


class NullObserver:
    """A PoolObserver that records nothing."""

    def retried(self, provider: str, reason: str) -> None:
        return None

    def called(self, provider: str, outcome: str, latency_s: float | None) -> None:
        return None


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
    streams_merged: bool = False  # merged calls may be requested as streams (early release)
    in_flight: int = 0
    _current_weight: int = 0
    _slots: asyncio.Semaphore | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_in_flight is not None:
            self._slots = asyncio.Semaphore(self.max_in_flight)

    @property
    def waits_for_room(self) -> bool:
        """Whether `acquire` may wait (a declared rate or a concurrency cap): without either, it takes its
        slot at once, and nothing can change between a breaker check before it and one after."""
        return self.limiter is not None or self._slots is not None

    @property
    def limits_tokens(self) -> bool:
        """Whether `acquire` takes the tokens it is given from a declared token rate (else it ignores them)."""
        return self.limiter is not None and self.limiter.limits_tokens

    async def acquire(self, tokens: int, priority: float, deadline: float, clock: Clock) -> int:
        """Take this upstream's rate budget and a concurrency slot, waiting at most until `deadline`; the tokens
        taken from its budget (the estimate, capped at one bucket). `release` gives the slot back."""
        if not self.waits_for_room:
            self.in_flight += 1  # nothing to wait for: skip the timeout machinery on the hot path
            return 0
        taken: int | None = None
        try:
            async with clock.timeout_at(deadline):
                if self.limiter is not None:
                    taken = await self.limiter.acquire(tokens, priority)
                if self._slots is not None:
                    await self._slots.acquire()
        except BaseException as exc:
            if taken is not None and self.limiter is not None:
                self.limiter.refund(taken)
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded("The request's deadline passed while waiting for an upstream slot.") from None
            raise
        self.in_flight += 1
        return taken or 0

    def release(self) -> None:
        """A call `acquire` admitted has ended (for a stream: its last chunk)."""
        self.in_flight -= 1
        if self._slots is not None:
            self._slots.release()

    def give_back_unspent(self, exc: BaseException, sent: bool, taken: int) -> None:
        """Return the budget of a failed call that cost the upstream nothing.

        A call never sent (deadline passed in the wait, breaker refused after it) returns its request
        and tokens; one the upstream refused as the caller's fault returns its tokens (nothing was
        generated). Any other failure keeps the estimate: the upstream may have spent it.
        """
        if self.limiter is None:
            return
        if not sent or isinstance(exc, BreakerOpenError):  # the breaker refuses before anything is sent
            self.limiter.refund(taken)
        elif isinstance(exc, UpstreamHTTPError) and exc.caller_fault:
            self.limiter.give_back(taken)

    @property
    def name(self) -> str:
        """The provider's name (metric label, breaker key)."""
        return self.provider.name

    def serves(self, model: str) -> bool:
        """True when one of `models` (glob patterns) matches `model`."""
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    def is_open(self) -> bool:
        """True while the breaker refuses every call (an elapsed open time turns it half-open here)."""
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
