"""The degradation policy: when to pause merging for a model, and when to refuse at once because no upstream is up.

Merging multiplies the cost of an upstream failure (one failed merged call fails every member), so it
pauses as soon as any provider of the model looks unwell, well before its breaker opens. Called per
request: it only reads breaker state, never waits.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence

from mergebroker.breaker.circuit import BreakerState, CircuitBreaker

WILDCARD = "*"
"""The routes key whose providers serve every model."""

MIN_RETRY_AFTER_S = 0.1

MergingCallback = Callable[[str, bool], None]
"""Told `(model, merging_allowed)` on every decision, e.g. to export the degraded state."""


def all_open_retry_after(breakers: Sequence[CircuitBreaker | None]) -> float | None:
    """The fast-fail rule: when every breaker is open, seconds until the first probe (at least 0.1), else None.

    None stands for an upstream without a breaker, which counts as healthy; an empty list is not "all open".
    """
    if not breakers:
        return None
    for b in breakers:  # a loop, not any(): this runs twice on every request
        if b is None or b.state is not BreakerState.OPEN:
            return None
    return max(MIN_RETRY_AFTER_S, min(b.seconds_until_probe() for b in breakers))  # type: ignore[union-attr]


class DegradationPolicy:
    """Reads the breakers of a model's providers to decide on merging and fast failure.

    `routes` maps a model to its provider names; providers under `"*"` serve every model, after the
    model's own. A provider without a breaker in `breakers` counts as healthy.
    """

    def __init__(self, routes: Mapping[str, Sequence[str]], breakers: Mapping[str, CircuitBreaker],
                 on_merging: MergingCallback | None = None) -> None:
        self._routes = {model: tuple(names) for model, names in routes.items()}
        self._breakers = dict(breakers)
        self._on_merging = on_merging

    def providers_for(self, model: str) -> list[str]:
        """The providers able to serve `model`: its own routes, then glob routes (`"*"`, `"gpt-*"`), without
        repeats. Globs match as the provider pools match them."""
        names = self._routes.get(model, ())
        for pattern, routed in self._routes.items():
            if pattern != model and fnmatch.fnmatchcase(model, pattern):
                names += routed
        return list(dict.fromkeys(names))

    def merging_allowed(self, model: str) -> bool:
        """False while any breaker of the model's providers is degraded, half-open or open."""
        allowed = not any(breaker.degraded for breaker in self._breakers_of(model))
        if self._on_merging is not None:
            self._on_merging(model, allowed)
        return allowed

    def fast_fail_retry_after(self, model: str) -> float | None:
        """When every provider of the model is open: seconds until the first probe (at least 0.1); else None."""
        names = self.providers_for(model)
        return all_open_retry_after([self._breakers.get(name) for name in names])

    def _breakers_of(self, model: str) -> list[CircuitBreaker]:
        return [self._breakers[name] for name in self.providers_for(model) if name in self._breakers]
