"""What a model's tokens cost, and how a model name finds its price.

A `ModelPrice` holds USD per million tokens (input, cached input, output, and Anthropic's cache write), the
model's limits, and the provider's cache style. `cost_usd` bills one call with OpenAI's usage semantics: the
cached and cache-written tokens are part of `prompt_tokens` (Anthropic usage is translated into that shape
at the provider boundary), so only the rest is billed at the full input price.

A `PriceTable` is built from, in rising precedence: the shipped defaults (`default_prices`), an optional
file in LiteLLM's `model_prices_and_context_window.json` format, and the operator's config. `get(model)`
tries, in order: the exact name; the name without a provider prefix (`openai/`, `azure/`, `anthropic/`);
that without a date suffix (`-2024-08-06`, `-20241022`); then the longest known name the rest begins with
at a `-`, `:` or `@` (`gpt-4o-mini-foo` -> `gpt-4o-mini`). The last two steps assume a snapshot or variant
is priced like its base model; one that is not belongs in config. An unknown model has no price (None):
callers treat it as unpriced rather than guess.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeGuard

from mergebroker.merge.default_prices import DEFAULT_PRICES

_PER_MILLION = 1_000_000


class CacheStyle(StrEnum):
    """How a provider discounts a repeated prompt prefix."""

    OPENAI = "openai"  # automatic: prefixes of >= 1,024 tokens, in 128-token steps, no write premium
    ANTHROPIC = "anthropic"  # explicit `cache_control` breakpoints; reads ~0.1x input, writes ~1.25x input
    NONE = "none"


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """One model's list prices in USD per million tokens, its limits, and its provider's cache style.

    `cache_write` None means cache writes cost the input price (no premium). Prices must be non-negative
    numbers and limits positive integers; anything else raises ValueError naming the field.
    """

    input: float
    cached_input: float
    output: float
    cache_write: float | None = None
    context_window: int | None = None
    max_output_tokens: int | None = None
    cache: CacheStyle = CacheStyle.NONE

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output", "cache_write"):
            value = getattr(self, name)
            if value is None and name == "cache_write":
                continue
            if not _is_number(value) or value < 0:
                raise ValueError(f"field {name!r} must be a non-negative number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("context_window", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value <= 0):
                raise ValueError(f"field {name!r} must be a positive integer, got {value!r}")
        try:
            object.__setattr__(self, "cache", CacheStyle(self.cache))
        except ValueError:
            styles = ", ".join(s.value for s in CacheStyle)
            raise ValueError(f"field 'cache' must be one of {styles}, got {self.cache!r}") from None


def cost_usd(price: ModelPrice, prompt_tokens: int, cached_tokens: int = 0, cache_write_tokens: int = 0,
             completion_tokens: int = 0) -> float:
    """The bill of one call in USD.

    `cached_tokens` (read from the provider's cache, at `cached_input`) and `cache_write_tokens` (written to
    it, at `cache_write`, or `input` when the model has no write price) are both part of `prompt_tokens`;
    the remaining prompt tokens cost `input` and the completion costs `output`.
    """
    if min(prompt_tokens, cached_tokens, cache_write_tokens, completion_tokens) < 0:  # one check for every bill
        counts = {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
                  "cache_write_tokens": cache_write_tokens, "completion_tokens": completion_tokens}
        name, value = next((name, value) for name, value in counts.items() if value < 0)
        raise ValueError(f"{name} must not be negative, got {value}")
    if cached_tokens + cache_write_tokens > prompt_tokens:
        raise ValueError("cached_tokens + cache_write_tokens must not exceed prompt_tokens "
                         f"({cached_tokens} + {cache_write_tokens} > {prompt_tokens})")
    fresh = prompt_tokens - cached_tokens - cache_write_tokens
    write_price = price.input if price.cache_write is None else price.cache_write
    micro = (fresh * price.input + cached_tokens * price.cached_input + cache_write_tokens * write_price
             + completion_tokens * price.output)
    return micro / _PER_MILLION


class PriceTable:
    """Prices by model name, with the name normalisation of the module docstring.

    `aliases` maps a name (an Azure deployment, say) to the model it serves, e.g. `{"prod-4o": "gpt-4o"}`;
    an alias is tried at each normalisation step before the price names themselves.
    """

    def __init__(self, prices: Mapping[str, ModelPrice], aliases: Mapping[str, str] | None = None) -> None:
        self._prices = {name.lower(): price for name, price in prices.items()}
        self._aliases = {name.lower(): target.lower() for name, target in (aliases or {}).items()}
        self._resolved: dict[str, str | None] = {}  # every priced request asks; the table never changes

    @classmethod
    def build(cls, config: Mapping[str, Mapping[str, Any]] | None = None, *,
              litellm_path: str | Path | None = None, aliases: Mapping[str, str] | None = None) -> PriceTable:
        """The defaults, then the LiteLLM file's entries (if given), then `config`'s, each overriding the last."""
        prices = parse_prices(DEFAULT_PRICES)
        if litellm_path is not None:
            prices.update(prices_from_litellm(json.loads(Path(litellm_path).read_text(encoding="utf-8"))))
        prices.update(parse_prices(config or {}, known=prices))
        return cls(prices, aliases)

    def get(self, model: str) -> ModelPrice | None:
        """The price of `model`, or None when no name matches (the model is unpriced)."""
        name = self.resolve(model)
        return None if name is None else self._prices[name]

    def resolve(self, model: str) -> str | None:
        """The table's name for `model` (see the module docstring), or None."""
        if model in self._resolved:
            return self._resolved[model]
        if len(self._resolved) >= _RESOLVED_MAX:
            self._resolved.clear()  # names come from clients: the memo stays bounded
        found = self._resolved[model] = self._match(model.strip().lower(), self._aliases)
        return found

    def __len__(self) -> int:
        return len(self._prices)

    def _match(self, name: str, aliases: Mapping[str, str]) -> str | None:
        candidates = list(_candidates(name))
        for candidate in candidates:
            if candidate in aliases:
                # An alias names a model, never another alias.
                return self._match(aliases[candidate], {})
            if candidate in self._prices:
                return candidate
        return self._longest_prefix(candidates[-1])

    def _longest_prefix(self, name: str) -> str | None:
        best: str | None = None
        for known in self._prices:
            if (name.startswith(known) and len(name) > len(known) and name[len(known)] in _PREFIX_BOUNDARY
                    and (best is None or len(known) > len(best))):
                best = known
        return best


