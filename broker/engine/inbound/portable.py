"""The chat form of a translated request, cut to what every upstream kind carries (pure).

A Responses or Messages request translated to Chat Completions may be served by any upstream of its
model: OpenAI-compatible, Azure, or Anthropic (through its own chat translation, which refuses fields it
cannot carry). Translated requests are agents' traffic, which must keep working rather than be refused,
so the chat body keeps only the fields all of them take; the rest is dropped and named, like any field
the translation could not carry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

PORTABLE_FIELDS = frozenset({
    "model", "messages", "max_completion_tokens", "max_tokens", "stop", "stream", "stream_options", "user",
    "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls", "response_format", "prompt_cache_key",
    "broker"})
"""Chat fields every upstream kind takes (the Anthropic translation carries each of these)."""

_REASONING_MODELS = re.compile(r"^(o\d|gpt-5|gpt-oss)", re.IGNORECASE)
"""Models that take `reasoning_effort`; others refuse it."""


def portable(body: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`body` without the fields some upstream kind refuses, and the names of those dropped.

    `reasoning_effort` stays for the models that take it (OpenAI's reasoning models)."""
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    reasoning = bool(_REASONING_MODELS.match(str(body.get("model") or "")))
    for name, value in body.items():
        if name in PORTABLE_FIELDS or (name == "reasoning_effort" and reasoning):
            kept[name] = value
        elif value is not None:
            dropped.append(name)
    return kept, tuple(dropped)


DROPPED_HEADER = "X-Broker-Dropped"
"""The response header naming what a translation could not carry (comma-separated field names)."""


def dropped_header(names: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The header naming the dropped fields, when any were."""
    unique = list(dict.fromkeys(names))
    return {DROPPED_HEADER: ", ".join(unique)[:1024]} if unique else {}
