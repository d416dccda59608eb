"""Merge-quality guard: pause merging for a model whose merged calls keep needing fallbacks.

If more than `max_ratio` of the last `window` merged calls of a model needed a fallback (a member
re-sent alone), merging pauses for that model for `cooldown_s`, then resumes by itself.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import structlog

from broker.clock import Clock, monotonic

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GuardSettings:
    max_ratio: float = 0.10
    window: int = 20
    cooldown_s: float = 300.0


class QualityGuard:
    """Tracks the recent fallback share per model and decides whether merging is paused."""

    def __init__(self, settings: GuardSettings, *, clock: Clock = monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._recent: dict[str, collections.deque[bool]] = {}
        self._paused_until: dict[str, float] = {}

    def allows(self, model: str) -> bool:
        """False while the model's cool-down lasts."""
        until = self._paused_until.get(model)
        if until is None:
            return True
        if self._clock() >= until:
            del self._paused_until[model]
            log.info("merge_guard_resumed", model=model)
            return True
        return False

    def record(self, model: str, needed_fallback: bool) -> None:
        """Record one merged call's outcome; may start a cool-down."""
        recent = self._recent.setdefault(model, collections.deque(maxlen=self._settings.window))
        recent.append(needed_fallback)
        if len(recent) < self._settings.window:
            return
        ratio = sum(recent) / len(recent)
        if ratio > self._settings.max_ratio and model not in self._paused_until:
            self._paused_until[model] = self._clock() + self._settings.cooldown_s
            recent.clear()
            log.warning("merge_guard_paused", model=model, fallback_ratio=round(ratio, 3),
                        cooldown_s=self._settings.cooldown_s)