_RESOLVED_MAX = 1024
"""Model names whose resolution `PriceTable` remembers (an unpriced name costs a scan of the whole table)."""

# A `.` is not a boundary: `gpt-4.1` must not fall back to a `gpt-4` entry.
_PREFIX_BOUNDARY = "-:@"
_DATE_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8})$")


def _candidates(name: str) -> Iterator[str]:
    """`name`, then without its provider prefix, then also without its date suffix (each only if new)."""
    yield name
    bare = name.rsplit("/", 1)[-1]
    if bare != name:
        yield bare
    undated = _DATE_SUFFIX.sub("", bare)
    if undated != bare:
        yield undated


_CONFIG_FIELDS = ("input", "cached_input", "cache_write", "output", "context_window", "max_output_tokens", "cache")
_REQUIRED_FIELDS = ("input", "cached_input", "output")
# Facts about the model rather than prices: an override of a known model that leaves them out keeps them.
_INHERITED_FIELDS = ("context_window", "max_output_tokens", "cache")


def parse_prices(config: Mapping[str, Mapping[str, Any]],
                 known: Mapping[str, ModelPrice] | None = None) -> dict[str, ModelPrice]:
    """Config-shaped entries (`{model: {input, cached_input, output, cache_write?, context_window?,
    max_output_tokens?, cache?}}`) as prices, keyed by lower-case name.

    Every price must be stated; `context_window`, `max_output_tokens` and `cache` left out of an entry for a
    model in `known` are taken from there. A new model's `cache` defaults to "anthropic" when it has a
    `cache_write` price, else "openai" when cached input is cheaper than input, else "none". A malformed
    entry raises ValueError naming the model and the field.
    """
    known = known or {}
    return {model.lower(): _parse_entry(model, entry, known.get(model.lower())) for model, entry in config.items()}


