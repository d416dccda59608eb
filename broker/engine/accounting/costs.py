"""Dollars per request: what it cost, and what it would have cost sent alone with the provider's prompt cache.

The actual bill prices the usage the provider reported (its cached and cache-written parts included; a
merged member's share as apportioned). The counterfactual ("alone") prices the request as if it had been
sent by itself, in arrival order, to a provider that caches prompt prefixes: `observe_alone` runs each
request's prompt through a model of that cache (`merge.prompt_cache.PrefixCache`, one per cache style and
provider) when it arrives, and `account` scales the broker's own token counts into the provider's with
a per provider-and-model `Calibration` (`merge.calibration`) learnt from every call: a lone call's
record, and each merged call as dispatch reports it (`observe_call`: what the broker sent against what
the provider counted). A request sent alone costs the same both ways. Alone bills priced before the
calibration had a sample for their provider and model are counted as uncalibrated, and the stats say so.

A model with no price gets no dollars (None) and is counted as unpriced.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.tokens import prompt_token_bound, prompt_token_ids
from mergebroker.clock import Clock, monotonic
from mergebroker.merge.calibration import Calibration, CallTokens
from mergebroker.merge.pricing import CacheStyle, ModelPrice, PriceTable, cost_usd
from mergebroker.merge.prompt_cache import CacheKey, PrefixCache, ProviderCacheModel


class PricedRequest(Protocol):
    """What pricing reads of a request's record (`request_record.RequestInfo` is one)."""

    tier: str
    model: str | None
    provider: str | None
    cache: str | None
    batch_size: int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    alone_prompt_tokens: int
    alone_cached_tokens: int
    answer_tokens: int


@dataclass
class CostTotals:
    """Dollars since start: in all, and per tier and per model, as [actual, alone]."""

    actual_usd: float = 0.0
    alone_usd: float = 0.0
    unpriced_requests: int = 0
    uncalibrated_requests: int = 0  # alone bills priced before the provider's token counts were learnt
    by_tier: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0.0]))
    by_model: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0.0]))

    def add(self, tier: str, model: str, actual: float, alone: float) -> None:
        self.actual_usd += actual
        self.alone_usd += alone
        by_tier, by_model = self.by_tier[tier], self.by_model[model]  # every priced request adds: no loop
        by_tier[0] += actual
        by_tier[1] += alone
        by_model[0] += actual
        by_model[1] += alone

    def as_dict(self) -> dict[str, Any]:
        """The `cost` object of `/v1/broker/stats`."""
        def money(actual: float, alone: float) -> dict[str, float]:
            return {"actual_usd": round(actual, 6), "alone_usd": round(alone, 6), "saved_usd": round(alone - actual, 6)}

        return {**money(self.actual_usd, self.alone_usd), "unpriced_requests": self.unpriced_requests,
                "uncalibrated_requests": self.uncalibrated_requests, "calibrated": not self.uncalibrated_requests,
                "tiers": {t: money(*v) for t, v in sorted(self.by_tier.items())},
                "models": {m: money(*v) for m, v in sorted(self.by_model.items())}}


class CostBook:
    """Prices requests (see the module docstring); one per broker, used from the event loop only."""

    def __init__(self, prices: PriceTable, *, metrics: Metrics | None = None, clock: Clock = monotonic,
                 max_prefixes: int = 100_000) -> None:
        self.prices = prices
        self.totals = CostTotals()
        self.calibration = Calibration()
        self._metrics = metrics
        self._caches = {style: PrefixCache(ProviderCacheModel.for_style(style), max_entries=max_prefixes, clock=clock)
                        for style in (CacheStyle.OPENAI, CacheStyle.ANTHROPIC)}

    def price(self, model: str | None) -> ModelPrice | None:
        return self.prices.get(model) if model else None

    def observe_alone(self, provider: str, model: str, messages: Sequence[Mapping[str, Any]]) -> int:
        """The prompt tokens (broker's count) this request would read from `provider`'s cache were it sent
        alone now; remembers its prompt for the requests after it. 0 for an unpriced or uncached model."""
        price = self.price(model)
        if price is None or price.cache not in self._caches:
            return 0
        cache = self._caches[price.cache]
        if prompt_token_bound(messages) < cache.min_tokens:
            return 0  # too short for any cached prefix: nothing to read or remember, so nothing to tokenize
        breakpoints: tuple[int, ...] = ()
        tokens = prompt_token_ids(messages)
        if price.cache is CacheStyle.ANTHROPIC:  # the broker puts a breakpoint after the system prompt
            system = [m for m in messages if m.get("role") == "system"]
            breakpoints = (len(prompt_token_ids(system)),) if system else ()
        return cache.observe(CacheKey(provider, model), tokens, breakpoints)

    def observe_call(self, provider: str, model: str, tokens: CallTokens) -> None:
        """A call the broker sent (merged, typically: lone calls are learnt from their records) answered
        with the provider's counts: learn how they compare with the broker's."""
        self.calibration.observe_call(provider, model, tokens)

    def stats(self) -> dict[str, Any]:
        """The `cost` object of `/v1/broker/stats`: the totals and the token calibration behind them."""
        return {**self.totals.as_dict(), "calibration": self.calibration.as_dict()}

    def account(self, info: PricedRequest, status: int) -> tuple[float | None, float | None]:
        """(actual, alone) dollars of an answered request, counted in the totals and metrics."""
        price = self.price(info.model)
        if price is None:
            self.totals.unpriced_requests += 1
            return None, None
        actual = self._actual(price, info)
        alone = actual if status >= 400 else self._alone(price, info, actual)
        self.totals.add(info.tier, info.model or "", actual, alone)
        if self._metrics is not None:
            self._metrics.cost(info.tier, info.model or "", actual, alone)
        return actual, alone

    @staticmethod
    def _actual(price: ModelPrice, info: PricedRequest) -> float:
        if info.cache in ("hit", "coalesced"):
            return 0.0
        cached = min(info.cached_tokens, info.prompt_tokens)
        written = min(info.cache_write_tokens, info.prompt_tokens - cached)
        return cost_usd(price, info.prompt_tokens, cached, written, info.completion_tokens)

    def _alone(self, price: ModelPrice, info: PricedRequest, actual: float) -> float:
        provider, model = info.provider or "", info.model or ""
        reused = info.cache in ("hit", "coalesced")
        calibration = self.calibration
        if not reused and (info.batch_size or 1) <= 1:  # it was sent alone: that is its alone bill
            calibration.update(provider, model, info.prompt_tokens, info.alone_prompt_tokens, "prompt")
            calibration.update(provider, model, info.completion_tokens, info.answer_tokens, "completion")
            return actual
        if not calibration.samples(provider, model, "prompt"):
            self.totals.uncalibrated_requests += 1
        prompt = calibration.scale(provider, model, info.alone_prompt_tokens, "prompt")
        cached = min(prompt, calibration.scale(provider, model, info.alone_cached_tokens, "prompt"))
        if info.answer_tokens:
            completion = calibration.scale(provider, model, info.answer_tokens, "completion")
        else:
            completion = info.completion_tokens
        return cost_usd(price, prompt, cached, 0, completion)
