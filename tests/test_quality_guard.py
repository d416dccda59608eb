"""Merging pauses for a model whose merged calls keep needing fallbacks, and resumes after the cool-down."""

from __future__ import annotations

from mergebroker.clock import FakeClock
from mergebroker.merge.quality_guard import GuardSettings, QualityGuard


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


def test_only_the_most_recently_recorded_models_are_remembered():
    guard = QualityGuard(GuardSettings(max_ratio=0.10, window=10, cooldown_s=300, max_models=2), clock=FakeClock())
    for _ in range(5):
        guard.record("kept", True)
    guard.record("forgotten", True)
    for _ in range(4):
        guard.record("kept", True)  # recorded again: "forgotten" is now the older one
    guard.record("newcomer", False)  # a third model: "forgotten" goes
    guard.record("kept", True)
    assert guard.allows("kept") is False  # 10 of 10 remembered across the other models' records
    for _ in range(9):
        guard.record("forgotten", True)
    assert guard.allows("forgotten") is True  # 9 of a new window of 10: its first fallback was forgotten


def test_with_too_many_cool_downs_the_one_ending_first_ends_now():
    clock = FakeClock()
    guard = QualityGuard(GuardSettings(max_ratio=0.10, window=2, cooldown_s=300, max_models=2), clock=clock)
    for model in ("a", "b", "c"):
        guard.record(model, True)
        guard.record(model, True)
        clock.advance(1)
    assert [guard.allows(m) for m in ("a", "b", "c")] == [True, False, False]
