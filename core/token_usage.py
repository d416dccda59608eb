"""What one answer used, in tokens: the one typed form of an OpenAI `usage` object inside the broker.

Read once from a reply (`TokenUsage.from_body`) and carried as a value from then on: nothing downstream
parses a JSON body's `usage` again. `cached_tokens` and `cache_write_tokens` are parts of
`prompt_tokens` (OpenAI's `prompt_tokens_details.cached_tokens`; Anthropic's cache reads and writes, as
its provider translates them). `counted` marks usage the broker counted itself because the provider
reported none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenUsage:
    """Prompt and completion tokens of one answer, with the prompt's cached and cache-written parts."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    counted: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_body(cls, body: Any) -> TokenUsage | None:
        """The usage a reply body (or a bare `usage` mapping) reports; None when it reports none."""
        usage = body.get("usage") if isinstance(body, dict) and "usage" in body else body
        if not isinstance(usage, dict):
            return None
        prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
        if prompt is None and completion is None:
            return None
        details = usage.get("prompt_tokens_details")
        # OpenAI nests the cached part; a member's apportioned share (and the cluster wire) carries it flat.
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else _count(usage.get("cached_tokens"))
        written = _count(usage.get("cache_creation_input_tokens"))
        return cls(prompt or 0, completion or 0, min(cached or 0, prompt or 0), min(written or 0, prompt or 0))

    def as_body(self) -> dict[str, Any]:
        """The OpenAI `usage` object for this usage (with `prompt_tokens_details` when anything was cached)."""
        body: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                                "total_tokens": self.total_tokens}
        if self.cached_tokens:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return body


NO_USAGE = TokenUsage()


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
