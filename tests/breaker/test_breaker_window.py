"""The sliding window counts calls, failures and slow calls over the last window_s seconds only."""

from __future__ import annotations

import pytest

from mergebroker.breaker.window import Outcome, SlidingWindow
from mergebroker.clock import FakeClock


def test_empty_window_reports_zero_ratios(fake_clock: FakeClock) -> None:
    stats = SlidingWindow(30, fake_clock).stats()
    assert (stats.calls, stats.failures, stats.slow, stats.error_ratio, stats.slow_ratio) == (0, 0, 0, 0.0, 0.0)


def test_ratios_count_timeouts_as_both_failed_and_slow(fake_clock: FakeClock) -> None:
    window = SlidingWindow(30, fake_clock)
    for outcome in [Outcome.SUCCESS] * 5 + [Outcome.FAILURE, Outcome.SLOW, Outcome.TIMEOUT] + [Outcome.SUCCESS] * 2:
        window.record(outcome)
    stats = window.stats()
    assert (stats.calls, stats.failures, stats.slow) == (10, 2, 2)
    assert stats.error_ratio == pytest.approx(0.2)
    assert stats.slow_ratio == pytest.approx(0.2)


def test_outcomes_older_than_the_window_are_dropped(fake_clock: FakeClock) -> None:
    window = SlidingWindow(30, fake_clock)
    window.record(Outcome.FAILURE)
    window.record(Outcome.TIMEOUT)
    fake_clock.advance(20)
    window.record(Outcome.SUCCESS)
    assert window.stats().calls == 3
    fake_clock.advance(10)  # the first two are now exactly window_s old
    stats = window.stats()
    assert (stats.calls, stats.failures, stats.slow, stats.error_ratio) == (1, 0, 0, 0.0)
    fake_clock.advance(20)
    assert window.stats().calls == 0


def test_reset_forgets_every_outcome(fake_clock: FakeClock) -> None:
    window = SlidingWindow(30, fake_clock)
    window.record(Outcome.FAILURE)
    window.reset()
    window.record(Outcome.SUCCESS)
    stats = window.stats()
    assert (stats.calls, stats.failures, stats.error_ratio) == (1, 0, 0.0)


def test_non_positive_window_is_rejected(fake_clock: FakeClock) -> None:
    with pytest.raises(ValueError):
        SlidingWindow(0, fake_clock)
