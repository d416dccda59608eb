"""Merge-quality guard: pause merging for a model whose merged calls keep needing fallbacks.

If more than `max_ratio` of the last `window` merged calls of a model needed a fallback (a member
re-sent alone), merging pauses for that model for `cooldown_s`, then resumes by itself.
Model names come from clients, so at most `max_models` models are tracked: the one least recently
recorded is forgotten first, and with too many cool-downs at once the one ending first ends now.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TypeVar

import structlog

from mergebroker.clock import Clock, monotonic

log = structlog.get_logger(__name__)
V = TypeVar("V")


@dataclass(frozen=True)
class GuardSettings:
    """When merging pauses for a model (fallback share over the last `window` merged calls), for how
    long, and how many models are remembered at most."""

    max_ratio: float = 0.10
    window: int = 20
    cooldown_s: float = 300.0
    max_models: int = 1000


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
        recent = self._recent.pop(model, None)  # re-inserted last: dicts keep insertion order, oldest first
        if recent is None:
            recent = collections.deque(maxlen=self._settings.window)
            _drop_oldest(self._recent, self._settings.max_models - 1)
        self._recent[model] = recent
        recent.append(needed_fallback)
        if len(recent) < self._settings.window:
            return
        ratio = sum(recent) / len(recent)
        if ratio > self._settings.max_ratio and model not in self._paused_until:
            _drop_oldest(self._paused_until, self._settings.max_models - 1)  # equal cool-downs: oldest ends first
            self._paused_until[model] = self._clock() + self._settings.cooldown_s
            recent.clear()
            log.warning("merge_guard_paused", model=model, fallback_ratio=round(ratio, 3),
                        cooldown_s=self._settings.cooldown_s)


def _drop_oldest(entries: dict[str, V], keep: int) -> None:
    """Remove the earliest-inserted entries of `entries` until at most `keep` are left."""
    while len(entries) > max(0, keep):
        del entries[next(iter(entries))]
