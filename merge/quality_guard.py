"""Merge-quality guard: pause merging for a tenant and model whose merged answers look worse than alone.

Two signals pause merging for one (tenant, model) for `cooldown_s`, then it resumes by itself:
- format: more than `max_ratio` of its last `window` merged calls needed a fallback (a member re-sent alone);
- fidelity: the mean of its last `fidelity_window` shadow comparisons (merged answer vs the same request
  sent alone, 0..1, see `merge.fidelity`) fell below `min_fidelity`.

Keys are per tenant, so one tenant whose requests merge badly (or who sends text that makes merged replies
fail) never stops merging for the others. Tenants and model names come from clients, so at most
`max_models` keys are tracked: the one least recently recorded is forgotten first, and with too many
cool-downs at once the one ending first ends now.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from mergebroker.clock import Clock, monotonic

log = structlog.get_logger(__name__)
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
GuardKey = tuple[str, str]
"""(tenant, model)."""
PauseListener = Callable[[str, str, str], None]
"""Called with (tenant, model, reason: "fallbacks" or "fidelity") when a cool-down starts."""


@dataclass(frozen=True)
class GuardSettings:
    """When merging pauses for a tenant and model, for how long, and how many keys are remembered at most.

    `window`/`max_ratio` judge the fallback share of merged calls; `fidelity_window`/`min_fidelity` judge
    the mean shadow fidelity (0 disables that signal).
    """

    max_ratio: float = 0.10
    window: int = 20
    cooldown_s: float = 300.0
    max_models: int = 1000
    min_fidelity: float = 0.0
    fidelity_window: int = 20


class _Recent:
    """The last outcomes per key, at most `max_keys` keys (least recently recorded forgotten first)."""

    def __init__(self, size: int, max_keys: int) -> None:
        self._size = size
        self._max_keys = max_keys
        self._by_key: dict[GuardKey, collections.deque[float]] = {}

    def add(self, key: GuardKey, value: float) -> collections.deque[float]:
        recent = self._by_key.pop(key, None)  # re-inserted last: dicts keep insertion order, oldest first
        if recent is None:
            recent = collections.deque(maxlen=self._size)
            _drop_oldest(self._by_key, self._max_keys - 1)
        self._by_key[key] = recent
        recent.append(value)
        return recent


class QualityGuard:
    """Tracks recent merge outcomes per (tenant, model) and decides whether merging is paused."""

    def __init__(self, settings: GuardSettings, *, clock: Clock = monotonic,
                 on_pause: PauseListener | None = None) -> None:
        self._settings = settings
        self._clock = clock
        self._on_pause = on_pause
        self._fallbacks = _Recent(settings.window, settings.max_models)
        self._fidelity = _Recent(settings.fidelity_window, settings.max_models)
        self._paused_until: dict[GuardKey, float] = {}

    def allows(self, tenant: str, model: str) -> bool:
        """False while the cool-down of this tenant's merging on this model lasts."""
        key = (tenant, model)
        until = self._paused_until.get(key)
        if until is None:
            return True
        if self._clock() >= until:
            del self._paused_until[key]
            log.info("merge_guard_resumed", tenant=tenant, model=model)
            return True
        return False

    def record(self, tenant: str, model: str, needed_fallback: bool) -> None:
        """Record one merged call's outcome for a tenant with members in it; may start a cool-down."""
        recent = self._fallbacks.add((tenant, model), float(needed_fallback))
        if len(recent) == self._settings.window:
            ratio = sum(recent) / len(recent)
            if ratio > self._settings.max_ratio:
                self._pause((tenant, model), recent, reason="fallbacks", fallback_ratio=round(ratio, 3))

    def record_fidelity(self, tenant: str, model: str, fidelity: float) -> None:
        """Record one shadow comparison (0..1); may start a cool-down when the recent mean is too low."""
        if self._settings.min_fidelity <= 0:
            return
        recent = self._fidelity.add((tenant, model), fidelity)
        if len(recent) == self._settings.fidelity_window:
            mean = sum(recent) / len(recent)
            if mean < self._settings.min_fidelity:
                self._pause((tenant, model), recent, reason="fidelity", fidelity=round(mean, 3))

    def _pause(self, key: GuardKey, recent: collections.deque[float], *, reason: str, **why: object) -> None:
        if key in self._paused_until:
            return
        _drop_oldest(self._paused_until, self._settings.max_models - 1)  # equal cool-downs: oldest ends first
        self._paused_until[key] = self._clock() + self._settings.cooldown_s
        recent.clear()
        log.warning("merge_guard_paused", tenant=key[0], model=key[1], reason=reason,
                    cooldown_s=self._settings.cooldown_s, **why)
        if self._on_pause is not None:
            self._on_pause(key[0], key[1], reason)


def _drop_oldest(entries: dict[K, V], keep: int) -> None:
    """Remove the earliest-inserted entries of `entries` until at most `keep` are left."""
    while len(entries) > max(0, keep):
        del entries[next(iter(entries))]
