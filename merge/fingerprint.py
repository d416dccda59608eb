"""Cache and coalescing keys: a SHA-256 over a canonical JSON of everything that shapes the answer.

Two requests get the same fingerprint only when an upstream would treat them alike: message text is
compared after whitespace normalisation (and, optionally, lower-casing), an absent field equals a null
one, `1` equals `1.0`, and `max_completion_tokens` stands in for `max_tokens`. Anything else that can
change the answer (sampling knobs, tools, response format) is part of the key.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping

_WHITESPACE = re.compile(r"\s+")

# Request fields that change what the model answers (max_tokens and stop are canonicalised apart).
# Those from frequency_penalty on go beyond the brief's list: each changes the output too, and a
# false cache hit is worse than a miss.
_ANSWER_FIELDS = (
    "model", "temperature", "top_p", "seed", "tools", "tool_choice",
    "response_format", "n", "logprobs", "top_logprobs",
    "frequency_penalty", "presence_penalty", "logit_bias", "functions", "function_call",
    "parallel_tool_calls", "reasoning_effort", "modalities", "audio", "prediction",
)
# Message fields besides role/name/content that carry conversation state (tool turns).
_MESSAGE_STATE_FIELDS = ("tool_calls", "tool_call_id", "function_call")


def normalize_text(text: str, *, lowercase: bool) -> str:
    """Strip `text`, collapse every whitespace run to one space and optionally lower-case it."""
    text = _WHITESPACE.sub(" ", text).strip()
    return text.lower() if lowercase else text


def chat_fingerprint(body: Mapping[str, Any], *, lowercase: bool = True, cache_version: str = "1") -> str:
    """Return the hex SHA-256 key of a chat completion body (see the module docstring for the rule)."""
    canonical: dict[str, Any] = {"kind": "chat", "cache_version": cache_version}
    for field in _ANSWER_FIELDS:
        canonical[field] = canonical_value(body.get(field))
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    canonical["max_tokens"] = canonical_value(max_tokens)
    canonical["stop"] = canonical_stop(body.get("stop"))
    messages = body.get("messages") or []
    canonical["messages"] = [_canonical_message(m, lowercase) for m in messages]
    return _digest(canonical)


def embedding_fingerprint(
    model: str, text: str, *, dimensions: int | None, cache_version: str, lowercase: bool = False
) -> str:
    """Return the hex SHA-256 key of one embedding input (whitespace-normalised text)."""
    canonical = {
        "kind": "embedding",
        "model": model,
        "text": normalize_text(text, lowercase=lowercase),
        "dimensions": dimensions,
        "cache_version": cache_version,
    }
    return _digest(canonical)


def _canonical_message(message: Any, lowercase: bool) -> Any:
    if not isinstance(message, Mapping):
        return canonical_value(message)
    out = {
        "role": message.get("role"),
        "name": message.get("name"),
        "content": _canonical_content(message.get("content"), lowercase),
    }
    for field in _MESSAGE_STATE_FIELDS:
        out[field] = canonical_value(message.get(field))
    return _drop_nulls(out)


def _canonical_content(content: Any, lowercase: bool) -> Any:
    if isinstance(content, str):
        return normalize_text(content, lowercase=lowercase)
    if isinstance(content, list):
        return [_canonical_part(part, lowercase) for part in content]
    return canonical_value(content)


def _canonical_part(part: Any, lowercase: bool) -> Any:
    if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return {**canonical_value(part), "text": normalize_text(part["text"], lowercase=lowercase)}
    return canonical_value(part)


def canonical_stop(stop: Any) -> Any:
    """Canonical form of a `stop` field: "x" and ["x"] stop alike, and order does not matter."""
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return sorted(set(stop)) or None
    return canonical_value(stop)


def canonical_value(value: Any) -> Any:
    """Make JSON-equal values serialise equally: drop nulls in objects, write integral floats as ints."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        return _drop_nulls({str(k): canonical_value(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return [canonical_value(v) for v in value]
    return str(value)


def _drop_nulls(mapping: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if v is not None}


def _digest(canonical: dict[str, Any]) -> str:
    payload = json.dumps(_drop_nulls(canonical), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()
