"""The price table mergebroker ships with: list prices of common OpenAI, Azure OpenAI and Anthropic models.

Source: the providers' public pricing and model pages (openai.com/api/pricing and platform.openai.com/docs/models;
anthropic.com/pricing and docs.anthropic.com's models overview; Azure OpenAI's pricing page), as they stood on
2025-10-20. These are list prices as known at that date, not fetched at run time: providers change them,
negotiated and batch prices differ, and operators override any entry in config (`PriceTable.build`).

Every entry is in the config shape `PriceTable` validates: USD per million tokens (`input`, `cached_input`,
`output`, Anthropic's `cache_write`), `context_window` and `max_output_tokens` in tokens, and the
provider's `cache` style ("openai": automatic prefix cache; "anthropic": explicit breakpoints).

Azure: global-standard deployments of these models are billed at OpenAI's list prices (data-zone and regional
deployments cost about 10% more), and the `azure/` prefix is stripped on lookup. An Azure deployment is
named by its operator, so a deployment called anything but the model's own name is mapped to one of these
names with `PriceTable(aliases=...)` or priced in config.

Names are the undated aliases; a dated snapshot (`gpt-4o-2024-08-06`, `claude-sonnet-4-20250514`) finds
its alias on lookup, which assumes the snapshot is priced like the alias. That does not hold for every
old snapshot (`gpt-4o-2024-05-13` listed at 5/15): price such a snapshot in config if you still use it.
"""

from __future__ import annotations

from typing import Any

# Anthropic's cache writes (5-minute TTL) cost 1.25x input and cache reads 0.1x input.
DEFAULT_PRICES: dict[str, dict[str, Any]] = {
    # OpenAI (and Azure OpenAI, same names). Cached input is the automatic prefix cache's price.
    "gpt-4o": {"input": 2.50, "cached_input": 1.25, "output": 10.00,
               "context_window": 128_000, "max_output_tokens": 16_384, "cache": "openai"},
    "gpt-4o-mini": {"input": 0.15, "cached_input": 0.075, "output": 0.60,
                    "context_window": 128_000, "max_output_tokens": 16_384, "cache": "openai"},
    "gpt-4.1": {"input": 2.00, "cached_input": 0.50, "output": 8.00,
                "context_window": 1_047_576, "max_output_tokens": 32_768, "cache": "openai"},
    "gpt-4.1-mini": {"input": 0.40, "cached_input": 0.10, "output": 1.60,
                     "context_window": 1_047_576, "max_output_tokens": 32_768, "cache": "openai"},
    "gpt-4.1-nano": {"input": 0.10, "cached_input": 0.025, "output": 0.40,
                     "context_window": 1_047_576, "max_output_tokens": 32_768, "cache": "openai"},
    "o3": {"input": 2.00, "cached_input": 0.50, "output": 8.00,
           "context_window": 200_000, "max_output_tokens": 100_000, "cache": "openai"},
    # Listed so that `o3-mini` does not fall back to `o3` by prefix: it is priced like o4-mini.
    "o3-mini": {"input": 1.10, "cached_input": 0.55, "output": 4.40,
                "context_window": 200_000, "max_output_tokens": 100_000, "cache": "openai"},
    # The -pro models are listed so that they do not fall back by prefix to a model many times cheaper;
    # they have no cached-input price.
    "o3-pro": {"input": 20.00, "cached_input": 20.00, "output": 80.00,
               "context_window": 200_000, "max_output_tokens": 100_000, "cache": "none"},
    "o4-mini": {"input": 1.10, "cached_input": 0.275, "output": 4.40,
                "context_window": 200_000, "max_output_tokens": 100_000, "cache": "openai"},
    "gpt-5": {"input": 1.25, "cached_input": 0.125, "output": 10.00,
              "context_window": 400_000, "max_output_tokens": 128_000, "cache": "openai"},
    "gpt-5-mini": {"input": 0.25, "cached_input": 0.025, "output": 2.00,
                   "context_window": 400_000, "max_output_tokens": 128_000, "cache": "openai"},
    "gpt-5-nano": {"input": 0.05, "cached_input": 0.005, "output": 0.40,
                   "context_window": 400_000, "max_output_tokens": 128_000, "cache": "openai"},
    "gpt-5-pro": {"input": 15.00, "cached_input": 15.00, "output": 120.00,
                  "context_window": 400_000, "max_output_tokens": 272_000, "cache": "none"},
    # Anthropic. `cached_input` is the cache-read price, `cache_write` the 5-minute cache-write price.
    "claude-3-5-haiku": {"input": 0.80, "cached_input": 0.08, "cache_write": 1.00, "output": 4.00,
                         "context_window": 200_000, "max_output_tokens": 8_192, "cache": "anthropic"},
    "claude-3-7-sonnet": {"input": 3.00, "cached_input": 0.30, "cache_write": 3.75, "output": 15.00,
                          "context_window": 200_000, "max_output_tokens": 64_000, "cache": "anthropic"},
    # Sonnet 4 and 4.5 offer a 1M-token context in beta, billed higher above 200K input tokens: not modelled.
    "claude-sonnet-4": {"input": 3.00, "cached_input": 0.30, "cache_write": 3.75, "output": 15.00,
                        "context_window": 200_000, "max_output_tokens": 64_000, "cache": "anthropic"},
    "claude-sonnet-4-5": {"input": 3.00, "cached_input": 0.30, "cache_write": 3.75, "output": 15.00,
                          "context_window": 200_000, "max_output_tokens": 64_000, "cache": "anthropic"},
    "claude-opus-4": {"input": 15.00, "cached_input": 1.50, "cache_write": 18.75, "output": 75.00,
                      "context_window": 200_000, "max_output_tokens": 32_000, "cache": "anthropic"},
    "claude-opus-4-1": {"input": 15.00, "cached_input": 1.50, "cache_write": 18.75, "output": 75.00,
                        "context_window": 200_000, "max_output_tokens": 32_000, "cache": "anthropic"},
    "claude-haiku-4-5": {"input": 1.00, "cached_input": 0.10, "cache_write": 1.25, "output": 5.00,
                         "context_window": 200_000, "max_output_tokens": 64_000, "cache": "anthropic"},
}
