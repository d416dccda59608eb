"""The simulated upstream's bill: the usage it reports for a chat call and what a provider would charge.

With `billing: "openai"` the simulator keeps OpenAI's automatic prompt cache
(`providers.simulator.prompt_cache`) and reports `usage.prompt_tokens_details.cached_tokens` and
`completion_tokens_details`, as OpenAI does; with `billing: "none"` (the default) usage is the three
plain counts and nothing is cached. Either way a running `Bill` counts the answered chat calls of the
OpenAI and Azure paths (batch lines included, at live prices) and their dollars at the configured
prices (USD per million tokens: fresh input, cached input, output), each call at the prices of its
time. Tokens are the simulator's own count (`providers.simulator.content`), not the broker's, and with
`token_scale` another tokenizer's (`rescaled`): 1.3 reports and bills 30% more tokens than o200k_base.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mergebroker.clock import Clock, monotonic
from mergebroker.providers.simulator.content import prompt_token_ids, prompt_tokens
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.prompt_cache import PromptCache

_KEY_HEADERS = ("Authorization", "api-key", "x-api-key")


def cost_usd(prompt_tokens: int, cached_tokens: int, completion_tokens: int, config: SimulatorConfig) -> float:
    """Dollars for one call: fresh prompt tokens, cached prompt tokens and completion tokens at their prices."""
    micro = ((prompt_tokens - cached_tokens) * config.price_input + cached_tokens * config.price_cached_input
             + completion_tokens * config.price_output)
    return micro / 1_000_000


def usage_body(prompt_tokens: int, cached_tokens: int, completion_tokens: int, *, details: bool) -> dict[str, Any]:
    """A chat completion's `usage`; with `details`, OpenAI's token details too (nothing but caching is simulated)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens, "audio_tokens": 0}
        usage["completion_tokens_details"] = {"reasoning_tokens": 0, "audio_tokens": 0,
                                              "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    return usage


def cache_scope(headers: Mapping[str, str], config: SimulatorConfig) -> str:
    """Whose cache a call reads: its API key's (the header as sent), or everyone's with `cache_scope: "global"`."""
    if config.cache_scope == "global":
        return ""
    return next((headers[name] for name in _KEY_HEADERS if headers.get(name)), "")


@dataclass
class Bill:
    """Answered chat calls and their tokens and dollars, since start or the last reset."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    usd: float = 0.0

    def add(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, config: SimulatorConfig) -> None:
        """Count one answered call, priced now."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.completion_tokens += completion_tokens
        self.usd += cost_usd(prompt_tokens, cached_tokens, completion_tokens, config)


def rescaled(ids: array, scale: float) -> array:
    """`ids` as a tokenizer that counts `scale` times as many tokens would cut them: the first n tokens
    become floor(n * scale), each repeated or dropped by its position, so a prompt's prefix stays the
    prefix of its rescaled prompt (the prompt cache still sees shared prefixes)."""
    if scale == 1:
        return ids
    out = array("I")
    for position, token in enumerate(ids):
        out.extend([token] * (math.floor((position + 1) * scale) - math.floor(position * scale)))
    return out


def rescaled_count(tokens: int, scale: float) -> int:
    """A count of o200k_base tokens in a tokenizer that counts `scale` times as many (as `rescaled`)."""
    return math.floor(tokens * scale)


class Biller:
    """One simulator's prompt cache and running bill."""

    def __init__(self, clock: Clock = monotonic) -> None:
        self._cache = PromptCache(clock)
        self._bill = Bill()

    def charge(self, messages: Sequence[Mapping[str, Any]], completion_tokens: int, headers: Mapping[str, str],
               config: SimulatorConfig) -> dict[str, Any]:
        """Bill an answered chat call (reading and writing the prompt cache in "openai" mode); its `usage`."""
        caching, scale = config.billing == "openai", config.token_scale
        completion_tokens = rescaled_count(completion_tokens, scale)
        if caching:
            ids = rescaled(prompt_token_ids(messages), scale)
            prompt, cached = len(ids), self._cache.use(cache_scope(headers, config), ids, config.cache_ttl_s)
        else:
            prompt, cached = rescaled_count(prompt_tokens(messages), scale), 0
        self._bill.add(prompt, cached, completion_tokens, config)
        return usage_body(prompt, cached, completion_tokens, details=caching)

    def as_dict(self, config: SimulatorConfig) -> dict[str, Any]:
        """The bill, JSON-ready, with the mode and the prices now configured."""
        prices = {"input": config.price_input, "cached_input": config.price_cached_input,
                  "output": config.price_output}
        return {**asdict(self._bill), "billing": config.billing, "prices_usd_per_million": prices,
                "cached_prefixes": len(self._cache)}

    def reset(self, *, keep_cache: bool = False) -> None:
        """Zero the bill and, unless `keep_cache`, forget every cached prefix (a fresh start for a benchmark arm)."""
        self._bill = Bill()
        if not keep_cache:
            self._cache.clear()
