"""A time-based sliding window of call outcomes: how many calls, failures and slow calls in the last N seconds."""

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


@dataclass(frozen=True)
class WindowStats:
    """Counts and ratios over the window; ratios are 0.0 when there were no calls."""

    calls: int
    failures: int
    slow: int
    error_ratio: float
    slow_ratio: float


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
        self._entries: deque[tuple[float, Outcome]] = deque()
        self._failures = 0
        self._slow = 0

    def record(self, outcome: Outcome) -> None:
        """Add one call's outcome at the current time."""
        now = self._clock()
        self._evict(now)
        self._entries.append((now, outcome))
        self._failures += outcome.is_failure
        self._slow += outcome.is_slow

    def stats(self) -> WindowStats:
        """Counts and ratios of the outcomes recorded in the last `window_s` seconds."""
        self._evict(self._clock())
        calls = len(self._entries)
        if calls == 0:
            return WindowStats(0, 0, 0, 0.0, 0.0)
        return WindowStats(calls, self._failures, self._slow, self._failures / calls, self._slow / calls)

    def reset(self) -> None:
        """Forget every recorded outcome."""
        self._entries.clear()
        self._failures = 0
        self._slow = 0

    def _evict(self, now: float) -> None:
        horizon = now - self._window_s
        entries = self._entries
        while entries and entries[0][0] <= horizon:
            _, outcome = entries.popleft()
            self._failures -= outcome.is_failure
            self._slow -= outcome.is_slow
