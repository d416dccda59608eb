"""A tier's rules for turning chat requests into mergeable units (`merge.mergeable.UnitRules`), from settings.

The live path (`chat.service`) and bulk jobs (`broker.bulk.items`) both build them here, so a setting that
changes who merges with whom changes it for both.
"""

from __future__ import annotations

from mergebroker.broker.engine.ground.settings import Settings, TierSettings
from mergebroker.merge.mergeable import UnitRules


def unit_rules(settings: Settings, tier: TierSettings) -> UnitRules:
    """The unit rules of `tier` under `settings` (`merge.*` and the tier's own merge settings)."""
    merge = settings.merge
    return UnitRules(scope=merge.scope, merging=merge.enabled and tier.merge,
                     include_system=tier.system_prompts == "exact",
                     omitted_temperature_is_zero=tier.omitted_temperature_is_zero, lowercase=merge.lowercase,
                     collapse_whitespace=merge.collapse_whitespace, cache_version=merge.cache_version,
                     default_max_tokens=merge.default_max_tokens)
