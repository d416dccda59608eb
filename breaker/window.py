"""A time-based sliding window of call outcomes: how many calls, failures and slow calls in the last N seconds,
in all and per tenant (the caller each call was made for; see `breaker.blame`)."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from mergebroker.clock import Clock


class Outcome(enum.Enum):
    """How one upstream call ended, as far as a breaker cares."""

    SUCCESS = "success"
    FAILURE = "failure"
    SLOW = "slow"  # succeeded, but took longer than the slow-call threshold
    TIMEOUT = "timeout"  # counts as a failure and as slow

    @property
    def is_failure(self) -> bool:
        """True for outcomes that count towards the error ratio."""
        return self in (Outcome.FAILURE, Outcome.TIMEOUT)

    @property
    def is_slow(self) -> bool:
        """True for outcomes that count towards the slow-call ratio."""
        return self in (Outcome.SLOW, Outcome.TIMEOUT)


_WEIGHTS = {o: (int(o.is_failure), int(o.is_slow)) for o in Outcome}
"""Each outcome's count towards failures and towards slow calls."""


@dataclass(frozen=True)
class WindowStats:
    """Counts and ratios over the window; ratios are 0.0 when there were no calls."""

    calls: int
    failures: int
    slow: int
    error_ratio: float
    slow_ratio: float

    @staticmethod
    def of(calls: int, failures: int, slow: int) -> WindowStats:
        """Stats from counts; the ratios are 0.0 without calls."""
        if calls <= 0:
            return WindowStats(0, 0, 0, 0.0, 0.0)
        return WindowStats(calls, failures, slow, failures / calls, slow / calls)

    def __sub__(self, other: WindowStats) -> WindowStats:
        return WindowStats.of(self.calls - other.calls, self.failures - other.failures, self.slow - other.slow)


class SlidingWindow:
    """Outcomes recorded in the last `window_s` seconds of `clock`.

    Entries live in a deque in time order with running counts, so recording and reading are O(1)
    amortised: each entry is appended once and evicted once.
    """

    def __init__(self, window_s: float, clock: Clock) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self._window_s = window_s
        self._clock = clock
        self._entries: deque[tuple[float, Outcome, str | None]] = deque()
        self._failures = 0
        self._slow = 0
        self._tenants: dict[str | None, list[int]] = {}  # tenant -> [calls, failures, slow]

    def record(self, outcome: Outcome, tenant: str | None = None) -> None:
        """Add one call's outcome at the current time, made for `tenant` (None: unknown or shared)."""
        now = self._clock()
        entries = self._entries
        if entries and entries[0][0] <= now - self._window_s:
            self._evict(now)
        entries.append((now, outcome, tenant))
        if outcome is Outcome.SUCCESS:  # nearly every call: only its tenant's call count moves, if it has one
            counts = self._tenants.get(tenant)
            if counts is not None:
                counts[0] += 1
                return
        self._count(outcome, tenant, +1)

    def stats(self) -> WindowStats:
        """Counts and ratios of the outcomes recorded in the last `window_s` seconds."""
        self._evict(self._clock())
        return WindowStats.of(len(self._entries), self._failures, self._slow)

    def by_tenant(self) -> dict[str | None, WindowStats]:
        """The same, for each tenant with calls in the window."""
        self._evict(self._clock())
        return {tenant: WindowStats.of(*counts) for tenant, counts in self._tenants.items()}

    def reset(self) -> None:
        """Forget every recorded outcome."""
        self._entries.clear()
        self._failures = 0
        self._slow = 0
        self._tenants.clear()

    def spotless(self) -> bool:
        """True when no failure or slow call is counted: then no ratio is above zero (nothing to judge)."""
        return not self._failures and not self._slow

    def _count(self, outcome: Outcome, tenant: str | None, sign: int) -> None:
        # Per call, twice (recorded, then evicted): a success, nearly every call, only moves the call counts.
        counts = self._tenants.get(tenant)
        if counts is None:
            counts = self._tenants[tenant] = [0, 0, 0]
        counts[0] += sign
        if outcome is not Outcome.SUCCESS:
            failure, slow = _WEIGHTS[outcome]  # a dict lookup, not two enum properties
            self._failures += sign * failure
            self._slow += sign * slow
            counts[1] += sign * failure
            counts[2] += sign * slow
        if counts[0] == 0:
            del self._tenants[tenant]

    def _evict(self, now: float) -> None:
        horizon = now - self._window_s
        entries = self._entries
        while entries and entries[0][0] <= horizon:
            _, outcome, tenant = entries.popleft()
            self._count(outcome, tenant, -1)
