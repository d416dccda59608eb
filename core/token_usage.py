"""What one answer used, in tokens: the one typed form of a provider's `usage` inside the broker.

Read once from a reply (`TokenUsage.from_body`, the one reader) and carried as a value from then on:
nothing downstream parses a JSON body's `usage` again. The reader knows every shape a provider reports:
OpenAI chat (`prompt_tokens`, `prompt_tokens_details.cached_tokens`), OpenAI Responses (`input_tokens`,
`input_tokens_details.cached_tokens`, `output_tokens_details.reasoning_tokens`), Anthropic (`input_tokens`
that excludes `cache_read_input_tokens` and `cache_creation_input_tokens`), DeepSeek
(`prompt_cache_hit_tokens`), and the flat form the broker's own wire carries. The writers (`as_body`,
`as_responses`, `as_anthropic`) turn it back into each API's shape.

`cached_tokens` and `cache_write_tokens` are parts of `prompt_tokens`; `reasoning_tokens` is a part of
`completion_tokens`. `counted` marks usage the broker counted itself because the provider reported none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mergebroker.frozen_init import direct_init


@direct_init  # built on every request
@dataclass(frozen=True)
class TokenUsage:
    """Prompt and completion tokens of one answer, with the prompt's cached and cache-written parts."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    counted: bool = False
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def uncached_prompt_tokens(self) -> int:
        """The prompt tokens neither read from nor written to the provider's cache."""
        return max(0, self.prompt_tokens - self.cached_tokens - self.cache_write_tokens)

    @classmethod
    def from_body(cls, body: Any) -> TokenUsage | None:
        """The usage a reply body (or a bare `usage` mapping) reports, in any provider's shape; None when
        it reports none."""
        usage = body.get("usage") if isinstance(body, dict) and "usage" in body else body
        if not isinstance(usage, dict):
            return None
        if "prompt_tokens" in usage or "completion_tokens" in usage:
            return _chat_usage(usage)
        if "input_tokens" in usage or "output_tokens" in usage:
            return _input_output_usage(usage)
        return None

    def as_body(self) -> dict[str, Any]:
        """The OpenAI chat `usage` object (with `prompt_tokens_details` when anything was cached)."""
        body: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                                "total_tokens": self.total_tokens}
        if self.cached_tokens:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.reasoning_tokens:
            body["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return body

    def as_fields(self) -> dict[str, int | bool]:
        """Every field by name: the broker's own wire form (the cluster's replies), read back by `from_fields`."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "cache_write_tokens": self.cache_write_tokens,
                "reasoning_tokens": self.reasoning_tokens, "counted": self.counted}

    @classmethod
    def from_fields(cls, fields: Any) -> TokenUsage | None:
        """`as_fields`'s mapping back into a value; None when it is not one (a peer of another version)."""
        if not isinstance(fields, dict):
            return None
        counts = {name: _count(fields.get(name, 0)) for name in _FIELD_COUNTS}
        if any(v is None for v in counts.values()):
            return None
        return cls(**counts, counted=fields.get("counted") is True)  # type: ignore[arg-type]

    def as_embeddings(self) -> dict[str, Any]:
        """The OpenAI embeddings `usage` object (input only)."""
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens}

    def as_responses(self) -> dict[str, Any]:
        """The OpenAI Responses `usage` object (its detail objects are always present, as its types require)."""
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens,
                                                                    "cache_write_tokens": self.cache_write_tokens},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.total_tokens}

    def as_anthropic(self) -> dict[str, Any]:
        """The Anthropic Messages `usage` object: `input_tokens` excludes the cache reads and writes."""
        return {"input_tokens": self.uncached_prompt_tokens, "output_tokens": self.completion_tokens,
                "cache_read_input_tokens": self.cached_tokens,
                "cache_creation_input_tokens": self.cache_write_tokens}


NO_USAGE = TokenUsage()
_FIELD_COUNTS = ("prompt_tokens", "completion_tokens", "cached_tokens", "cache_write_tokens", "reasoning_tokens")


def _chat_usage(usage: Mapping[str, Any]) -> TokenUsage | None:
    prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    if prompt is None and completion is None:
        return None
    details = usage.get("prompt_tokens_details")
    # OpenAI nests the cached part; DeepSeek names it `prompt_cache_hit_tokens`; a member's apportioned
    # share (and the cluster wire) carries it flat.
    if isinstance(details, dict):
        cached = _count(details.get("cached_tokens"))
    else:
        cached = _count(usage.get("cached_tokens"))
        if cached is None:
            cached = _count(usage.get("prompt_cache_hit_tokens"))
    written = _count(usage.get("cache_creation_input_tokens"))
    completion_details = usage.get("completion_tokens_details")
    reasoning = _count(completion_details.get("reasoning_tokens")) if isinstance(completion_details, dict) else None
    prompt, completion = prompt or 0, completion or 0
    return TokenUsage(prompt, completion, min(cached or 0, prompt), min(written or 0, prompt),
                      reasoning_tokens=min(reasoning or 0, completion))


def _input_output_usage(usage: Mapping[str, Any]) -> TokenUsage | None:
    """Responses usage (`input_tokens` includes the cached part) or Anthropic's (it excludes cache reads
    and writes, reported beside it)."""
    given, completion = _count(usage.get("input_tokens")), _count(usage.get("output_tokens"))
    if given is None and completion is None:
        return None
    given, completion = given or 0, completion or 0
    output_details = usage.get("output_tokens_details")
    reasoning = _count(output_details.get("reasoning_tokens")) if isinstance(output_details, dict) else None
    reasoning = min(reasoning or 0, completion)
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage or "cache_creation" in usage:
        read = _count(usage.get("cache_read_input_tokens")) or 0
        written = _count(usage.get("cache_creation_input_tokens"))
        if written is None:
            written = _cache_creation_sum(usage.get("cache_creation"))
        return TokenUsage(given + read + written, completion, read, written, reasoning_tokens=reasoning)
    details = usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    written = _count(details.get("cache_write_tokens")) if isinstance(details, dict) else None
    cached = min(cached or 0, given)
    return TokenUsage(given, completion, cached, min(written or 0, given - cached), reasoning_tokens=reasoning)


def _cache_creation_sum(detail: Any) -> int:
    """Anthropic's `cache_creation` split by lifetime (`ephemeral_5m_input_tokens`, `ephemeral_1h_...`)."""
    if not isinstance(detail, dict):
        return 0
    return sum(_count(v) or 0 for v in detail.values())


def _count(value: Any) -> int | None:
    if type(value) is int:  # what JSON gives, or nothing: both answered before the general checks
        return value if value >= 0 else None
    if value is None:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
