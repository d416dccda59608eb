"""Blame: when a provider's calls fail, whether the provider is sick or one tenant's requests are.

The rule. Each call is recorded with the tenant it was made for. When the window's error or slow
ratio is over its threshold (`trip_reason`), the tenant with the most failed and slow calls is set
aside, and the ratios are judged again over everyone else's calls:
- still over the threshold (with at least half of `min_calls` such calls): the failures are spread,
  the provider is sick, and the breaker opens for everyone;
- otherwise the failures are that one tenant's: only its calls are refused for the open time (it gets
  its own 503s), and the provider keeps serving the others.
With only one tenant in the window there is no one else to protect and the breaker opens as before.
Calls made for several tenants at once (a merged call across tenants) or for an unknown one are
recorded for no tenant (None); when they are the worst, there is no one to set aside and the breaker
opens as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from mergebroker.breaker.window import WindowStats

Tripper = Callable[[WindowStats, Any], "dict[str, Any] | None"]


@dataclass(frozen=True)
class Verdict:
    """What a window calls for: open the breaker (`reason`), set one tenant aside (`isolate`), or nothing."""

    reason: dict[str, Any] | None = None
    isolate: str | None = None


def judge(overall: WindowStats, by_tenant: Mapping[str | None, WindowStats], settings: Any,
          trip_reason: Tripper) -> Verdict:
    """Apply the blame rule (module docstring) to a window; `trip_reason` decides "over the threshold"."""
    reason = trip_reason(overall, settings)
    if reason is None:
        return Verdict()
    if len(by_tenant) < 2:
        return Verdict(reason=reason)
    worst = max(by_tenant, key=lambda t: (by_tenant[t].failures + by_tenant[t].slow, by_tenant[t].calls))
    if worst is None:
        return Verdict(reason=reason)  # calls for no one tenant: nobody to set aside
    rest = overall - by_tenant[worst]
    rest_settings = replace(settings, min_calls=max(1, math.ceil(settings.min_calls / 2)))
    spread = trip_reason(rest, rest_settings)
    if spread is not None:
        return Verdict(reason={**reason, "blame": "spread"})
    return Verdict(isolate=worst)
