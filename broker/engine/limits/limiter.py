"""The admission limiter seam (`Limiter`) and a fake of it for unit tests.

Real implementations: `broker.engine.limits.ratelimit.RateLimiter` (in-process buckets) and
`broker.engine.limits.redis_limiter.RedisRateLimiter` (buckets shared through Redis, falling back to in-process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mergebroker.broker.engine.limits.ratelimit import LimitSpec, Reservation
from mergebroker.errors import RateLimited


class Limiter(Protocol):
    """Admits a request against every per-minute limit that applies to it, all or nothing.

    Contract: `reserve(specs, tokens)` takes one request and `tokens` estimated tokens from the bucket of
    every spec, or from none, and returns the `Reservation` (its headers, and `settle(actual)` to return
    the surplus once the real usage is known); when any bucket lacks room it raises `RateLimited` with
    the seconds until it would have. It never waits for room.
    """

    async def reserve(self, specs: Sequence[LimitSpec], tokens: int) -> Reservation: ...


class FakeLimiter:
    """A `Limiter` for unit tests: admits everything (or raises `refuse` when set) and records what it saw.

    `reserved` holds `(specs, tokens)` per admitted request; `returned` the surplus each settled reservation
    gave back (negative: the excess it took; nothing when the estimate was exact).
    """

    def __init__(self, refuse: RateLimited | None = None) -> None:
        self.refuse = refuse
        self.reserved: list[tuple[list[LimitSpec], int]] = []
        self.returned: list[int] = []

    async def reserve(self, specs: Sequence[LimitSpec], tokens: int) -> Reservation:
        if self.refuse is not None:
            raise self.refuse
        self.reserved.append((list(specs), tokens))

        async def adjust(returned: int) -> None:
            self.returned.append(returned)

        return Reservation(tokens, {}, adjust)
