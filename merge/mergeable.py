"""Request -> mergeable unit: the one rule live requests and bulk lines are both judged by (pure).

What the cache, coalescing and the merge planner know a chat request by: its body as its tier reads it
(an omitted temperature taken as 0 where the tier says so), its merge scope (`merge.scope`: whose requests
may share a call or a cached answer), its fingerprint within that scope (identical requests), its merge
shape and compatibility key (which requests may share one call) and its output budget. Live requests
(`broker.engine.chat.service`) and bulk lines (`broker.bulk.items`) both ask a tier's `UnitRules`, so the
two cannot disagree on who merges with whom.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from mergebroker.merge.fingerprint import chat_fingerprint
from mergebroker.merge.shape import MergeShape, compatibility_key, merge_shape
from mergebroker.output_budget import token_budget

Scope = Literal["tenant", "user", "tier", "global"]
STREAM_FIELDS = ("stream", "stream_options")


@dataclass(frozen=True)
class MergeUnit:
    """A request as the planner sees it; `shape` and `merge_key` are None where it may not merge."""

    body: dict[str, Any]
    fingerprint: str
    shape: MergeShape | None
    merge_key: str | None
    max_tokens: int


@dataclass(frozen=True)
class UnitRules:
    """How one tier turns requests into mergeable units (its settings with `merge.*`'s)."""

    scope: Scope = "tenant"
    merging: bool = True  # merging is on, and the tier merges
    include_system: bool = True  # `system_prompts: exact`: only equal system prompts share a call
    omitted_temperature_is_zero: bool = False
    lowercase: bool = True
    collapse_whitespace: bool = True
    cache_version: str = "1"
    default_max_tokens: int = 256

    def read(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` as the tier reads it: an omitted temperature is 0 where the tier says so."""
        if self.omitted_temperature_is_zero and body.get("temperature") is None:
            return {**body, "temperature": 0}
        return body

    def scope_of(self, *, tenant: str, tier: str, user: str | None) -> str:
        """The merge scope of a request from `tenant`'s `user` in `tier`: requests (and cached answers) are
        shared only within one scope."""
        # Names are JSON-encoded: a tenant or user containing ':' must not spell another's scope.
        if self.scope == "global":
            return "global"
        if self.scope == "tier":
            return "tier:" + _json_name(tier)
        if self.scope == "user":
            return "user:" + json.dumps([tenant, user or ""])
        return "tenant:" + _json_name(tenant)

    def fingerprint(self, body: Mapping[str, Any], scope: str) -> str:
        """Equal for identical requests within `scope` (the cache and coalescing key)."""
        return scope + ":" + chat_fingerprint(body, lowercase=self.lowercase,
                                              collapse_whitespace=self.collapse_whitespace,
                                              cache_version=self.cache_version)

    def budget(self, body: Mapping[str, Any]) -> int:
        """The request's output budget: its own, else the broker's default (which sizes merged calls)."""
        return token_budget(body, self.default_max_tokens)

    def identity(self, body: Mapping[str, Any], scope: str, *, mergeable: bool = True,
                 stream: bool = False) -> tuple[MergeShape | None, str | None]:
        """Its merge shape and compatibility key, or (None, None) where it may not merge (`mergeable`: the
        caller's own say, e.g. an opt-out). A stream is judged as the same request without its delivery
        fields, and merges only with streams."""
        if not (mergeable and self.merging):
            return None, None
        shaped = {k: v for k, v in body.items() if k not in STREAM_FIELDS} if stream else body
        shape = merge_shape(shaped)
        if shape is None:
            return None, None
        key = compatibility_key(shaped, shape, scope_value=scope, include_system=self.include_system)
        return shape, key + ("|stream" if stream else "")

    def unit(self, body: dict[str, Any], *, tenant: str, tier: str, user: str | None,
             mergeable: bool = True) -> MergeUnit:
        """Everything at once (bulk lines are known in full; a live request asks for each part when due)."""
        body = self.read(body)
        scope = self.scope_of(tenant=tenant, tier=tier, user=user)
        shape, key = self.identity(body, scope, mergeable=mergeable)
        return MergeUnit(body, self.fingerprint(body, scope), shape, key, self.budget(body))


@lru_cache(maxsize=4096)
def _json_name(name: str) -> str:
    """`name` JSON-encoded for a scope (remembered: the same few tenants and tiers ask on every request)."""
    return json.dumps(name)
