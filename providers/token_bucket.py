"""A token bucket read against an injected clock: the one primitive behind admission limits and provider pacing."""

from __future__ import annotations

import math

from mergebroker.clock import Clock

EPSILON = 1e-9
"""Tokens treated as "enough": refilling in steps leaves float dust such as 0.9999999999999, and a caller
that waited exactly the advertised time must not be refused for it."""


class TokenBucket:
    """A bucket of `capacity` tokens refilling `refill_per_s`, read against an injected clock.

    `take` may drive the level below zero (debt): usage that already happened is recorded, and the
    bucket refuses until it has refilled past it.
    """

    def __init__(self, capacity: float, refill_per_s: float, clock: Clock, *, level: float | None = None) -> None:
        if capacity <= 0 or refill_per_s <= 0:
            raise ValueError("capacity and refill_per_s must be positive")
        self.capacity = float(capacity)
        self.refill_per_s = float(refill_per_s)
        self._clock = clock
        self._level = self.capacity if level is None else min(float(level), self.capacity)
        self._stamp = clock()

    def _refill(self) -> None:
        now = self._clock()
        if now > self._stamp:
            level = self._level + (now - self._stamp) * self.refill_per_s
            self._level = level if level < self.capacity else self.capacity  # not min(): every read refills
            self._stamp = now

    def available(self) -> float:
        """Tokens in the bucket now (negative while in debt)."""
        self._refill()
        return self._level

    def try_take(self, amount: float) -> bool:
        """Take `amount` if the bucket holds it; otherwise take nothing and return False."""
        self._refill()
        if self._level + EPSILON < amount:
            return False
        self._level -= amount
        return True

    def take(self, amount: float) -> None:
        """Take `amount` unconditionally, going into debt if need be (for usage already spent)."""
        self._refill()
        self._level -= amount

    def give_back(self, amount: float) -> None:
        """Return `amount` tokens, never filling above capacity."""
        self._refill()
        self._level = min(self.capacity, self._level + amount)

    def seconds_until(self, amount: float) -> float:
        """Seconds until `amount` can be taken: 0 if now, `inf` if it exceeds the capacity."""
        self._refill()
        if self._level + EPSILON >= amount:
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self._level) / self.refill_per_s
