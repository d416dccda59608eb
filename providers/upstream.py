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

from mergebroker.breaker.circuit import BreakerState, CircuitBreaker
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
