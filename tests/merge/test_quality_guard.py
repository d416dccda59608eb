"""Merging pauses for a tenant and model whose merged calls keep needing fallbacks or lose fidelity, and resumes
after the cool-down; other tenants keep merging."""

from __future__ import annotations

from mergebroker.clock import FakeClock
from mergebroker.merge.quality_guard import GuardSettings, QualityGuard


def test_pauses_above_the_fallback_share_and_resumes_after_cooldown():
    clock = FakeClock()
    guard = QualityGuard(GuardSettings(max_ratio=0.10, window=10, cooldown_s=300), clock=clock)
    for needed in [True, True] + [False] * 8:
        guard.record("t", "m", needed)
    assert guard.allows("t", "m") is False
    assert guard.allows("t", "other") is True
    clock.advance(299)
    assert guard.allows("t", "m") is False
    clock.advance(2)
    assert guard.allows("t", "m") is True


def test_a_share_at_the_limit_or_too_few_calls_do_not_pause():
    guard = QualityGuard(GuardSettings(max_ratio=0.10, window=10, cooldown_s=300), clock=FakeClock())
    for needed in [True] * 5:
        guard.record("t", "few", needed)
    assert guard.allows("t", "few") is True
    for needed in [True] + [False] * 9:
        guard.record("t", "edge", needed)
    assert guard.allows("t", "edge") is True


def test_only_the_most_recently_recorded_models_are_remembered():
    guard = QualityGuard(GuardSettings(max_ratio=0.10, window=10, cooldown_s=300, max_models=2), clock=FakeClock())
    for _ in range(5):
        guard.record("t", "kept", True)
    guard.record("t", "forgotten", True)
    for _ in range(4):
        guard.record("t", "kept", True)  # recorded again: "forgotten" is now the older one
    guard.record("t", "newcomer", False)  # a third model: "forgotten" goes
    guard.record("t", "kept", True)
    assert guard.allows("t", "kept") is False  # 10 of 10 remembered across the other models' records
    for _ in range(9):
        guard.record("t", "forgotten", True)
    assert guard.allows("t", "forgotten") is True  # 9 of a new window of 10: its first fallback was forgotten


def test_with_too_many_cool_downs_the_one_ending_first_ends_now():
    clock = FakeClock()
    guard = QualityGuard(GuardSettings(max_ratio=0.10, window=2, cooldown_s=300, max_models=2), clock=clock)
    for model in ("a", "b", "c"):
        guard.record("t", model, True)
        guard.record("t", model, True)
        clock.advance(1)
    assert [guard.allows("t", m) for m in ("a", "b", "c")] == [True, False, False]


def test_a_tenant_whose_merges_fail_pauses_only_its_own_merging():
    guard = QualityGuard(GuardSettings(max_ratio=0.10, window=4, cooldown_s=300), clock=FakeClock())
    for _ in range(4):
        guard.record("noisy", "m", True)
        guard.record("quiet", "m", False)
    assert guard.allows("noisy", "m") is False
    assert guard.allows("quiet", "m") is True
    assert guard.allows("noisy", "other-model") is True


def test_low_shadow_fidelity_pauses_the_tenant_and_model_until_the_cool_down_ends():
    clock = FakeClock()
    pauses: list[tuple[str, str, str]] = []
    guard = QualityGuard(GuardSettings(cooldown_s=60, min_fidelity=0.9, fidelity_window=4), clock=clock,
                         on_pause=lambda *why: pauses.append(why))
    for score in (1.0, 1.0, 1.0, 0.7):  # mean 0.925: still fine
        guard.record_fidelity("t", "m", score)
    assert guard.allows("t", "m") is True
    guard.record_fidelity("t", "m", 0.5)  # last four: 1, 1, 0.7, 0.5 -> mean 0.8
    assert guard.allows("t", "m") is False
    assert pauses == [("t", "m", "fidelity")]
    assert guard.allows("u", "m") is True
    clock.advance(61)
    assert guard.allows("t", "m") is True


def test_fidelity_is_ignored_when_no_minimum_is_set():
    guard = QualityGuard(GuardSettings(min_fidelity=0.0, fidelity_window=2), clock=FakeClock())
    for _ in range(5):
        guard.record_fidelity("t", "m", 0.0)
    assert guard.allows("t", "m") is True
