"""Merging pauses for a model whose merged calls keep needing fallbacks, and resumes after the cool-down."""

from __future__ import annotations

from broker.clock import FakeClock
from merge.quality_guard import GuardSettings, QualityGuard


def test_pauses_above_the_fallback_share_and_resumes_after_cooldown():
    clock = FakeClock()
    guard = QualityGuard(GuardSettings(max_ratio=0.10, window=10, cooldown_s=300), clock=clock)
    for needed in [True, True] + [False] * 8:
        guard.record("m", needed)
    assert guard.allows("m") is False
    assert guard.allows("other") is True
    clock.advance(299)
    assert guard.allows("m") is False
    clock.advance(2)
    assert guard.allows("m") is True


def test_a_share_at_the_limit_or_too_few_calls_do_not_pause():
    guard = QualityGuard(GuardSettings(max_ratio=0.10, window=10, cooldown_s=300), clock=FakeClock())
    for needed in [True] * 5:
        guard.record("few", needed)
    assert guard.allows("few") is True
    for needed in [True] + [False] * 9:
        guard.record("edge", needed)
    assert guard.allows("edge") is True