def _parse_entry(model: str, entry: Mapping[str, Any], known: ModelPrice | None) -> ModelPrice:
    if not isinstance(entry, Mapping):
        # A ValueError like every other config mistake, so that settings code catches one type.
        raise ValueError(f"price of {model!r}: expected a mapping of fields, got {type(entry).__name__}")
    for field in entry:
        if field not in _CONFIG_FIELDS:
            raise ValueError(f"price of {model!r}: unknown field {field!r} (known: {', '.join(_CONFIG_FIELDS)})")
    for field in _REQUIRED_FIELDS:
        if field not in entry:
            raise ValueError(f"price of {model!r}: missing field {field!r}")
    fields = dict(entry)
    for field in _INHERITED_FIELDS:
        if field not in fields and known is not None:
            fields[field] = getattr(known, field)
    fields.setdefault("cache", _inferred_style(fields))
    try:
        return ModelPrice(**fields)
    except ValueError as exc:
        raise ValueError(f"price of {model!r}: {exc}") from None


def _inferred_style(fields: Mapping[str, Any]) -> CacheStyle:
    if fields.get("cache_write") is not None:
        return CacheStyle.ANTHROPIC
    cheaper = _is_number(fields["cached_input"]) and _is_number(fields["input"])
    return CacheStyle.OPENAI if cheaper and fields["cached_input"] < fields["input"] else CacheStyle.NONE


# LiteLLM's modes for models answered by a chat call; embeddings, images, audio and rerank are left out.
_LITELLM_CHAT_MODES = frozenset({"chat", "responses"})


def prices_from_litellm(data: Mapping[str, Any]) -> dict[str, ModelPrice]:
    """The chat models of a parsed LiteLLM `model_prices_and_context_window.json`, per million tokens.

    Entries without numeric input and output prices per token, or of a non-chat `mode`, are skipped, as is
    the file's `sample_spec`. The cache style is "anthropic" for Claude models (by `litellm_provider` or
    name), else "openai" when `cache_read_input_token_cost` is below the input price, else "none".
    """
    prices: dict[str, ModelPrice] = {}
    for model, entry in data.items():
        if model == "sample_spec" or not isinstance(entry, Mapping):
            continue
        price = _litellm_price(model, entry)
        if price is not None:
            prices[model.lower()] = price
    return prices


def _litellm_price(model: str, entry: Mapping[str, Any]) -> ModelPrice | None:
    if entry.get("mode", "chat") not in _LITELLM_CHAT_MODES:
        return None
    inp, out = entry.get("input_cost_per_token"), entry.get("output_cost_per_token")
    if not (_is_number(inp) and _is_number(out)) or inp < 0 or out < 0:
        return None
    read = _per_million(entry.get("cache_read_input_token_cost"))
    write = _per_million(entry.get("cache_creation_input_token_cost"))
    inp_m = _per_million(inp)
    provider = str(entry.get("litellm_provider", "")).lower()
    if "anthropic" in provider or "claude" in model.lower():
        style = CacheStyle.ANTHROPIC
    else:
        style = CacheStyle.OPENAI if read is not None and read < inp_m else CacheStyle.NONE
    return ModelPrice(input=inp_m, cached_input=inp_m if read is None else read, output=_per_million(out),
                      cache_write=write, context_window=_positive_int(entry.get("max_input_tokens")),
                      max_output_tokens=_positive_int(entry.get("max_output_tokens")), cache=style)


def _per_million(per_token: Any) -> Any:
    # Rounded so that 2.5e-06 per token reads back as 2.5, not 2.4999999999999996.
    if not _is_number(per_token) or per_token < 0:
        return None
    return round(per_token * _PER_MILLION, 9)


def _positive_int(value: Any) -> int | None:
    return int(value) if _is_number(value) and value >= 1 and float(value).is_integer() else None


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
